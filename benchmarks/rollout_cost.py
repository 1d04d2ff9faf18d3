"""What a TP-GRPO rollout batch costs on shapes-dit, next to Flow-GRPO and the reference's sequential branches.

    .venv/bin/python benchmarks/rollout_cost.py [--prompts 4] [--copies 8] [--steps 10] [--window 9] [--repeats 3]

One rollout batch (prompts × copies trajectories, CFG on) sampled and scored (decode + shapes-geneval) in five ways:
the batched engine (completions by ODE, first branch step reusing the main velocity), the same without that reuse
(the reference's NFE), one-step x0 completions, Flow-GRPO (no completions), and the reference's execution order
(main trajectory, then each branch and the baseline as separate loops). Prints the median wall time of each,
its NFE per trajectory and its ratio to Flow-GRPO. Not run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpflow
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers import euler_step


def sequential_reference(backbone, sampler, cond, z0, sigmas, width, alpha, guidance, generator):
    """ALGORITHM.md Appendix A as the reference executes it: main, then branches one by one, then the baseline."""
    n, z, keep = z0.shape[0], z0, []
    for k in range(sigmas.shape[0] - 1):
        v = backbone.velocity(z, sigmas[k].expand(n), cond, guidance)
        level = alpha if k < width else 0.0
        z = sampler.step(z, v, sigmas[k], sigmas[k + 1], level, generator=generator).prev
        keep.append(z)
    ends = [sample_ode(backbone, cond, z0, sigmas, guidance)]  # baseline from the same noise
    for j in range(1, width):
        y = keep[j - 1]
        for k in range(j, sigmas.shape[0] - 1):
            y = euler_step(y, backbone.velocity(y, sigmas[k].expand(n), cond, guidance), sigmas[k], sigmas[k + 1])
        ends.append(y)
    return z, torch.stack(ends, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=9)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    backbone = tpflow.build("backbone", "shapes-dit", weights=args.weights)
    sampler = tpflow.build("sampler", "cps")
    reward = tpflow.build("reward", "shapes-geneval")
    items = tpflow.build("dataset", "shapes").split("train")[: args.prompts]
    prompts = [it.prompt for it in items for _ in range(args.copies)]
    metadata = [it.metadata for it in items for _ in range(args.copies)]
    cond = backbone.encode(prompts)
    sigmas = backbone.sigmas(args.steps)
    n, w, g = len(prompts), args.window, args.guidance

    def score(final, completions):
        latents = final if completions is None else torch.cat([completions.flatten(0, 1), final])
        images = backbone.decode(latents)
        reward(images, [p for p in prompts for _ in range(len(images) // n)], metadata * (len(images) // n))

    def engine(**kw):
        def run(z0, gen):
            out = rollout(backbone, sampler, cond, z0, sigmas, Window(0, w), 0.7, g, generator=gen, **kw)
            score(out.final, out.completions)
            return out.cost.nfe

        return run

    def reference(z0, gen):
        final, completions = sequential_reference(backbone, sampler, cond, z0, sigmas, w, 0.7, g, gen)
        score(final, completions)
        return (w + 1) * args.steps - w * (w - 1) // 2

    variants = {
        "TP-GRPO, batched engine (default)": engine(),
        "TP-GRPO, batched, no velocity reuse": engine(reuse_main_velocity=False),
        "TP-GRPO, batched, x0 completions": engine(completions="x0"),
        "TP-GRPO, reference execution order": reference,
        "Flow-GRPO (outcome: no completions)": engine(completions=None),
    }
    warm = backbone.initial_noise(n, torch.Generator().manual_seed(99))
    variants["Flow-GRPO (outcome: no completions)"](warm, torch.Generator().manual_seed(99))  # warm-up, not timed
    results = {}
    for name, run in variants.items():
        times, nfe = [], 0
        for r in range(args.repeats):
            gen = torch.Generator().manual_seed(r)
            z0 = backbone.initial_noise(n, gen)
            start = time.perf_counter()
            nfe = run(z0, gen)
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), nfe)
    base = results["Flow-GRPO (outcome: no completions)"][0]
    print(
        f"{n} trajectories ({args.prompts} prompts × {args.copies}), K={args.steps}, W={w}, CFG {g}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| rollout + scoring | NFE / trajectory | seconds | × Flow-GRPO |")
    print("|---|---|---|---|")
    for name, (seconds, nfe) in results.items():
        print(f"| {name} | {nfe:g} | {seconds:.1f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
