"""What k-step ODE completions keep of the exact completions' credit, and what they save.

    .venv/bin/python benchmarks/completion_fidelity.py [--recipe recipes/shapes_tp.toml] [--prompts 32]
        [--copies 8] [--ks 1 2 3] [--seed 0] [--out docs/results/completion_fidelity.md]

TP-GRPO scores the image completed by ODE after every SDE window step (R_0..R_{W-1}); with K = 10, W = 9 that is
55 NFE per trajectory against Flow-GRPO's 10. ``[rollout] completion_steps = k`` completes each in k Euler steps on
nodes of the schedule instead (k = 1 is the x0 estimate). This benchmark samples the same trajectories (the recipe's
model, sampler, window draw, reward and credit assigners; one rollout batch per prompt, ``--copies`` trajectories
each) once with exact completions and once per k — the same main trajectories (the same noise and steps; equal up to
the float32 rounding of differently sized batched velocity calls on the CPU, not checked bit for bit), only the
completions differ — and reports, against the exact ones, pooled over every (trajectory, window step):

* sign agreement of the reward increments d_i = R_{i+1} − R_i (sign 0 counts as its own class);
* precision and recall of the turning points of ``turning_point`` (Definition 4.1) and of ``consistent``, both with
  the recipe's credit options except the name;
* Spearman's rank correlation of the step rewards of the recipe's credit assigner;
* NFE per trajectory and the rollout seconds (decode and reward are timed apart: their cost does not depend on k).

Prints a markdown table and writes it, with the command and the machine, to ``--out``. Not run in CI
(tests/test_benchmarks_smoke.py runs it at toy size).
"""

from __future__ import annotations

import argparse
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

import tpflow  # noqa: F401  (registers the components)
from tpflow.devices import cpu_generator
from tpflow.recipe import load_recipe
from tpflow.rollout import draw_window, rollout_from_settings
from tpflow.scoring.call import recipe_policy
from tpflow.train.scoring import score_rollout

ROOT = Path(__file__).resolve().parent.parent


def _variants(ks: list[int]) -> list[tuple[str, int | str]]:
    return [("exact", "all")] + [(f"k={k}", k) for k in ks]


def sample(recipe, prompts: int, copies: int, ks: list[int], seed: int) -> dict[str, dict]:
    """Per variant: the traces [n, W+1] (float64), NFE per trajectory and rollout / scoring seconds."""
    backbone, sampler, reward = recipe.build("backbone"), recipe.build("sampler"), recipe.build("reward")
    items = list(recipe.build("dataset").split("train"))
    picks = random.Random(seed).sample(range(len(items)), min(prompts, len(items)))
    r = recipe.rollout
    out = {name: {"traces": [], "nfe": 0.0, "rollout_s": 0.0, "score_s": 0.0} for name, _ in _variants(ks)}
    warm = backbone.encode([items[picks[0]].prompt])  # one untimed call first: the first one pays for the warm-up
    window = draw_window(r.num_steps, r.window_size, r.window_range, random.Random(seed))
    with torch.no_grad():
        rollout_from_settings(backbone, sampler, warm, [0], window, r, "ode", cpu_generator(seed))
    for b, index in enumerate(picks):
        item = items[index]
        cond = backbone.encode([item.prompt] * copies)
        window = draw_window(r.num_steps, r.window_size, r.window_range, random.Random(seed * 100_003 + b))
        for name, steps in _variants(ks):
            settings = r.model_copy(update={"completion_steps": steps, "completions": "ode"})
            start = time.perf_counter()
            with torch.no_grad():
                roll = rollout_from_settings(
                    backbone, sampler, cond, [0] * copies, window, settings, "ode", cpu_generator(seed + b)
                )
            rollout_s = time.perf_counter() - start
            start = time.perf_counter()
            scored = score_rollout(
                backbone.decode,
                reward,
                roll.final,
                roll.completions,
                [item.prompt] * copies,
                [item.metadata] * copies,
                window.size,
                chunk=recipe.train.score_batch,
                policy=recipe_policy(recipe.train),
            )
            v = out[name]
            v["traces"].append(scored.trace.double())  # [copies, W+1]
            v["nfe"] += roll.cost.nfe / len(picks)
            v["rollout_s"] += rollout_s
            v["score_s"] += time.perf_counter() - start
    return out


def fidelity(recipe, sampled: dict[str, dict]) -> list[dict]:
    """One row per variant: agreement with the exact completions (credit per rollout batch, as the trainer)."""
    options = recipe.credit.options.model_dump()
    assigners = {
        "tp": tpflow.build("credit", "turning_point", **_fit(options, "turning_point")),
        "consistent": tpflow.build("credit", "consistent", **_fit(options, "consistent")),
        "recipe": recipe.build("credit"),
    }

    def credit(traces: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts = {name: [a(t) for t in traces] for name, a in assigners.items()}
        return {
            name: (torch.cat([c.step_rewards for c in cs]), torch.cat([c.turning_points for c in cs]))
            for name, cs in parts.items()
        }

    exact_traces = sampled["exact"]["traces"]
    exact = credit(exact_traces)
    exact_trace = torch.cat(exact_traces)  # [N, W+1]
    exact_sign = torch.sign(exact_trace.diff(dim=1))
    rows = []
    for name, v in sampled.items():
        trace = torch.cat(v["traces"])
        got = credit(v["traces"])
        row = {
            "variant": name,
            "nfe_per_traj": v["nfe"],
            "rollout_s": v["rollout_s"],
            "score_s": v["score_s"],
            "sign_agreement": float((torch.sign(trace.diff(dim=1)) == exact_sign).double().mean()),
            "baseline_mae": float((trace[:, 0] - exact_trace[:, 0]).abs().mean()),
        }
        for key in ("tp", "consistent"):
            tp, ref = got[key][1], exact[key][1]
            hits = int((tp & ref).sum())
            row[f"{key}_precision"] = hits / int(tp.sum()) if int(tp.sum()) else float("nan")
            row[f"{key}_recall"] = hits / int(ref.sum()) if int(ref.sum()) else float("nan")
            row[f"{key}_count"] = int(tp.sum())
        a, b = got["recipe"][0].flatten().numpy(), exact["recipe"][0].flatten().numpy()
        row["step_reward_spearman"] = float(spearmanr(a, b).statistic) if a.std() > 0 and b.std() > 0 else float("nan")
        rows.append(row)
    return rows


def _fit(options: dict, name: str) -> dict:
    """The recipe's credit options that the assigner ``name`` accepts."""
    from tpflow.registry import get

    fields = get("credit", name).options.model_fields
    return {k: v for k, v in options.items() if k in fields}


def table(rows: list[dict], n: int, width: int) -> str:
    head = (
        "| completions | NFE / traj | rollout s | sign(d_i) agree | R_0 abs. error | TP precision | TP recall "
        "| consistent TP precision | consistent TP recall | Spearman step rewards |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['variant']} | {r['nfe_per_traj']:.1f} | {r['rollout_s']:.1f} | {r['sign_agreement']:.3f} "
        f"| {r['baseline_mae']:.4f} | {r['tp_precision']:.3f} ({r['tp_count']}) | {r['tp_recall']:.3f} "
        f"| {r['consistent_precision']:.3f} ({r['consistent_count']}) | {r['consistent_recall']:.3f} "
        f"| {r['step_reward_spearman']:.3f} |"
        for r in rows
    ]
    note = (
        f"\n{n} trajectories, W = {width}: agreement pooled over {n * width} (trajectory, window step) pairs; turning "
        "points counted in parentheses. Decode and reward took the same time for every variant.\n"
    )
    return head + "\n".join(lines) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "shapes_tp.toml")
    parser.add_argument("--prompts", type=int, default=32, help="rollout batches, one prompt each")
    parser.add_argument("--copies", type=int, default=8, help="trajectories per prompt (the recipe's G is 8)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="recipe override, section.key=value")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write (default: print only)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.set)
    torch.manual_seed(args.seed)
    sampled = sample(recipe, args.prompts, args.copies, args.ks, args.seed)
    rows = fidelity(recipe, sampled)
    n = sum(t.shape[0] for t in sampled["exact"]["traces"])
    text = table(rows, n, recipe.rollout.window_size)
    print(text)
    if args.out is not None:
        command = " ".join(shlex.quote(a) for a in ["benchmarks/completion_fidelity.py", *(argv or sys.argv[1:])])
        args.out.write_text(
            f"# k-step completions against exact ones\n\n`{command}` on {platform.machine()}, "
            f"{torch.get_num_threads()} threads, recipe {args.recipe.name}"
            f"{' with ' + ', '.join(args.set) if args.set else ''}.\n\n{text}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
