"""Analysis of the learning-curve sweep (``learning_curves.py``): per-run summaries, bootstrap confidence intervals,
the endpoint tables, the diagnostics and the plots.

Endpoints (docs/results/first_attempt.md): the eval reward per evaluation; the final eval reward; the epochs and
training seconds an arm needs to reach the same seed's Flow-GRPO (``outcome``) final eval reward; the area under the
eval curve (trapezoid over epochs, divided by the epochs: the mean eval reward over training) and its paired (same
seed) difference to ``outcome``. Intervals are 95% percentile bootstraps over seeds (10,000 resamples, fixed
seed); with 5 seeds they are somewhat too narrow, which the report says.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

RESAMPLES = 10_000
BASELINE = "outcome"


# ---- one run ---------------------------------------------------------------------------------------------------


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise_run(run_dir: Path, data: dict) -> dict:
    """Eval curve against epochs and training seconds, cost, and the credit diagnostics of one finished run."""
    lines = _read(run_dir / "metrics.jsonl")
    train = [line for line in lines if "epoch_s" in line]
    every, epochs = data["eval"]["every"], data["train"]["epochs"]
    seconds = np.concatenate([[0.0], np.cumsum([line["epoch_s"] for line in train])])  # after e epochs
    evals = {line["epoch"]: line["eval_reward"] for line in train if line["epoch"] % every == 0}
    evals[epochs] = next(line["eval_reward"] for line in reversed(lines) if "epoch_s" not in line)
    grid = sorted(evals)
    return {
        "epochs": grid,
        "eval_reward": [evals[e] for e in grid],
        "seconds": [float(seconds[e]) for e in grid],
        "epoch_s_mean": statistics.mean(line["epoch_s"] for line in train),
        "nfe_per_traj": train[0]["nfe_per_traj"],
        "train_reward": [line["reward_mean"] for line in train],
        "kl": statistics.mean(line.get("kl", 0.0) for line in train),
        "clip_fraction": statistics.mean(line.get("clip_fraction", 0.0) for line in train),
        **trace_diagnostics(_read(run_dir / "traces.jsonl")),
    }


def trace_diagnostics(traces: list[dict]) -> dict:
    """What the credit assigner saw, over every logged trajectory of the run.

    zero_increment_share: share of incremental rewards d_i = R_{i+1} − R_i that are exactly 0 (None when the arm
    scores no completions); tp_per_traj: turning points per trajectory; tp_positions: per window step, the share of
    trajectories with a turning point there; dropped_share: share of trajectories whose advantages are all 0 (the
    update skips them); group_std: mean over (epoch, prompt group) of the population std of the final reward.
    """
    trace = np.array([t["trace"] for t in traces], dtype=np.float64)  # [N, W+1], NaN where nothing was scored
    turning = np.array([t["turning_points"] for t in traces], dtype=np.float64)  # [N, W]
    advantages = np.array([t["advantages"] for t in traces], dtype=np.float64)  # [N, W]
    scored = np.isfinite(trace).all(axis=1)
    zero = float((np.diff(trace[scored], axis=1) == 0).mean()) if scored.any() else None
    finals: dict[tuple, list[float]] = {}
    for t in traces:
        finals.setdefault((t["epoch"], t["group"]), []).append(t["trace"][-1])
    return {
        "zero_increment_share": zero,
        "tp_per_traj": float(turning.sum(axis=1).mean()),
        "tp_positions": turning.mean(axis=0).tolist(),
        "dropped_share": float((advantages == 0).all(axis=1).mean()),
        "group_std": float(np.mean([np.std(v) for v in finals.values()])),
    }


# ---- across seeds ----------------------------------------------------------------------------------------------


def bootstrap_ci(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% percentile-bootstrap interval over the given per-seed values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    means = np.random.default_rng(seed).choice(x, size=(RESAMPLES, x.size), replace=True).mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def auc(run: dict) -> float:
    """Mean eval reward over training: the trapezoid area under eval reward against epochs, over the epochs."""
    e, r = np.asarray(run["epochs"], dtype=np.float64), np.asarray(run["eval_reward"], dtype=np.float64)
    return float(np.sum((r[1:] + r[:-1]) / 2 * np.diff(e)) / (e[-1] - e[0]))


def reach(run: dict, target: float) -> tuple[int, float] | None:
    """First evaluated (epochs, training seconds) with eval reward ≥ target; None if the run never gets there."""
    for epoch, reward, sec in zip(run["epochs"], run["eval_reward"], run["seconds"], strict=True):
        if reward >= target - 1e-12:
            return epoch, sec
    return None


def load_results(out: Path, tasks: list[str], arms: list[str], seeds: list[int]) -> dict[str, dict[str, list[dict]]]:
    """results[task][arm] = the finished runs (missing ones are left out, and the report counts n)."""
    results: dict[str, dict[str, list[dict]]] = {}
    for task in tasks:
        results[task] = {}
        for arm in arms:
            files = [out / f"{task}_{arm}_s{seed}.json" for seed in seeds]
            results[task][arm] = [json.loads(f.read_text()) for f in files if f.exists()]
    return results


def endpoints(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm: the endpoint statistics of one task (paired with the same seed's outcome run)."""
    base = {r["seed"]: r for r in runs.get(BASELINE, [])}
    table = {}
    for arm, arm_runs in runs.items():
        paired = [r for r in arm_runs if r["seed"] in base]
        hits = [reach(r, base[r["seed"]]["eval_reward"][-1]) for r in paired]
        table[arm] = {
            "n": len(arm_runs),
            "nfe_per_traj": arm_runs[0]["nfe_per_traj"] if arm_runs else math.nan,
            "epoch_s": bootstrap_ci([r["epoch_s_mean"] for r in arm_runs]),
            "eval_0": bootstrap_ci([r["eval_reward"][0] for r in arm_runs]),
            "final": bootstrap_ci([r["eval_reward"][-1] for r in arm_runs]),
            "gain": bootstrap_ci([r["eval_reward"][-1] - r["eval_reward"][0] for r in arm_runs]),
            "auc_diff": bootstrap_ci([auc(r) - auc(base[r["seed"]]) for r in paired]),
            "final_diff": bootstrap_ci([r["eval_reward"][-1] - base[r["seed"]]["eval_reward"][-1] for r in paired]),
            "reach_epochs": bootstrap_ci([h[0] for h in hits if h is not None]),
            "reach_seconds": bootstrap_ci([h[1] for h in hits if h is not None]),
            "reached": f"{sum(h is not None for h in hits)}/{len(paired)}",
        }
        for key in ("zero_increment_share", "tp_per_traj", "dropped_share", "group_std", "kl", "clip_fraction"):
            values = [r[key] for r in arm_runs if r.get(key) is not None]
            table[arm][key] = statistics.mean(values) if values else None
    return table


# ---- report ----------------------------------------------------------------------------------------------------


def _ci(stat: tuple[float, float, float], digits: int = 3) -> str:
    mean, low, high = stat
    if math.isnan(mean):
        return "—"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}" if abs(value) < 1e-3 and value else f"{value:.{digits}f}"


def markdown(task_label: str, table: dict[str, dict]) -> str:
    """The endpoint table and the diagnostics table of one task."""
    rows = [
        f"**{task_label}** (mean [95% bootstrap CI] over n seeds; differences paired with the same seed's outcome)",
        "",
        "| arm | n | NFE/traj | s/epoch | eval at 0 | final eval | final − outcome | AUC − outcome "
        "| epochs to outcome's final | seconds to it | seeds reaching |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, t in table.items():
        rows.append(
            f"| {arm} | {t['n']} | {t['nfe_per_traj']:g} | {_ci(t['epoch_s'], 1)} | {_ci(t['eval_0'])} "
            f"| {_ci(t['final'])} | {_ci(t['final_diff'])} | {_ci(t['auc_diff'])} | {_ci(t['reach_epochs'], 1)} "
            f"| {_ci(t['reach_seconds'], 0)} | {t['reached']} |"
        )
    rows += [
        "",
        "| arm | zero d_i share | turning points / traj | dropped (all-zero advantage) | within-group reward std "
        "| KL | clip fraction |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, t in table.items():
        rows.append(
            f"| {arm} | {_num(t['zero_increment_share'])} | {_num(t['tp_per_traj'])} | {_num(t['dropped_share'])} "
            f"| {_num(t['group_std'], 4)} | {_num(t['kl'])} | {_num(t['clip_fraction'])} |"
        )
    return "\n".join(rows)


def report(results: dict, tasks: list[str], arms: list[str], docs: Path, protocol: dict, labels: dict) -> dict:
    """Write docs/results/learning_curves.{md,json,png} and turning_points.png; return the tables. ``labels``: task
    -> its title (learning_curves.TASKS' labels, passed in so this module does not import its caller)."""
    docs.mkdir(parents=True, exist_ok=True)
    tables = {task: endpoints(results[task]) for task in tasks}
    text = "\n\n".join(markdown(labels[task], tables[task]) for task in tasks)
    print(text)
    (docs / "learning_curves.md").write_text(text + "\n")
    (docs / "learning_curves.json").write_text(
        json.dumps({"protocol": protocol, "tables": tables, "runs": results}, indent=1)
    )
    from _learning_plots import plot_curves, plot_turning_points

    plot_curves(results, tasks, arms, docs / "learning_curves.png", labels)
    plot_turning_points(results, tasks, docs / "turning_points.png", labels)
    print(f"wrote {docs / 'learning_curves.md'}, .json, .png and turning_points.png")
    return tables
