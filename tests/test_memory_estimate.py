"""tpflow.memory (the estimate behind benchmarks/memory_estimate.py and `tpflow validate --gpu-memory`): the
live-bytes tracker, fake versus real tensors, and the formulas it relies on."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "memory_estimate.py"


@pytest.fixture(scope="module")
def me():
    import tpflow.memory

    return tpflow.memory


@pytest.fixture(scope="module")
def tiny_sd3(me):
    """The fake-tensor and the real-tensor measurement of the same tiny SD3 setup (both run the same code)."""
    setup = me.tiny_setup("sd3")
    return setup, me.measure(setup, fake=True), me.measure(setup, fake=False)


def test_tracker_counts_weights_and_their_release(me):
    from diffusers import SD3Transformer2DModel

    with FakeTensorMode(allow_non_fake_inputs=True), me.LiveBytes() as tracker, me.fake_module_to():
        model = SD3Transformer2DModel(**me.TINY_SD3).to(torch.float16)
        expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert tracker.live == expected  # fp32 originals were freed by the cast, the fp16 copies remain
        del model
        gc.collect()
        assert tracker.live == 0


def test_fake_estimate_equals_real_cpu_measurement(tiny_sd3):
    _, fake, real = tiny_sd3
    keys = ("rollout_act", "decode_act", "train_act_ckpt_False", "train_act_ckpt_True")
    assert all(real[k] > 0 for k in keys)
    assert {k: fake[k] for k in keys} == {k: real[k] for k in keys}  # byte for byte
    # everything alive after building (a few scalar scheduler tensors differ by some bytes)
    assert fake["weights_tracked"] == pytest.approx(real["weights_tracked"], rel=1e-4)
    assert any("flash_attention" in op for op in fake["attention_ops"])  # no L x L math attention


def test_gradient_checkpointing_lowers_the_training_peak(tiny_sd3):
    _, fake, _ = tiny_sd3
    assert fake["train_act_ckpt_True"] < fake["train_act_ckpt_False"]


def test_activations_grow_with_rows(me):
    setup = me.tiny_setup("flux")
    peaks = []
    with FakeTensorMode(allow_non_fake_inputs=True), me.LiveBytes() as tracker:
        backbone = me.build_backbone(setup.kind, setup.transformer_cfg, setup.vae_cfg, setup.backbone)
        for rows in (2, 4, 8):
            cond, z = me.conditioning(backbone, setup.kind, rows, setup.text_len), me.latents(backbone, rows)
            with torch.no_grad():
                before = tracker.reset_peak()
                backbone.velocity(z, torch.full((rows,), 0.5), cond, 3.5)
            peaks.append(tracker.peak - before)
    assert 0 < peaks[0] < peaks[1] < peaks[2]


@pytest.mark.parametrize(
    ("steps", "width", "start", "baseline"),
    [(10, 9, 0, "shared"), (6, 5, 0, "shared"), (8, 3, 2, "shared"), (8, 3, 2, "independent"), (5, 5, 0, "shared")],
)
def test_rollout_rows_match_the_rollout_engine(me, tiny_weights, steps, width, start, baseline):
    """The rows of every velocity call of a real (tiny shapes-dit) rollout are the rows the estimate counts."""
    from tpflow.devices import cpu_generator
    from tpflow.registry import build
    from tpflow.rollout import Window, rollout

    n = 3
    backbone = build("backbone", "shapes-dit", weights=str(tiny_weights))
    calls: list[int] = []
    velocity = backbone.velocity
    backbone.velocity = lambda z, sigma, cond, guidance: calls.append(z.shape[0]) or velocity(z, sigma, cond, guidance)
    cond, generator = backbone.encode(["a red circle"] * n), cpu_generator(0)
    with torch.no_grad():
        rollout(backbone, build("sampler", "cps"), cond, backbone.initial_noise(n, generator), backbone.sigmas(steps),
                Window(start, width), 0.7, 1.0, "ode", baseline, generator=generator)  # fmt: skip
    assert calls == me.rollout_rows(steps, width, start, n, baseline_noise=baseline)


def test_epoch_buffer_formula_matches_a_real_rollout(me, tiny_sd3):
    from tpflow.registry import build
    from tpflow.rollout import Window, rollout

    setup, fake, _ = tiny_sd3
    r, n = setup.rollout, 2
    backbone = me.build_backbone(setup.kind, setup.transformer_cfg, setup.vae_cfg, setup.backbone)
    cond = me.conditioning(backbone, setup.kind, n, setup.text_len)
    out = rollout(backbone, build("sampler", "cps"), cond, me.latents(backbone, n), backbone.sigmas(r.num_steps),
                  Window(0, r.window_size), r.noise_level, r.guidance, "ode")  # fmt: skip
    kept = [  # what the trainer keeps of a rollout once it is scored: no completions, no decoded images
        out.latents,
        out.next_latents,
        out.log_probs,
        out.sigmas,
        out.final,
        *cond.tensors.values(),
    ]
    buffers = me.epoch_buffers(setup, fake, n)
    assert buffers["rollout"] == buffers["rollout_copy"] == sum(t.numel() * t.element_size() for t in kept)


def test_report_has_the_table_the_totals_and_the_caveat(me, tiny_sd3):
    setup, fake, _ = tiny_sd3
    text = me.report(setup, fake, unit=2**10)
    assert "| component | KiB | note |" in text and "**estimated peak, one process**" in text
    assert "update peak, no checkpointing (recipe) (KiB) | update peak, checkpointing (KiB)" in text
    assert "estimated, not measured on a gpu" in me.CAVEATS.lower()


def test_a_sharded_full_fine_tune_holds_its_share_plus_two_blocks(me):
    """``finetune = "full"`` and ``shard = "fsdp"``: the trained state is fp32 weights, gradients, two moments, EMA
    and (beta > 0) the reference copy, 24 bytes per parameter, each process holding 1/P of it plus two gathered
    blocks; one process holds all of it. The fake estimate equals the real tiny model's."""
    setup = me.tiny_setup("sd3")
    setup.backbone = setup.backbone.model_copy(update={"finetune": "full"})
    setup.train = setup.train.model_copy(update={"shard": "fsdp"})
    fake, real = me.measure(setup, fake=True), me.measure(setup, fake=False)
    block = fake["largest_block_bytes"]
    assert fake["lora_params"] == real["lora_params"] > 0 and block == real["largest_block_bytes"] > 0
    rows = me.state_rows(setup, fake)
    n = fake["lora_params"]
    trained = sum(v for _, v, _, sharded in rows if sharded)
    assert trained == n * (4 + 4 + 8 + 4 + 4)  # masters, grads, AdamW, EMA, reference (beta > 0)
    whole = me.static_bytes(setup, fake, rows, 1)
    assert whole == sum(v for _, v, _, _ in rows)
    assert me.static_bytes(setup, fake, rows, 8) == whole - trained + -(-trained // 8) + 2 * block
    assert "sharded" in me.report(setup, fake, unit=2**10)


def test_the_benchmark_script_writes_the_report_of_the_package(tmp_path, monkeypatch):
    """benchmarks/memory_estimate.py is a thin CLI over tpflow.memory: its --tiny report is the package's."""
    spec = importlib.util.spec_from_file_location("memory_estimate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "memory_estimate", module)
    spec.loader.exec_module(module)
    text = module.main(["--tiny", "--out", str(tmp_path)])
    assert (tmp_path / "memory_estimate.md").read_text() == text
    assert text.startswith("# Estimated peak GPU memory per process")
    assert "## tiny-sd3" in text and "## tiny-flux" in text


@pytest.fixture(scope="module")
def tiny_wan(me):
    """The fake-tensor and the real-tensor measurement of tiny-wan's sizes (5 frames of 32 px, CFG 4.5)."""
    setup = me.tiny_setup("wan")
    return setup, me.measure(setup, fake=True), me.measure(setup, fake=False)


def test_the_tiny_wan_sizes_are_tiny_wans():
    from tpflow.backbones.tiny import tiny_wan_pipeline
    from tpflow.memory import TINY_WAN, TINY_WAN_VAE

    def plain(values: dict) -> dict:  # tuples and lists alike
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    pipe = tiny_wan_pipeline()
    for config, model in ((TINY_WAN, pipe.transformer), (TINY_WAN_VAE, pipe.vae)):
        assert plain({k: model.config[k] for k in config}) == plain(config)


def test_wan_fake_estimate_equals_real_cpu_measurement(tiny_wan):
    """The wan kind: tpflow's WanBackbone on diffusers' Wan transformer and VAE. Latents [C, F', h, w] = [4, 2, 4, 4]
    for 5 frames of 32 px, CFG doubling the training rows, one prompt's embeddings [L, text_dim], and the peaks of the
    velocity call, the training step (checkpointing on and off) and the clip decode on fake tensors equal to the real
    tiny model's, byte for byte."""
    _, fake, real = tiny_wan
    keys = ("rollout_act", "decode_act", "train_act_ckpt_False", "train_act_ckpt_True")
    assert all(real[k] > 0 for k in keys)
    assert {k: fake[k] for k in keys} == {k: real[k] for k in keys}
    assert fake["latent_numel"] == 4 * 2 * 4 * 4 and fake["embeds_bytes"] == 8 * 32 * 4  # fp32 [L, text_dim]
    assert fake["train_rows"] == 4 and fake["frozen_bytes"] == 0  # 2 trajectories x [uncond; cond]; one expert
    assert fake["train_act_ckpt_True"] < fake["train_act_ckpt_False"]
    assert any("flash_attention" in op for op in fake["attention_ops"])


def test_wan_report_names_the_clip_size_and_the_cfg_rows(me, tiny_wan):
    setup, fake, _ = tiny_wan
    text = me.report(setup, fake, unit=2**10)
    assert text.startswith("## tiny-wan (tiny wan, fp32, 5 frames of 32×32 px, mixed_precision = no)")
    assert f"largest rollout velocity call, {fake['rollout_rows']} rows (×2 with CFG)" in text


def _statics_and_rollout(me, setup) -> dict:
    """``measure``'s sizes of the built model and its rollout velocity call, on fake tensors: what the static rows
    read, without the training steps and the decode (two seconds a setup)."""
    with me.Probe(setup, True) as probe:
        m = probe.statics()
        m["rollout_act"] = probe.rollout(me.largest_rollout_rows(setup, setup.rollout.max_batch))
    return m


def test_wan22_holds_its_frozen_expert_whole_in_the_model_dtype(me):
    """Wan2.2's options (a ``train_expert``): two experts of the one configuration, the trained one with its LoRA,
    the other frozen in bf16, a row of its own (unsharded) in the component table and in the static bytes."""
    from diffusers import WanTransformer3DModel

    from tpflow.backbones.placement import place
    from tpflow.backbones.wan22 import Wan22Options
    from tpflow.memory.models import count_bytes

    one = me.tiny_setup("wan")
    one.backbone = one.backbone.model_copy(update={"dtype": "bf16"})
    two = me.tiny_setup("wan")
    two.backbone = Wan22Options(dtype="bf16", resolution=32, num_frames=5, lora_rank=4, max_sequence_length=8)
    m1, m2 = _statics_and_rollout(me, one), _statics_and_rollout(me, two)
    with FakeTensorMode(allow_non_fake_inputs=True), me.fake_module_to():  # bf16 but for Wan's fp32 modules
        expert = place(WanTransformer3DModel(**me.TINY_WAN), torch.device("cpu"), torch.bfloat16)
    assert m2["frozen_bytes"] == count_bytes(expert) == m2["transformer_bytes"] == m1["transformer_bytes"] > 0
    rows = me.component_rows(two, m2)
    assert ("frozen expert's weights and buffers", m2["frozen_bytes"], "bf16, not trained", False) in rows
    static = me.static_bytes(two, m2, rows, 1)
    assert static - me.static_bytes(one, m1, me.component_rows(one, m1), 1) == m2["frozen_bytes"]
    assert 0 < m2["rollout_act"] - m1["rollout_act"] <= 64  # one expert runs each call; + the test's bool [rows]


@pytest.mark.parametrize(("completion_steps", "start"), [(1, 0), (2, 0), (3, 2), (5, 1)])
def test_rollout_rows_of_completions_of_fewer_steps_match_the_engine(me, tiny_weights, completion_steps, start):
    """``completion_steps`` c: a completion takes a row at its c − 1 nodes after its start (whose step reuses the
    main trajectory's velocity); c = 1 adds no row at all."""
    from tpflow.devices import cpu_generator
    from tpflow.registry import build
    from tpflow.rollout import Window, rollout

    n, steps, width = 3, 8, 4
    backbone = build("backbone", "shapes-dit", weights=str(tiny_weights))
    calls: list[int] = []
    velocity = backbone.velocity
    backbone.velocity = lambda z, sigma, cond, guidance: calls.append(z.shape[0]) or velocity(z, sigma, cond, guidance)
    cond, generator = backbone.encode(["a red circle"] * n), cpu_generator(0)
    with torch.no_grad():
        rollout(backbone, build("sampler", "cps"), cond, backbone.initial_noise(n, generator), backbone.sigmas(steps),
                Window(start, width), 0.7, 1.0, "ode", generator=generator,
                completion_steps=completion_steps)  # fmt: skip
    assert calls == me.rollout_rows(steps, width, start, n, completion_steps=completion_steps)
    if completion_steps == 1:
        assert calls == [n] * steps


def test_the_wan_recipes_rollout_rows_follow_their_credit(me):
    """wan_dancegrpo's ``outcome`` credit reads no completions, so its rollout makes none (tpflow/train/sampling.py):
    one trajectory per call and the final alone decoded; wan_tp's TP-GRPO completions take one step each, on the
    main trajectory's velocity, so its calls stay at the rollout batch too, but its scoring decodes n·(W + 1)."""
    root = SCRIPT.parent.parent / "recipes" / "wan"
    dance, tp = me.load_setup(root / "wan_dancegrpo.toml"), me.load_setup(root / "wan_tp.toml")
    assert dance.kind == tp.kind == "wan" and dance.text_len == tp.text_len == 226
    assert dance.completions is None and me.largest_rollout_rows(dance) == 1
    assert tp.completions == "ode" and me.largest_rollout_rows(tp) == 8


@pytest.mark.parametrize(
    ("recipe", "layers", "vae", "counts"),
    [
        ("qwen_image/edit_plus_flowgrpo.toml", {"num_layers": 1}, {"num_res_blocks": 1}, (1, 3)),
        (
            "flux/flux2_klein_edit_flowgrpo.toml",
            {"num_layers": 1, "num_single_layers": 1},
            {"layers_per_block": 1},
            (0, 2),
        ),
    ],
)
def test_an_edit_recipes_calls_grow_by_their_sources_tokens(me, recipe, layers, vae, counts):
    """The editing recipes count the backbone's most sources per prompt (the data's count is not read), and say so;
    each source's tokens join every transformer call's sequence, so the velocity call's activations (one block of
    the published width, fake tensors; the VAE, which the call does not run, lighter) grow in proportion to the
    whole sequence: text + output + sources' tokens (FLUX.2 with none is its text-to-image call)."""
    import dataclasses

    from tpflow.memory.models import source_tokens

    setup = me.load_setup(SCRIPT.parent.parent / "recipes" / recipe)
    most = {"qwen-edit": 3, "flux2-klein-9b": 4}[setup.kind]
    assert setup.sources == most and any(f"sources: {most} per prompt, the backbone's most" in n for n in setup.notes)
    tokens = source_tokens(setup.kind, setup.backbone)  # 512² → 1024 (Qwen), 384² → 576 (FLUX.2)
    assert tokens == {"qwen-edit": 1024, "flux2-klein-9b": 576}[setup.kind]
    small = dataclasses.replace(setup, transformer_cfg=setup.transformer_cfg | layers, vae_cfg=setup.vae_cfg | vae)
    with me.Probe(small) as probe:
        output = me.latents(probe.backbone, 1).shape[1]  # packed tokens of the output
        acts = []
        for count in counts:
            probe.setup = dataclasses.replace(small, sources=count)
            acts.append(probe.rollout(1))
    sequence = [setup.text_len + output + count * tokens for count in counts]
    assert 0.95 < (acts[1] / acts[0]) / (sequence[1] / sequence[0]) < 1.2


def test_z_image_is_built_at_its_published_size(me):
    """Z-Image's transformer from Tongyi-MAI/Z-Image-Turbo's transformer/config.json has the 6.15 B parameters of its
    model card; both registered names build it, with Qwen3-4B's 4.0 B counted for the text encoder."""
    from diffusers import ZImageTransformer2DModel

    with torch.device("meta"):
        model = ZImageTransformer2DModel(**me.PUBLISHED["z-image"].transformer)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(6.15e9, rel=0.005)
    assert me.PUBLISHED["z-image-turbo"].transformer is me.PUBLISHED["z-image"].transformer
    ((params, nbytes),) = me.text_encoder_sizes("z-image", "bf16").values()
    assert params == pytest.approx(4.02e9, rel=0.01) and nbytes == 2 * params
