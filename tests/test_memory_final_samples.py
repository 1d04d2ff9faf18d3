"""The memory estimate (tpflow.memory, `tpflow validate --gpu-memory`) for the optimizers on final samples (NFT, AWM,
DGPO): their training step measured alike on fake and real tensors, the transformer rows it sees, the copies of the
trained parameters they keep, the KL reference only where a reference pass runs, and the rollouts' final latents
only. Tiny models: seconds each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import tpflow.memory as me
from tests.cli_run import tpflow
from tpflow.memory.accounting import state_rows
from tpflow.registry import get

OPTIONS = {"nft": {}, "awm": {}, "dgpo": {"train_guidance": 1.0}}  # DGPO trains without CFG (its code's default)


def final_sample_setup(name: str, precision: str = "bf16", **options) -> me.Setup:
    """tiny-sd3's test setup (CFG 4.5 rollouts, micro-batches of 2) trained by ``name`` under ``precision``."""
    base = me.tiny_setup("sd3")
    opts = get("optimizer", name).options(micro_batch_size=2, **{**OPTIONS[name], **options})
    train = base.train.model_copy(update={"mixed_precision": precision})
    return dataclasses.replace(base, optimizer=opts, optimizer_name=name, train=train)


def _training_peaks(setup: me.Setup, fake: bool) -> dict:
    """``measure``'s training-step peaks (checkpointing off, then on) and the rows the transformer saw, without its
    rollout call and decode, which these tests do not read."""
    with me.Probe(setup, fake) as probe:
        peaks = {f"train_act_ckpt_{c}": probe.train(setup.optimizer.micro_batch_size, c) for c in (False, True)}
        return {**peaks, "train_rows": probe.train_rows}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_final_sample_step_measures_alike_on_fake_and_real_tensors(name):
    """Under bf16 autocast (no weight cache, as tpflow.precision's regions): the v_θ forward keeps its graph, the
    fake and the real measurement agree byte for byte, checkpointing lowers the peak, and the rows the transformer
    saw follow the optimizer's training guidance (NFT and AWM at the rollout's CFG 4.5: doubled; DGPO at 1)."""
    setup = final_sample_setup(name)
    fake, real = _training_peaks(setup, fake=True), _training_peaks(setup, fake=False)
    keys = ("train_act_ckpt_False", "train_act_ckpt_True")
    assert all(real[k] > 0 for k in keys)
    assert {k: fake[k] for k in keys} == {k: real[k] for k in keys}
    assert fake["train_act_ckpt_True"] < fake["train_act_ckpt_False"]
    assert fake["train_rows"] == real["train_rows"] == (2 if name == "dgpo" else 4)


def test_kept_copies_enter_the_state_and_the_reference_only_with_a_reference_pass():
    """Each of NFT, AWM and DGPO keeps one fp32 copy of the trained parameters (GRPO none); a full fine-tune keeps
    the frozen reference only when the optimizer runs a reference pass: NFT's beta is its mixing coefficient, not
    a KL, so beta = 1 with kl_weight = 0 keeps none."""
    m = {"lora_params": 1000, "transformer_bytes": 5000}
    grpo = me.tiny_setup("sd3")
    assert not any("copy of the trained" in row[0] for row in state_rows(grpo, m))
    for name in OPTIONS:
        kept = [row for row in state_rows(final_sample_setup(name), m) if "copy of the trained" in row[0]]
        assert [(row[1], row[3]) for row in kept] == [(4000, True)] and name in kept[0][0]
    full = dataclasses.replace(grpo, backbone=grpo.backbone.model_copy(update={"finetune": "full"}))

    def reference(setup: me.Setup) -> int:
        return next(row[1] for row in state_rows(setup, m) if row[0].startswith("KL reference"))

    nft = dataclasses.replace(full, optimizer=get("optimizer", "nft").options(beta=1.0, kl_weight=0.0),
                              optimizer_name="nft")  # fmt: skip
    assert reference(nft) == 0
    assert reference(dataclasses.replace(nft, optimizer=nft.optimizer.model_copy(update={"kl_weight": 0.1}))) == 4000


def test_the_epoch_buffers_of_final_samples_are_what_such_a_rollout_keeps():
    """A rollout for an optimizer on final samples stores no window (W = 0): its kept tensors' bytes are the
    estimate's epoch buffers."""
    from tpflow.registry import build
    from tpflow.rollout import Window, rollout

    setup, n = final_sample_setup("awm", precision="no"), 2
    backbone = me.build_backbone(setup.kind, setup.transformer_cfg, setup.vae_cfg, setup.backbone)
    cond = me.conditioning(backbone, setup.kind, n, setup.text_len)
    out = rollout(backbone, build("sampler", "cps"), cond, me.latents(backbone, n), backbone.sigmas(4), Window(0, 1),
                  0.0, setup.rollout.guidance, None, transitions=False)  # fmt: skip
    kept = [out.latents, out.next_latents, out.log_probs, out.sigmas, out.final, *cond.tensors.values()]
    with me.Probe(setup, True) as probe:
        m = probe.statics()  # the sizes the buffers are counted from
    buffers = me.epoch_buffers(setup, m, n)
    assert buffers["rollout"] == sum(t.numel() * t.element_size() for t in kept)
    assert buffers["rollout"] < me.epoch_buffers(me.tiny_setup("sd3"), m, n)["rollout"]  # GRPO stores its window


@pytest.mark.parametrize("recipe", ["geneval_awm", "geneval_dgpo"])
def test_validate_prints_the_estimate_of_the_final_sample_recipes(recipe, monkeypatch, tmp_path):
    """`tpflow validate --gpu-memory` estimates the SD3.5-M AWM and DGPO recipes (the published transformer and VAE
    swapped for tiny-sd3's sizes, at 32 px, to stay fast) instead of warning that it models GRPO's step only."""
    from tpflow.memory import TINY_SD3, TINY_VAE, configs

    monkeypatch.setitem(configs.PUBLISHED, "sd3.5-medium", configs.Model("SD3.5-Medium test size", "sd3", TINY_SD3,
                                                                          TINY_VAE))  # fmt: skip
    text = (Path(__file__).resolve().parent.parent / "recipes" / "sd35" / f"{recipe}.toml").read_text()
    assert "resolution = 512" in text
    path = tmp_path / f"{recipe}.toml"
    path.write_text(text.replace("resolution = 512", "resolution = 32"))
    out = tpflow("validate", str(path), "--no-machine", "--gpu-memory", "80")
    assert "Traceback" not in out.stdout + out.stderr
    assert "memory per GPU on 1 process (SD3.5-Medium test size; estimated" in out.stdout, out.stderr
    assert "training micro-batch" in out.stdout and "verdict (estimate): fits in 80 GiB per GPU" in out.stdout
    assert "memory estimate failed" not in out.stderr and "no memory estimate" not in out.stderr
