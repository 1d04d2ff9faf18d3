"""What one rollout batch costs: Flow-GRPO, TP-GRPO batched, TP-GRPO in the reference's order, x0, same_noise.

    .venv/bin/python benchmarks/rollout_cost.py [--backbone shapes-dit tiny-sd3 sd3.5-medium-random]
        [--prompts 4] [--copies 8] [--steps 10] [--window 9] [--window-start 0] [--repeats 5] [--tune-malloc]

For every backbone, one rollout batch (prompts × copies trajectories, CFG on) of each kind is sampled in the same
run: Flow-GRPO (no completions); TP-GRPO with the batched engine (completions by ODE, each branch's first step
reusing the main velocity); the same without that reuse (the reference's NFE: isolates the effect of batching);
TP-GRPO with branches run one after another (the reference's order: main trajectory, then every branch, then the
baseline); TP-GRPO with one-step x0 completions; TP-GRPO with ``same_noise`` (the copies of a prompt share z_0).

Every kind runs once untimed (warm-up), then ``--repeats`` times round-robin (the order rotated every round) so
that drift in the machine's load hits all alike. The rollout (sampling and completions) is timed apart from decode
+ reward; velocity calls are counted and timed by wrapping ``backbone.velocity`` (CUDA synchronised), so the share
of the rollout spent outside the model is 1 − model / rollout. Peak memory: on CUDA the increase of
``max_memory_allocated`` during one rollout; on CPU the increase of the peak resident set during one rollout, each
kind in a fresh process after a warm-up call. Prints a markdown table and the acceptance check set before it was
first run (docs/results.md §1: batched TP-GRPO ≤ 1.1 × NFE ratio × Flow-GRPO's time, and no slower than the
reference's order), and writes both, with the machine and the command, to docs/results/rollout_cost_<backbone>.md.
Not run in CI (tests/test_benchmarks_smoke.py runs it at the smallest sizes).

``--tune-malloc`` measures with glibc's malloc told to keep freed memory (mallopt). By default glibc serves blocks
over 32 MiB by mmap and unmaps them on free, so on CPU every large activation of a big batched call page-faults
afresh; with shapes-dit that made the batched engine's time per NFE about 1.7× the sequential order's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing and gpu_smoke sit beside this file

import _timing  # noqa: E402

import tpflow  # noqa: E402
from tpflow.devices import randn  # noqa: E402
from tpflow.rollout import Window, baseline_generator, rollout  # noqa: E402
from tpflow.samplers import euler_step  # noqa: E402
from tpflow.types import Conditioning  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BACKBONES = ("shapes-dit", "tiny-sd3", "sd3.5-medium-random")
GUIDANCE = {"shapes-dit": 3.0, "tiny-sd3": 4.5, "sd3.5-medium-random": 4.5}  # the recipes' values


@dataclass
class Bench:
    """One backbone's fixed rollout batch: what every kind of rollout samples from."""

    name: str
    backbone: Any
    sampler: Any
    reward: Any
    prompts: list[str]  # [N]
    metadata: list[dict]  # [N]
    groups: list[int]  # [N] the prompt each trajectory belongs to
    cond: Conditioning
    sigmas: Tensor  # [K + 1]
    window: Window
    alpha: float
    guidance: float
    device: torch.device
    max_batch: int | None
    decode_batch: int

    @property
    def n(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    run: Callable  # (bench, z0, source, generator) -> (final [N, ...], completions [N, W, ...] | None, nfe | None)
    same_noise: bool = False


@dataclass(frozen=True)
class Sample:
    """One timed rollout of one kind."""

    rollout_s: float
    score_s: float
    model_s: float
    calls: int
    rows: int
    nfe: float
    peak_mib: float | None


# ---- the rollouts -------------------------------------------------------------------------------------------


def engine(**options: Any) -> Callable:
    """A run of the batched engine with ``options`` (completions, reuse_main_velocity)."""

    def run(b: Bench, z0: Tensor, source: Tensor | None, gen: torch.Generator):
        out = rollout(
            b.backbone, b.sampler, b.cond, z0, b.sigmas, b.window, b.alpha, b.guidance,
            source=source, generator=gen, max_batch=b.max_batch, **options,
        )  # fmt: skip
        return out.final, out.completions, out.cost.nfe

    return run


def _velocity(b: Bench, z: Tensor, k: int) -> Tensor:
    return b.backbone.velocity(z, b.sigmas[k].expand(z.shape[0]).to(z.device, torch.float32), b.cond, b.guidance)


def _ode(b: Bench, z: Tensor, start: int) -> Tensor:
    """Euler ODE from step ``start`` to the end: K − start velocity calls of all N rows."""
    for k in range(start, b.sigmas.shape[0] - 1):
        z = euler_step(z, _velocity(b, z, k), b.sigmas[k], b.sigmas[k + 1])
    return z


@torch.no_grad()
def sequential_reference(b: Bench, z0: Tensor, source: Tensor | None, gen: torch.Generator):
    """docs/algorithm.md Appendix A in the reference's order, each part its own loop over all N trajectories: the main
    trajectory (ODE before the window, SDE inside, ODE after), then branch j = 1..W-1 from z_{s+j}, then the
    baseline from z_s (the ODE from z_0: before the window the main trajectory is the ODE). No velocity reuse:
    K + W·(K − s) − W(W − 1)/2 NFE per trajectory, the engine's count with ``reuse_main_velocity=False``."""
    s, width = b.window.start, b.window.size
    z = z0 if source is None else z0[source]
    entering = []  # z_{s+j}: the latent entering window step j, j = 0..W-1
    baseline_generator(gen)  # the engine's noise stream (docs/algorithm.md §1.6): the baseline's seed first,
    for k in range(b.sigmas.shape[0] - 1):  # then one ξ per step k, drawn inside the window or not
        v = _velocity(b, z, k)
        xi = randn(tuple(z.shape), gen, z.device)
        if s <= k < s + width:
            entering.append(z)
            z = b.sampler.step(z, v, b.sigmas[k], b.sigmas[k + 1], b.alpha, noise=xi).prev
        else:
            z = euler_step(z, v, b.sigmas[k], b.sigmas[k + 1])
    branches = [_ode(b, entering[j], s + j) for j in range(1, width)]
    baseline = _ode(b, entering[0], s)
    return z, torch.stack([baseline, *branches], dim=1), None


VARIANTS = [
    Variant("flow", "Flow-GRPO (no completions)", engine(completions=None)),
    Variant("tp", "TP-GRPO, batched engine", engine()),
    Variant("tp-noreuse", "TP-GRPO, batched, no velocity reuse", engine(reuse_main_velocity=False)),
    Variant("tp-seq", "TP-GRPO, sequential (reference order)", sequential_reference),
    Variant("tp-x0", "TP-GRPO, x0 completions", engine(completions="x0")),
    Variant("tp-same-noise", "TP-GRPO, batched, same_noise", engine(), same_noise=True),
]


# ---- setup --------------------------------------------------------------------------------------------------


def build_backbone(name: str, args: argparse.Namespace, device: torch.device) -> Any:
    if name == "shapes-dit":
        return tpflow.build("backbone", "shapes-dit", weights=args.weights, device=str(device))
    if name == "tiny-sd3":
        return tpflow.build("backbone", "tiny-sd3", device=str(device), resolution=args.resolution or 16)
    try:
        from gpu_smoke import random_sd35_backbone
    except ImportError as exc:
        raise SystemExit(
            f"sd3.5-medium-random needs random_sd35_backbone from benchmarks/gpu_smoke.py: {exc}"
        ) from None
    return random_sd35_backbone(resolution=args.resolution or 512, device=str(device))


def build_bench(name: str, args: argparse.Namespace) -> Bench:
    device = torch.device(args.device)
    backbone = build_backbone(name, args, device)
    reward = (
        tpflow.build("reward", "shapes-geneval")
        if name == "shapes-dit"
        else tpflow.build("reward", "image-stat", statistic="brightness")
    )
    items = tpflow.build("dataset", "shapes").split("train")[: args.prompts]
    groups = [g for g in range(len(items)) for _ in range(args.copies)]
    prompts = [items[g].prompt for g in groups]
    return Bench(
        name=name,
        backbone=backbone,
        sampler=tpflow.build("sampler", args.sampler),
        reward=reward,
        prompts=prompts,
        metadata=[items[g].metadata for g in groups],
        groups=groups,
        cond=backbone.encode(prompts),
        sigmas=backbone.sigmas(args.steps),
        window=Window(args.window_start, args.window),
        alpha=args.noise_level,
        guidance=args.guidance if args.guidance is not None else GUIDANCE[name],
        device=device,
        max_batch=args.max_batch,
        decode_batch=args.decode_batch,
    )


def inputs(b: Bench, same_noise: bool, seed: int) -> tuple[Tensor, Tensor | None, torch.Generator]:
    """z_0 (one row per trajectory, or per prompt with ``same_noise`` as rollout_from_settings draws it) and the
    SDE generator; the same seed gives every kind the same noise."""
    gen = torch.Generator(device=b.device).manual_seed(seed)
    if not same_noise:
        return b.backbone.initial_noise(b.n, gen), None, gen
    unique = sorted(set(b.groups))
    source = torch.tensor([unique.index(g) for g in b.groups], device=b.device)
    return b.backbone.initial_noise(len(unique), gen), source, gen


@torch.no_grad()
def score(b: Bench, final: Tensor, completions: Tensor | None) -> None:
    """Decode (in chunks) and reward the final images and the completions, as the trainer scores a rollout."""
    latents, prompts, metadata = [final], list(b.prompts), list(b.metadata)
    if completions is not None:
        width = completions.shape[1]
        latents.insert(0, completions.flatten(0, 1))  # [N·W, ...], trajectory-major
        prompts = [p for p in b.prompts for _ in range(width)] + prompts
        metadata = [m for m in b.metadata for _ in range(width)] + metadata
    images = torch.cat([b.backbone.decode(chunk) for chunk in torch.cat(latents).split(b.decode_batch)])
    b.reward(images, prompts, metadata)


# ---- measuring ----------------------------------------------------------------------------------------------


def measure(b: Bench, meter: _timing.VelocityMeter, variant: Variant, seed: int) -> Sample:
    z0, source, gen = inputs(b, variant.same_noise, seed)
    cuda = b.device.type == "cuda"
    meter.reset()
    base = _timing.cuda_peak_reset(b.device) if cuda else 0
    _timing.sync(b.device)
    start = time.perf_counter()
    final, completions, nfe = variant.run(b, z0, source, gen)
    _timing.sync(b.device)
    rollout_s = time.perf_counter() - start
    peak = _timing.cuda_peak_increase_mib(b.device, base) if cuda else None
    start = time.perf_counter()
    score(b, final, completions)
    _timing.sync(b.device)
    score_s = time.perf_counter() - start
    nfe = nfe if nfe is not None else round(meter.rows / b.n, 2)
    return Sample(rollout_s, score_s, meter.seconds, meter.calls, meter.rows, nfe, peak)


def run_rounds(b: Bench, variants: list[Variant], repeats: int, warmup: int) -> dict[str, list[Sample]]:
    """Warm-up rounds (discarded), then ``repeats`` rounds round-robin, the order rotated each round."""
    meter = _timing.VelocityMeter(b.backbone, b.device)
    samples: dict[str, list[Sample]] = {v.key: [] for v in variants}
    try:
        for r in range(warmup):
            for v in variants:
                measure(b, meter, v, seed=10_000 + r)
        for r in range(repeats):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                samples[v.key].append(measure(b, meter, v, seed=r))
                print(f"  {b.name} round {r + 1}/{repeats}: {v.key} {samples[v.key][-1].rollout_s:.2f} s", flush=True)
    finally:
        meter.remove()
    return samples


def probe_argv(args: argparse.Namespace, name: str, key: str) -> list[str]:
    """The command line of a fresh process that measures one kind's peak resident memory."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--memory-probe", key, "--backbone", name]
    for flag in ("prompts", "copies", "steps", "window", "window_start", "noise_level", "sampler", "device"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("guidance", "max_batch", "weights", "resolution"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--tune-malloc"] if args.tune_malloc else [])


def memory_probe(args: argparse.Namespace) -> float:
    """In this (fresh) process: one warm-up rollout of the kind, then the peak RSS increase of a second one."""
    b = build_bench(args.backbone[0], args)
    variant = next(v for v in VARIANTS if v.key == args.memory_probe)
    variant.run(b, *inputs(b, variant.same_noise, seed=10_000))
    z0, source, gen = inputs(b, variant.same_noise, seed=0)
    return _timing.rss_peak_increase_mib(lambda: variant.run(b, z0, source, gen))


def cpu_peaks(args: argparse.Namespace, name: str, variants: list[Variant]) -> dict[str, float]:
    peaks = {}
    for v in variants:
        out = subprocess.run(probe_argv(args, name, v.key), capture_output=True, text=True, check=True)
        peaks[v.key] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
    return peaks


# ---- report -------------------------------------------------------------------------------------------------


def summarise(samples: list[Sample], n: int) -> dict[str, float]:
    """Median (and spread) over the rounds of one kind; ``n`` trajectories per batch."""
    rollout_s = [s.rollout_s for s in samples]
    median, low, high = _timing.spread(rollout_s)
    last = samples[-1]
    peaks = [s.peak_mib for s in samples if s.peak_mib is not None]
    return {
        "nfe": last.nfe,
        "calls": last.calls,
        "rows_per_call": last.rows / last.calls,
        "rollout_s": median,
        "rollout_min": low,
        "rollout_max": high,
        "ms_per_nfe": 1000 * median / last.nfe,
        "outside": _timing.spread([1 - s.model_s / s.rollout_s for s in samples])[0],
        "score_s": _timing.spread([s.score_s for s in samples])[0],
        "peak_mib": max(peaks) if peaks else None,
        "counted_nfe": last.rows / n,  # from the meter: equals the engine's own count
    }


def table(summary: dict[str, dict], labels: dict[str, str]) -> list[str]:
    flow = summary["flow"]["rollout_s"]
    lines = [
        "| rollout kind | NFE / traj. | velocity calls | rows / call | rollout s, median (min–max) | ms / NFE "
        "| outside model | decode + reward s | peak MiB | × Flow-GRPO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        peak = "–" if s["peak_mib"] is None else f"{s['peak_mib']:.0f}"
        lines.append(
            f"| {labels[key]} | {s['nfe']:g} | {s['calls']} | {s['rows_per_call']:.1f} | {s['rollout_s']:.3f} "
            f"({s['rollout_min']:.3f}–{s['rollout_max']:.3f}) | {s['ms_per_nfe']:.1f} | {s['outside']:.0%} "
            f"| {s['score_s']:.3f} | {peak} | {s['rollout_s'] / flow:.2f} |"
        )
    return lines


def acceptance(summary: dict[str, dict]) -> tuple[dict[str, bool], list[str]]:
    """The acceptance check (docs/results.md §1): batched TP-GRPO ≤ 1.1 × (its NFE / Flow-GRPO's) × Flow-GRPO's
    time, and ≤ the sequential order."""
    flow, tp, seq, noreuse = (summary[k] for k in ("flow", "tp", "tp-seq", "tp-noreuse"))
    bound = 1.1 * tp["nfe"] / flow["nfe"] * flow["rollout_s"]
    ok = {"nfe_bound": tp["rollout_s"] <= bound, "vs_sequential": tp["rollout_s"] <= seq["rollout_s"]}
    lines = [
        f"- TP/Flow-GRPO rollout time {tp['rollout_s'] / flow['rollout_s']:.2f}× for an NFE ratio of "
        f"{tp['nfe'] / flow['nfe']:.2f}×; batched/sequential {tp['rollout_s'] / seq['rollout_s']:.2f}× "
        f"(at equal NFE, without velocity reuse: {noreuse['rollout_s'] / seq['rollout_s']:.2f}×).",
        f"- Bound: batched TP-GRPO {tp['rollout_s']:.3f} s ≤ 1.1 × ({tp['nfe']:g} / {flow['nfe']:g}) × "
        f"{flow['rollout_s']:.3f} s = {bound:.3f} s: **{'PASS' if ok['nfe_bound'] else 'FAIL'}**",
        f"- Batched TP-GRPO {tp['rollout_s']:.3f} s ≤ sequential (reference order) {seq['rollout_s']:.3f} s: "
        f"**{'PASS' if ok['vs_sequential'] else 'FAIL'}**",
    ]
    return ok, lines


def report(b: Bench, args: argparse.Namespace, argv: list[str], summary: dict, memory_note: str) -> list[str]:
    ok, checks = acceptance(summary)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ)
    command = f"{env} .venv/bin/python benchmarks/rollout_cost.py {shlex.join(argv)}".strip()
    return [
        f"# Rollout cost: {b.name}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {_timing.machine(b.device)}; device {b.device}"
        + ("; glibc malloc tuned (--tune-malloc)" if args.tune_malloc else ""),
        "",
        f"{b.n} trajectories ({args.prompts} prompts × {args.copies}), K = {args.steps}, window s = "
        f"{b.window.start}, W = {b.window.size}, CFG {b.guidance}, sampler {args.sampler}, α = {b.alpha}, "
        f"max_batch {b.max_batch}; {args.warmup} warm-up round(s), then median (min–max) of {args.repeats} rounds "
        "run round-robin. Rollout = sampling and completions; decode + reward timed apart. Rows / call are "
        "latent rows (a CFG call runs each twice); outside model = 1 − time in velocity calls / rollout time. "
        f"Peak memory: {memory_note}.",
        "",
        *table(summary, {v.key: v.label for v in VARIANTS}),
        "",
        *checks,
        "",
    ]


# ---- main ---------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", nargs="+", action="extend", choices=BACKBONES, help="default: shapes-dit tiny-sd3")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--copies", type=int, default=8, help="trajectories per prompt (group size)")
    p.add_argument("--steps", type=int, default=10, help="K")
    p.add_argument("--window", type=int, default=9, help="W")
    p.add_argument("--window-start", type=int, default=0, help="s")
    p.add_argument("--guidance", type=float, default=None, help="default: 3 for shapes-dit, 4.5 for SD3")
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--sampler", default="cps")
    p.add_argument("--max-batch", type=int, default=None, help="engine's max rows per velocity call")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--weights", default=None, help="shapes-dit weights (default: the shipped ones)")
    p.add_argument("--resolution", type=int, default=None, help="tiny-sd3: 16, sd3.5-medium-random: 512")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--memory", choices=["auto", "none"], default="auto", help="none: skip peak memory")
    p.add_argument("--tune-malloc", action="store_true", help="keep freed heap memory (glibc mallopt), see docs")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)  # internal: one kind, fresh process
    args = p.parse_args(argv)
    args.backbone = args.backbone or ["shapes-dit", "tiny-sd3"]
    return args


def bench_one(name: str, args: argparse.Namespace, argv: list[str]) -> dict:
    b = build_bench(name, args)
    samples = run_rounds(b, VARIANTS, args.repeats, args.warmup)
    summary = {key: summarise(s, b.n) for key, s in samples.items()}
    if b.device.type == "cuda":
        note = "CUDA max_memory_allocated during the rollout minus the memory allocated before it (max of rounds)"
    elif args.memory == "auto" and sys.platform == "linux":
        note = (
            "peak resident set (VmHWM) during one rollout minus the RSS before it, each kind in a fresh process "
            "after one warm-up rollout, freed heap returned first (malloc_trim)"
        )
        for key, peak in cpu_peaks(args, name, VARIANTS).items():
            summary[key]["peak_mib"] = peak
    else:
        note = "not measured"
    lines = report(b, args, argv, summary, note)
    print("\n".join(lines), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rollout_cost_{name}.md"
    path.write_text("\n".join(lines))
    return {"summary": summary, "samples": samples, "acceptance": acceptance(summary)[0], "path": path}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the benchmark; returns per backbone its summary, raw samples, acceptance flags and the report's path."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.tune_malloc and not _timing.tune_malloc():
        print("--tune-malloc: mallopt unavailable (not glibc); running with the default allocator", file=sys.stderr)
    if args.memory_probe:
        print(json.dumps({"peak_mib": memory_probe(args)}))
        return {}
    results = {}
    for name in args.backbone:
        if name == "sd3.5-medium-random" and args.device != "cuda":
            print("sd3.5-medium-random needs CUDA: skipped", file=sys.stderr)
            continue
        results[name] = bench_one(name, args, argv)
    return results


if __name__ == "__main__":
    main()
