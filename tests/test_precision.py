"""Mixed precision on the CPU: the update's forwards see every optimizer step (tpflow.precision), as in fp32.

Autocast caches the cast of each LoRA matrix until its outermost region exits; an update inside one region therefore
trained on the epoch-start weights (a GRPO ratio of exactly 1 after every step, NFT's v_θ = v_old). These tests run
the recipes' precisions (bf16, and fp16 with the gradient scaler) through torch's CPU autocast, and run the old scope
once (one cached region around the whole update) to show that each check can fail.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpflow
import tpflow.optim.grpo as grpo_module
from tests.conftest import cuda_or_skip
from tests.test_train import tiny_recipe
from tpflow.optim.advantages import group_advantages
from tpflow.optim.swap import swapped
from tpflow.precision import Precision
from tpflow.recipe import load_recipe
from tpflow.rollout import Window, rollout
from tpflow.train.trainer import Trainer

PROMPTS = ["a photo of a cat"] * 4 + ["a photo of a dog"] * 4
# |ratio − 1| after a step, low precision against fp32 (measured: bf16 differs by ≤ 9.1e-5, fp16 by ≤ 1.9e-5, at
# fp32 deviations of 8.9e-5 … 2.2e-4): bf16 keeps 8 mantissa bits, fp16 11
RATIO_TOLERANCE = {"bf16": 1e-3, "fp16": 5e-5}
# cosine of a 2-epoch train's LoRA delta with fp32's (measured 0.989-0.991 for bf16, 0.99998 for fp16)
DELTA_COSINE = {"bf16": 0.97, "fp16": 0.999}


def tiny_sd3(device: str = "cpu"):
    """tiny-sd3 with a random (trained-looking) adapter: B = 0 at init would hide the LoRA path's casts."""
    torch.manual_seed(0)
    backbone = tpflow.build("backbone", "tiny-sd3", lora_init="gaussian", resolution=8, device=device)  # 64 tokens
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in backbone.trainable_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return backbone


def grpo_update(mode: str, device: str = "cpu", old_scope: bool = False) -> dict:
    """A GRPO update of 8 trajectories x 3 window steps in micro-batches of 2 (4 optimizer steps, micro-batch k at
    step k), sampled and trained under ``mode``; ``old_scope`` runs it as the trainer used to: one cached bf16 region
    around it all. Returns the largest |ratio − 1| of each step, the metrics, and for each step whether its
    log-probs are bitwise those of the epoch-start weights (recomputed afterwards in the same precision and shape:
    true at step 0 by construction, false after it unless the forwards used stale casts)."""
    backbone, sampler = tiny_sd3(device), tpflow.build("sampler", "flow-sde")
    start = [p.detach().clone() for p in backbone.trainable_parameters()]
    precision = Precision(mode, device)
    z0 = backbone.initial_noise(8, torch.Generator().manual_seed(1))
    with precision.autocast():
        batch = rollout(backbone, sampler, backbone.encode(PROMPTS), z0, backbone.sigmas(4), Window(0, 3), 0.7, 1.0,
                        None, generator=torch.Generator().manual_seed(2))  # fmt: skip
    advantages = group_advantages(torch.randn(8, 3, generator=torch.Generator().manual_seed(3)), PROMPTS)
    optimizer = tpflow.build(
        "optimizer", "grpo", learning_rate=1e-3, micro_batch_size=2, gradient_accumulation_steps=1, clip_range=0.1,
        beta=0.0,
    )  # fmt: skip
    optimizer.bind(backbone, precision=None if old_scope else precision)
    per_step: dict[int, float] = {}
    seen: list[tuple[int, torch.Tensor]] = []  # (step, log-prob) of each loss, in order: micro-batch k, step i
    surrogate = grpo_module.clipped_surrogate

    def recorded(log_prob, old_log_prob, adv, clip_range):
        out = surrogate(log_prob, old_log_prob, adv, clip_range)
        step = optimizer.global_step
        per_step[step] = max(per_step.get(step, 0.0), float((out.ratio - 1).abs().max()))
        seen.append((step, log_prob.detach().clone()))
        return out

    grpo_module.clipped_surrogate = recorded
    region = torch.autocast(device, dtype=torch.bfloat16) if old_scope else contextlib.nullcontext()
    try:
        with region:
            metrics = optimizer.update(backbone, sampler, batch, advantages)
    finally:
        grpo_module.clipped_surrogate = surrogate
    stale = {}
    with torch.no_grad(), swapped(backbone.trainable_parameters(), start):
        for k, (step, log_prob) in enumerate(seen):
            part, i = batch.index(torch.arange(2 * (k // 3), 2 * (k // 3) + 2, device=batch.device)), k % 3
            with region if old_scope else precision.autocast():
                v = backbone.velocity(part.latents[:, i], part.sigmas[:, i], part.cond, part.guidance)
            at_start = sampler.log_prob(part.next_latents[:, i], part.latents[:, i], v, part.sigmas[:, i],
                                        part.sigmas[:, i + 1], part.noise_level).log_prob  # fmt: skip
            stale[step] = stale.get(step, True) and torch.equal(at_start, log_prob)
    return {"per_step": per_step, "metrics": metrics, "stale": stale}


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def updates(request) -> dict[str, dict]:
    device = cuda_or_skip() if request.param == "cuda" else "cpu"
    runs = {mode: grpo_update(mode, device) for mode in ("no", "bf16", "fp16")}
    return runs | {"old": grpo_update("bf16", device, old_scope=True), "device": device}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_the_ratio_moves_after_each_step_as_in_fp32(updates, mode):
    fp32, low = updates["no"]["per_step"], updates[mode]["per_step"]
    assert sorted(low) == [0, 1, 2, 3] and updates[mode]["metrics"]["optimizer_steps"] == 4
    assert updates[mode]["stale"] == {0: True, 1: False, 2: False, 3: False}, "later steps saw the new weights"
    if updates["device"] == "cpu":  # CUDA: kernels chosen by batch shape move step 0 too (docs/training.md)
        assert low[0] == 0.0  # on policy before the first step: the rollout ran in the same precision
    for step in (1, 2, 3):
        assert low[step] > 0, f"step {step}: the forward used the casts of the epoch-start weights"
        tolerance = RATIO_TOLERANCE[mode] * (1 if updates["device"] == "cpu" else 10)
        assert abs(low[step] - fp32[step]) <= tolerance, (step, low[step], fp32[step])


def test_the_old_scope_trained_on_stale_casts(updates):
    """The checks above can fail: under one cached autocast region around the whole update, every step's forwards
    are bitwise those of the epoch-start weights (on the CPU the ratio stays exactly 1), although the weights moved
    (fp32 moves the ratio by ~1e-4 at each step)."""
    old = updates["old"]
    assert old["metrics"]["optimizer_steps"] == 4 and old["stale"] == {0: True, 1: True, 2: True, 3: True}
    if updates["device"] == "cpu":
        assert all(old["per_step"][step] == 0.0 for step in (1, 2, 3))
    assert all(updates["no"]["per_step"][step] > 1e-5 for step in (1, 2, 3))


def nft_update(mode: str, device: str = "cpu", old_scope: bool = False) -> dict:
    """An NFT update of 8 final samples, 2 times each, in micro-batches of 4 (2 optimizer steps)."""
    backbone = tiny_sd3(device)
    precision = Precision(mode, device)
    z0 = backbone.initial_noise(8, torch.Generator().manual_seed(1))
    with precision.autocast():
        batch = rollout(backbone, tpflow.build("sampler", "flow-sde"), backbone.encode(PROMPTS), z0,
                        backbone.sigmas(4), Window(0, 3), 0.7, 1.0, None, transitions=False)  # fmt: skip
    advantages = group_advantages(torch.randn(8, 1, generator=torch.Generator().manual_seed(3)), PROMPTS)
    optimizer = tpflow.build(
        "optimizer", "nft", learning_rate=1e-3, micro_batch_size=4, num_timesteps=4, timesteps_per_sample=2,
        kl_weight=0.0, seed=7,
    )  # fmt: skip
    optimizer.bind(backbone, precision=None if old_scope else precision)
    region = torch.autocast(device, dtype=torch.bfloat16) if old_scope else contextlib.nullcontext()
    with region:
        return optimizer.update(backbone, None, batch, advantages)


@pytest.mark.parametrize("mode", ["no", "bf16"])
def test_nft_trains_away_from_its_old_policy_under_bf16(device, mode):
    """The old policy is the adapter at bind, so L⁺ = L⁻ at the first step; after it v_θ ≠ v_old and the positive
    and negative losses differ (in fp32 and bf16 alike). Under the old scope v_θ reused v_old's casts: equal."""
    metrics = nft_update(mode, device)
    assert metrics["optimizer_steps"] == 2 and metrics["rows_trained"] == 16
    assert metrics["positive_loss"] != metrics["negative_loss"]
    if mode == "bf16":
        stale = nft_update("bf16", device, old_scope=True)
        assert stale["optimizer_steps"] == 2 and stale["positive_loss"] == stale["negative_loss"]


def _lora_delta(run_dir: Path, mode: str, tiny_dir: Path, device: str) -> torch.Tensor:
    """The adapter's change over a 2-epoch train of tiny-sd3 under ``mode`` (the same recipe and seeds)."""
    backbone = f'name = "tiny-sd3"\nlora_init = "gaussian"\nresolution = 8\ndevice = "{device}"'
    recipe = tiny_recipe(tiny_dir, None, credit="outcome", reward="image-stat", backbone=backbone)
    sets = [f"train.mixed_precision={mode}", f"train.run_dir={run_dir}", "eval.every=0", "log.trackers=[]"]
    trainer = Trainer(load_recipe(recipe, sets))
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    assert metrics["optimizer_steps"] >= 1 and metrics["nonfinite_losses"] == 0
    after = trainer.backbone.trainable_parameters()
    return torch.cat([(p.detach() - q).flatten() for p, q in zip(after, before, strict=True)]).cpu()


def test_two_epochs_under_bf16_and_fp16_train_as_fp32(tmp_path, device):
    """A 2-epoch train under each precision moves the adapter the way the fp32 run does: the cosine of its LoRA
    delta with fp32's is at least ``DELTA_COSINE`` (rollouts, rewards and advantages differ slightly too)."""
    deltas = {mode: _lora_delta(tmp_path / mode, mode, tmp_path, device) for mode in ("no", "bf16", "fp16")}
    assert deltas["no"].norm() > 0
    for mode in ("bf16", "fp16"):
        cosine = torch.nn.functional.cosine_similarity(deltas[mode], deltas["no"], dim=0)
        assert cosine >= DELTA_COSINE[mode], (mode, float(cosine))


def test_a_mixed_precision_run_does_not_print_torchs_norm_dtype_warning():
    """torch warns once per process, so a fresh one: the norm under autocast warns without Precision, not with it."""
    script = """
import sys, torch, torch.nn.functional as F
from tpflow.precision import Precision
if sys.argv[1] == "precision":
    precision = Precision("bf16", "cpu")
x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.rand(8)
with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
    F.rms_norm(x, (8,), w, 1e-6)
    F.layer_norm(x, (8,), w, None, 1e-6)
"""
    runs = {
        how: subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True)
        for how in ("plain", "precision")
    }
    assert all(run.returncode == 0 for run in runs.values()), [run.stderr for run in runs.values()]
    assert "Mismatch dtype between input and weight" in runs["plain"].stderr  # the check can fail
    assert "Mismatch dtype" not in runs["precision"].stderr
