"""The on-policy ratio under mixed precision, per window step, and what the autocast scope costs, in one run.

    .venv/bin/python benchmarks/precision_ratio.py [--backbone tiny-sd3] [--repeats 5] [--json OUT]
    .venv/bin/python benchmarks/precision_ratio.py --device cuda --json OUT     # on a GPU (fp16 and bf16 autocast)

1. **Ratio before the first step.** A GRPO rollout batch is sampled as the trainer samples it (the precision's
   autocast region, the ODE completions batched with the main trajectories, so the rollout's velocity calls see
   larger batches than the update's), then the update's first forward of every (micro-batch, window step) is taken
   at the same weights, in the update's precision and micro-batch shape, before any optimizer step. |κ − 1| =
   |exp(ℓ_update − ℓ_rollout) − 1| is reported per window step (max and median over the rows) for "no", "bf16" and
   "fp16", beside the recipes' clip range 1e-5 (docs/training.md, "Mixed precision"). The adapter is given random
   weights first (B = 0 at init would make the LoRA path contribute nothing).
2. **Autocast scope.** One GRPO update (the same batch, fresh weights and AdamW each time) timed with the scope
   tpflow uses (one region per loss, no weight cache) against one region per loss with the cache (correct too: no
   weight changes inside a region) and one region around the whole update with the cache (the old, wrong scope:
   its forwards after the first step used stale casts). Repeats interleaved, medians reported.

CPU figures measure torch's CPU autocast; the GPU's kernels differ (docs/training.md quotes each where measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpflow  # noqa: E402
from tpflow.optim.advantages import group_advantages  # noqa: E402
from tpflow.precision import Precision  # noqa: E402
from tpflow.rollout import Window, rollout  # noqa: E402

MODES = ("no", "bf16", "fp16")
CLIP = 1e-5


def build(name: str, device: str):
    backbone = tpflow.build("backbone", name, device=device, lora_init="gaussian")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B = 0 at init would hide the LoRA path
        for p in backbone.trainable_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return backbone


def sample(backbone, precision: Precision, n: int, steps: int, width: int):
    sampler = tpflow.build("sampler", "flow-sde")
    prompts = [f"a photo of {k} cats" for k in range(n // 4)] * 4
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(n, torch.Generator().manual_seed(1))
    with precision.autocast():
        batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(steps), Window(0, width), 0.7, 4.5, "ode",
                        generator=torch.Generator().manual_seed(2))  # fmt: skip
    return sampler, batch, prompts


def ratio_per_step(backbone, mode: str, n: int, steps: int, width: int, micro: int) -> list[dict]:
    """max and median |κ − 1| per window step before any optimizer step."""
    precision = Precision(mode, backbone.device)
    sampler, batch, _ = sample(backbone, precision, n, steps, width)
    grpo = tpflow.build("optimizer", "grpo", beta=0.0)
    deviation = torch.zeros(n, width, dtype=torch.float64)
    for mb in torch.arange(n, device=batch.device).split(micro):
        part = batch.index(mb)
        for i in range(width):
            with torch.no_grad(), precision.autocast():
                v = backbone.velocity(part.latents[:, i], part.sigmas[:, i], part.cond, part.guidance)
            out = sampler.log_prob(part.next_latents[:, i], part.latents[:, i], v, part.sigmas[:, i],
                                   part.sigmas[:, i + 1], part.noise_level)  # fmt: skip
            deviation[mb.cpu(), i] = (out.log_prob - part.log_probs[:, i]).exp().sub(1).abs().double().cpu()
    del grpo
    return [
        {"step": i, "max": float(deviation[:, i].max()), "median": float(deviation[:, i].median())}
        for i in range(width)
    ]


@contextlib.contextmanager
def cached_scope(precision: Precision, whole: bool):
    """Autocast with the weight cache, per loss (whole=False) or around the whole update (whole=True)."""
    cached = torch.autocast(precision.device_type, dtype=precision.dtype, cache_enabled=True)
    original = precision.autocast
    precision.autocast = (lambda: contextlib.nullcontext()) if whole else (
        lambda: torch.autocast(precision.device_type, dtype=precision.dtype, cache_enabled=True)
    )  # fmt: skip
    try:
        with cached if whole else contextlib.nullcontext():
            yield
    finally:
        precision.autocast = original


def time_update(backbone, scope: str, n: int, steps: int, width: int, micro: int) -> float:
    precision = Precision("bf16", backbone.device)
    sampler, batch, prompts = sample(backbone, precision, n, steps, width)
    adv = group_advantages(torch.randn(n, width, generator=torch.Generator().manual_seed(3)), prompts)
    saved = [p.detach().clone() for p in backbone.trainable_parameters()]
    grpo = tpflow.build("optimizer", "grpo", micro_batch_size=micro, gradient_accumulation_steps=1)
    grpo.bind(backbone, precision=precision)
    scope_cm = contextlib.nullcontext() if scope == "per-loss, no cache" else cached_scope(precision, scope == "whole")
    start = time.perf_counter()
    with scope_cm:
        grpo.update(backbone, sampler, batch, adv)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        for p, value in zip(backbone.trainable_parameters(), saved, strict=True):
            p.copy_(value)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="tiny-sd3")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    n, steps, width, micro = 16, 10, 4, 2
    backbone = build(args.backbone, args.device)
    ratios = {mode: ratio_per_step(backbone, mode, n, steps, width, micro) for mode in MODES}
    scopes = ("per-loss, no cache", "per-loss, cache", "whole")
    times: dict[str, list[float]] = {s: [] for s in scopes}
    time_update(backbone, scopes[0], n, steps, width, micro)  # warm-up
    for r in range(args.repeats):
        for scope in scopes[r % 3 :] + scopes[: r % 3]:  # rotated: drift hits every scope alike
            times[scope].append(time_update(backbone, scope, n, steps, width, micro))
    result = {
        "backbone": args.backbone, "device": args.device, "torch": torch.__version__, "rows": n,
        "window": width, "micro_batch": micro, "clip_range": CLIP, "ratio_before_first_step": ratios,
        "update_s": {s: statistics.median(v) for s, v in times.items()}, "update_s_all": times,
    }  # fmt: skip
    print(f"## |ratio - 1| before the first step, {args.backbone} on {args.device} (clip range {CLIP:g})\n")
    print("| window step | " + " | ".join(f"{m} max | {m} median" for m in MODES) + " |")
    print("|---|" + "---|---|" * len(MODES))
    for i in range(width):
        cells = " | ".join(f"{ratios[m][i]['max']:.2e} | {ratios[m][i]['median']:.2e}" for m in MODES)
        print(f"| {i} | {cells} |")
    base = result["update_s"][scopes[0]]
    print(f"\n## One bf16 GRPO update ({n} rows x {width} steps, micro-batch {micro}), median of {args.repeats}\n")
    print("| autocast scope | seconds | vs tpflow's |")
    print("|---|---|---|")
    for scope in scopes:
        print(f"| {scope} | {result['update_s'][scope]:.3f} | {result['update_s'][scope] / base:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
