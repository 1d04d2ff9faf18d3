"""The trainer on CUDA: what tests/test_train.py and tests/test_tiny_smoke.py prove on the CPU, on a GPU.

Every test here is marked ``gpu`` (skipped without CUDA, ``pytest -m gpu`` runs them; docs/testing.md). Each trains
one of the three embedded backbones (shapes-dit, tiny-sd3, tiny-flux) for 2 epochs on the GPU through the whole
path: rollout with ODE completions, decode and reward in the scoring thread, credit, advantages, GRPO with the KL
reference pass, EMA, evaluation with the EMA swapped in, checkpoints, and a resume.

Exactness on CUDA. On the CPU a resumed run equals the uninterrupted one bit for bit (test_train.py). On a GPU the
same kernels on the same inputs are run-to-run deterministic for the forward passes, but some backward kernels
(attention, reductions with atomics) may sum in a different order, so the resumed adapter is compared within a
tolerance far below one optimizer step (lr = 1e-2): a resume that lost state (optimizer moments, EMA, RNG, window or
noise draws) moves the weights by about lr, which the tolerance catches. The noise draws themselves are CPU draws
(tpflow/devices.py), so the sampled trajectories do not depend on the CUDA RNG at all.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpflow.devices import resolve_device
from tpflow.recipe import load_recipe
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

from .test_train import tiny_recipe

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("_s", "time")  # wall-time metrics: never compared
RATIO_TOLERANCE = 1e-4  # on-policy |ratio - 1| allowed on CUDA; the paper's clip range is 1e-5 (see below)


def backbone_section(name: str, device: str, weights: Path | None = None, dtype: str = "fp32") -> str:
    if name == "shapes-dit":
        return f'name = "shapes-dit"\nweights = "{weights}"\nlora_init = "gaussian"\ndevice = "{device}"\n'
    return f'name = "{name}"\nseed = 0\nresolution = 16\ndtype = "{dtype}"\ndevice = "{device}"\n'


def gpu_recipe(tmp_path: Path, backbone: str, run: str = "run") -> Path:
    """tests/test_train.py's tiny recipe with ``backbone`` and the built-in brightness reward, in ``tmp_path / run``
    (its run dir is ``tmp_path / run / "run"``)."""
    (tmp_path / run).mkdir(exist_ok=True)
    return tiny_recipe(tmp_path / run, None, reward="image-stat", backbone=backbone)


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The LoRA tensors by name, float32 copies on the CPU."""
    backbone = trainer.backbone
    module = backbone.transformer if hasattr(backbone, "transformer") else backbone.model
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters() if "lora_" in n}


def _unmoved(trainer: Trainer, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The LoRA tensors that training left as they were. tiny-sd3's last joint block is context_pre_only: it discards
    the text tokens, so its add_q_proj adapter gets no gradient (test_tiny_smoke.py) and is not counted."""
    assert before.keys() == after.keys() and len(before) > 0
    dead = None
    if trainer.recipe.backbone.name == "tiny-sd3":
        dead = f"transformer_blocks.{trainer.backbone.transformer.config.num_layers - 1}.attn.add_q_proj."
    return [n for n in before if not (dead and n.startswith(dead)) and torch.equal(before[n], after[n])]


def _comparable(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in read_jsonl(run_dir / "metrics.jsonl")]


def _assert_close_metrics(a: list[dict], b: list[dict]) -> None:
    assert [sorted(row) for row in a] == [sorted(row) for row in b]
    for row_a, row_b in zip(a, b, strict=True):
        for key, value in row_a.items():
            if isinstance(value, float):
                assert math.isclose(value, row_b[key], rel_tol=1e-3, abs_tol=1e-4), (key, value, row_b[key])
            else:
                assert value == row_b[key], key


@pytest.mark.parametrize("name", ["shapes-dit", "tiny-sd3", "tiny-flux"])
def test_two_epochs_train_and_resume_on_cuda(tmp_path, tiny_weights, cuda, name):
    section = backbone_section(name, cuda, tiny_weights)
    straight = Trainer(load_recipe(gpu_recipe(tmp_path, section, run="straight")))
    device = resolve_device(cuda)
    assert all(p.device == device for p in straight.backbone.trainable_parameters())
    before = _adapter(straight)
    metrics = straight.fit()
    after = _adapter(straight)
    assert not _unmoved(straight, before, after), "every LoRA tensor is trained on the GPU"
    assert metrics["optimizer_steps"] >= 1 and metrics["nonfinite_losses"] == 0
    assert math.isfinite(metrics["eval_reward"]) and math.isfinite(metrics["loss"])
    lines = read_jsonl(straight.run_dir / "metrics.jsonl")
    # The first micro-batch is on policy: rollout and update compute the same log-prob. CUDA may pick other GEMM
    # tilings for the rollout's batch (main + branch rows) than for the update's micro-batch, so the ratio is 1 up
    # to float rounding rather than exactly; a real mismatch (other guidance, dtype, σ or noise) is O(1e-2) or more.
    assert lines[0]["first_ratio_max_deviation"] <= RATIO_TOLERANCE, lines[0]["first_ratio_max_deviation"]

    first = Trainer(load_recipe(gpu_recipe(tmp_path, section, run="split"), ["train.epochs=1"]))
    first.fit()
    second = Trainer(load_recipe(gpu_recipe(tmp_path, section, run="split")), resume=True)
    assert second.epoch == 1
    second.fit()
    resumed = _adapter(second)
    assert resumed.keys() == after.keys()
    for name, a in after.items():
        torch.testing.assert_close(resumed[name], a, rtol=1e-4, atol=1e-5, msg=name)  # far below one step of lr 1e-2
    _assert_close_metrics(_comparable(straight.run_dir), _comparable(second.run_dir))


@pytest.mark.parametrize(("name", "precision"), [("shapes-dit", "no"), ("tiny-sd3", "fp16")])
def test_nft_trains_on_cuda(tmp_path, tiny_weights, cuda, name, precision):
    """DiffusionNFT on the GPU: final samples under the old policy, re-noised, the old and KL reference passes, the
    old policy's soft update; every LoRA tensor trained. In fp32 a resume continues the run (within the tolerance of
    the GRPO test above); under fp16 the scaler may skip the first steps, so only finiteness and training count."""
    from .test_nft_train import nft_recipe

    section = backbone_section(name, cuda, tiny_weights, dtype="fp16" if precision == "fp16" else "fp32")
    sets = [f"train.mixed_precision={precision}"]

    def recipe(run: str) -> Path:
        (tmp_path / run).mkdir(exist_ok=True)
        return nft_recipe(tmp_path / run, None, backbone=section)

    straight = Trainer(load_recipe(recipe("straight"), sets))
    device = resolve_device(cuda)
    assert all(p.device == device for p in straight.backbone.trainable_parameters())
    assert all(o.device == device for o in straight.optimizer.lagged.old)
    before = _adapter(straight)
    metrics = straight.fit()
    after = _adapter(straight)
    assert not _unmoved(straight, before, after), "every LoRA tensor is trained on the GPU"
    assert metrics["nonfinite_losses"] == 0 and math.isfinite(metrics["loss"]) and metrics["optimizer_steps"] >= 1
    assert math.isfinite(metrics["eval_reward"]) and metrics["kl"] > 0
    if precision != "no":
        return
    first = Trainer(load_recipe(recipe("split"), [*sets, "train.epochs=1"]))
    first.fit()
    second = Trainer(load_recipe(recipe("split"), sets), resume=True)
    assert second.epoch == 1
    second.fit()
    resumed = _adapter(second)
    for key, a in after.items():
        torch.testing.assert_close(resumed[key], a, rtol=1e-4, atol=1e-5, msg=key)
    _assert_close_metrics(_comparable(straight.run_dir), _comparable(second.run_dir))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cuda(tmp_path, cuda, precision):
    """Half-precision base weights under tpflow's autocast (the paper's fp16 SD3.5-M, bf16 FLUX): finite losses,
    the LoRA kept in float32 and trained. Two epochs (4 optimizer steps): under fp16 the GradScaler skips a
    step whose scaled gradients overflow and halves its scale (65536 at first), so the first steps may be skipped."""
    name = "tiny-sd3" if precision == "fp16" else "tiny-flux"
    section = backbone_section(name, cuda, dtype=precision)
    trainer = Trainer(load_recipe(gpu_recipe(tmp_path, section), [f"train.mixed_precision={precision}"]))
    params = trainer.backbone.trainable_parameters()
    assert all(p.dtype == torch.float32 for p in params), "LoRA adapters train in fp32 under half-precision bases"
    before = _adapter(trainer)
    metrics = trainer.fit()
    assert metrics["nonfinite_losses"] == 0 and math.isfinite(metrics["loss"])
    assert math.isfinite(metrics["eval_reward"])
    assert not _unmoved(trainer, before, _adapter(trainer)), "every LoRA tensor is trained"


def test_inspect_trajectory_gives_the_cpu_run_on_cuda(tmp_path, tiny_weights, cuda):
    """Same recipe and seed on the CPU and on CUDA: the same window and noise (CPU draws), so the same reward trace up
    to float rounding; the CLI writes its plot from the GPU run."""
    from tpflow.inspect.traces import sample_trajectories

    cpu = sample_trajectories(load_recipe(gpu_recipe(tmp_path, backbone_section("shapes-dit", "cpu", tiny_weights))),
                              "a red circle", n=3, seed=5)  # fmt: skip
    gpu_path = gpu_recipe(tmp_path, backbone_section("shapes-dit", cuda, tiny_weights), run="gpu")
    gpu = sample_trajectories(load_recipe(gpu_path), "a red circle", n=3, seed=5)
    assert gpu.window_start == cpu.window_start
    torch.testing.assert_close(gpu.trace, cpu.trace, rtol=0, atol=2e-3)  # brightness of images in [0, 1]
    torch.testing.assert_close(gpu.images, cpu.images, rtol=0, atol=2e-2)
    env = {**os.environ, "COLUMNS": "200"}
    out = tmp_path / "inspect"
    done = subprocess.run(
        [sys.executable, "-m", "tpflow.cli", "inspect-trajectory", str(gpu_path), "--prompt", "a red circle",
         "--n", "2", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert any(out.glob("*.png"))


def test_export_of_a_cuda_run_loads_into_diffusers(tmp_path, cuda):
    """A tiny-sd3 run trained on the GPU, exported (EMA swapped in), read by diffusers' ``load_lora_weights``."""
    from tpflow.backbones.tiny import tiny_sd3_pipeline
    from tpflow.devices import cpu_generator
    from tpflow.export import export

    trainer = Trainer(load_recipe(gpu_recipe(tmp_path, backbone_section("tiny-sd3", cuda)), ["train.epochs=1"]))
    trainer.fit()
    summary = export(trainer.run_dir, tmp_path / "lora")
    assert summary["ema"] and (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    pipe = tiny_sd3_pipeline(seed=0).to(cuda)
    pipe.load_lora_weights(tmp_path / "lora")
    backbone = trainer.backbone
    z = backbone.initial_noise(2, cpu_generator(0))
    cond = backbone.encode(["a photo of a red cat", "two blue squares"])
    sigma = torch.full((2,), 0.7, device=z.device)
    with torch.no_grad(), trainer.ema.swapped():
        ours = backbone.velocity(z, sigma, cond, 1.0)
        theirs = pipe.transformer(
            hidden_states=z,
            timestep=sigma * 1000,
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            pooled_projections=cond.tensors["pooled"],
            return_dict=False,
        )[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_eval_and_sample_of_a_cuda_run(tmp_path, cuda, capsys):
    """`tpflow eval` of a tiny-sd3 run trained on the GPU gives the eval it logged (same weights, prompts, steps and
    seed; the EMA swapped in); `tpflow sample` writes its grid from the GPU."""
    import json

    from tpflow.cli import main

    trainer = Trainer(load_recipe(gpu_recipe(tmp_path, backbone_section("tiny-sd3", cuda)), ["train.epochs=1"]))
    trainer.fit()
    steps = str(trainer.recipe.eval.num_steps)
    for args in (
        ["eval", str(trainer.run_dir), "--steps", steps, "--out", str(tmp_path / "e")],
        ["sample", str(trainer.run_dir), "--prompt", "a red cat", "--n", "2", "--out", str(tmp_path / "s.png")],
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code in (0, None)
    logged = read_jsonl(trainer.run_dir / "metrics.jsonl")[-1]
    got = json.loads((tmp_path / "e" / "eval.json").read_text())["target"]["metrics"]
    assert math.isclose(got["eval_reward"], logged["eval_reward"], rel_tol=0, abs_tol=1e-5)
    assert len(json.loads((tmp_path / "s.png.json").read_text())["tiles"]) == 2


def test_num_processes_1_over_nccl(tmp_path, tiny_weights, cuda):
    """``tpflow train --num-processes 1``: torchrun in-process, accelerate's process group (NCCL on a GPU)."""
    recipe = gpu_recipe(tmp_path, backbone_section("shapes-dit", "auto", tiny_weights))
    env = {**os.environ, "COLUMNS": "200"}
    run = [sys.executable, "-m", "tpflow.cli", "train", str(recipe), "--epochs", "1", "--num-processes", "1"]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "run" / "run" / "checkpoints").is_dir()
    assert [row["epoch"] for row in read_jsonl(tmp_path / "run" / "run" / "metrics.jsonl")][:1] == [0]


def test_a_probe_on_cuda_measures_the_cpu_probes_gradients(tmp_path, tiny_weights, cuda):
    """The same probe (seed, prompts, arms) on the CPU and on CUDA: the draws use CPU generators, so the two see the
    same trajectories up to float rounding, and their first-step gradients agree in direction (each arm's, and the
    reference's): a probe on a GPU measures what one on a CPU does."""
    from tpflow.probe.run import ProbeConfig, build_probe, load_units, run_probe
    from tpflow.probe.stats import cosine

    gradients = {}
    for device in ("cpu", cuda):
        recipe = gpu_recipe(tmp_path, backbone_section("shapes-dit", device, tiny_weights), run=f"probe-{device}")
        config = ProbeConfig(recipe=str(recipe), overrides=[], arms=["outcome:credit.name=outcome",
                             "tp:credit.name=consistent"], prompts=2, group_sizes=[2], repeats=2,
                             reference_draws=2, reference_group_size=2)  # fmt: skip
        probe = build_probe(config, tmp_path / f"out-{device}")
        run_probe(probe)
        gradients[device] = load_units(tmp_path / f"out-{device}")[0]
    for unit, tensors in gradients["cpu"].items():
        for key, cpu_gradient in tensors.items():
            assert cpu_gradient.abs().max() > 0, (unit, key)
            assert cosine(cpu_gradient, gradients[cuda][unit][key]) > 0.99, (unit, key)
