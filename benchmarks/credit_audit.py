"""Audit a training run's logged credit and advantages against docs/algorithm.md, re-derived independently in NumPy.

    .venv/bin/python benchmarks/credit_audit.py runs/learning_curves/A_consistent_s0 [more run dirs...]

For every trajectory in ``traces.jsonl`` it recomputes, from the logged reward trace R_0..R_W alone:

* the step rewards of the run's assigner: ``outcome`` (r_i = R_W, §4.6), ``incremental`` (r_i = d_i),
  ``consistent`` (the closed form of §4.4) and ``turning_point`` (Def 4.1 with its third factor and the Remark's
  first-step rule, §4.5), both with the balanced bonus of §4.2 Step B per rollout batch (c = Δ, ties to the lower
  flat index);
* the advantages (§5): per epoch, one group per prompt text, each window column z-scored with the population std
  + 1e-4, exactly 0 where the group is constant, clipped to ±5.

It prints the number of trajectories checked and the largest deviations; a mismatch exits 1. This is the check
behind docs/results.md §2's claim (and the first attempt's) that a sweep ran the algorithm as specified: it shares
no code with tpflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

EPS, CLIP = 1e-4, 5.0


def indicators(trace: np.ndarray, kind: str) -> np.ndarray:
    """Raw turning-point indicators I [B, W] of traces [B, W+1] (§4.2 Step A under the published flags)."""
    d = np.diff(trace, axis=1)  # [B, W] d_i = R_{i+1} − R_i
    delta = trace[:, -1] - trace[:, 0]  # [B]
    a = trace[:, -1:] - trace  # [B, W+1] a_i = R_W − R_i
    g = np.sign(d) * np.sign(delta)[:, None]  # [B, W]
    out = np.zeros_like(d, dtype=bool)
    if kind == "consistent":
        out[:, 0] = np.sign(d[:, 0]) * np.sign(a[:, 1]) > 0
        out[:, 1:] = (g[:, :-1] < 0) & (g[:, 1:] > 0) & (np.sign(d[:, 1:]) * np.sign(a[:, 2:]) > 0)
    else:  # turning_point: Def 4.1 with its third factor, the Remark's first step
        out[:, 0] = g[:, 0] > 0
        out[:, 1:] = (g[:, :-1] < 0) & (g[:, 1:] > 0) & (np.sign(d[:, 1:]) * np.sign(a[:, 1:-1]) > 0)
    return out


def balance(ind: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """§4.2 Step B: equally many selected entries with Δ > 0 and Δ < 0, largest |Δ| first, lower flat index on ties."""
    flat = ind.reshape(-1).copy()
    c = np.repeat(delta, ind.shape[1])
    pos, neg = np.flatnonzero(flat & (c > 0)), np.flatnonzero(flat & (c < 0))
    if len(pos) == 0 or len(neg) == 0:
        return ind
    m = min(len(pos), len(neg))
    keep = np.zeros_like(flat)
    for group in (pos, neg):
        order = sorted(group, key=lambda k: (-abs(c[k]), k))  # largest |c|, then the lower flat index
        keep[order[:m] if len(group) > m else group] = True
    return keep.reshape(ind.shape)


def step_rewards(trace: np.ndarray, kind: str, balanced: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(step rewards [B, W], turning points [B, W]) of one rollout batch's traces [B, W+1]."""
    w = trace.shape[1] - 1
    if kind == "outcome":
        return np.repeat(trace[:, -1:], w, axis=1), np.zeros((len(trace), w), dtype=bool)
    d = np.diff(trace, axis=1)
    if kind == "incremental":
        return d, np.zeros_like(d, dtype=bool)
    ind = indicators(trace, kind)
    if balanced:
        ind = balance(ind, trace[:, -1] - trace[:, 0])
    a = trace[:, -1:] - trace[:, :-1]  # [B, W] a_i for i < W
    chosen = ind & (a != 0)
    return np.where(chosen, a, d), chosen


def advantages(rewards: np.ndarray, groups: list) -> np.ndarray:
    """§5: per prompt group and window column, (r − mean) / (population std + eps), 0 on constant groups, ±5."""
    out = np.zeros_like(rewards)
    keys = np.array(groups)
    for key in set(groups):
        rows = keys == key
        r = rewards[rows]
        centred = r - r.mean(axis=0)
        centred[:, (r.max(axis=0) == r.min(axis=0))] = 0.0
        out[rows] = centred / (np.sqrt((centred**2).mean(axis=0)) + EPS)
    return np.clip(out, -CLIP, CLIP)


def audit(run_dir: Path) -> dict:
    """Compare one run's logged step rewards, turning points and advantages with the re-derivation."""
    saved = sorted((run_dir / "checkpoints").glob("*/recipe.json"))
    if not saved:
        raise SystemExit(f"{run_dir} holds no checkpoint with a recipe.json: not a finished tpflow run.")
    credit = json.loads(saved[-1].read_text())["credit"]  # the recipe as the trainer resolved it
    kind = credit["name"]
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines() if line.strip()]
    by_batch, by_epoch = defaultdict(list), defaultdict(list)
    for t in traces:
        by_batch[(t["epoch"], t["batch"])].append(t)
        by_epoch[t["epoch"]].append(t)
    worst = {"step_rewards": 0.0, "turning_points": 0, "advantages": 0.0}
    for batch in by_batch.values():
        batch.sort(key=lambda t: t["row"])
        trace = np.array([t["trace"] for t in batch], dtype=np.float64)
        if kind == "outcome":
            trace = np.nan_to_num(trace)  # only R_W is scored; the rest is NaN and unused
        r, tp = step_rewards(trace, kind, credit.get("balanced", True))
        logged = np.array([t["step_rewards"] for t in batch])
        worst["step_rewards"] = max(worst["step_rewards"], float(np.abs(r - logged).max()))
        worst["turning_points"] += int((tp != np.array([t["turning_points"] for t in batch], dtype=bool)).sum())
    for epoch in by_epoch.values():
        texts = [" ".join(t["prompt"].lower().split()) for t in epoch]
        expected = advantages(np.array([t["step_rewards"] for t in epoch]), texts)
        logged = np.array([t["advantages"] for t in epoch])
        worst["advantages"] = max(worst["advantages"], float(np.abs(expected - logged).max()))
    return {"run": run_dir.name, "credit": kind, "trajectories": len(traces), **worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="Run directories holding traces.jsonl.")
    parser.add_argument("--tol", type=float, default=1e-5, help="Largest accepted |difference| of a float.")
    args = parser.parse_args(argv)
    ok = True
    for run in args.runs:
        row = audit(run)
        good = row["step_rewards"] <= args.tol and row["advantages"] <= 1e-3 and row["turning_points"] == 0
        ok &= good
        print(
            f"{'ok  ' if good else 'FAIL'} {row['run']:<28} {row['credit']:<14} {row['trajectories']:>5} traj "
            f"| step rewards {row['step_rewards']:.1e} | turning points differing {row['turning_points']} "
            f"| advantages {row['advantages']:.1e}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
