"""What the Evidence II sweep cost in wall-clock time, from each run's ``metrics.jsonl`` (docs/results.md §2.5).

A run's wall time is measured from the timestamps of its metrics lines: its first epoch's seconds, then the time
between consecutive lines (an epoch, plus the evaluation logged with it). A run killed and resumed later has a gap of
hours between two lines; such a gap counts as that epoch's own seconds only, so the figure is the work the finished
run needed, without the time it lay stopped (and without the part-epoch lost to the kill, which was redone). The
sweep's wall time at ``--jobs J`` is the sum over runs divided by J: the runs share the cores two at a time, so a
run's seconds are already its seconds with the other job running.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESTART_GAP_S = 600.0  # a gap this much longer than its epoch's own seconds is a kill and a later resume


def metrics_lines(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` lines ([] without the file)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_wall_s(run_dir: Path) -> float | None:
    """Seconds the run took, restarts excluded (see the module docstring); None without a metrics file."""
    lines = [line for line in metrics_lines(run_dir) if "time" in line]
    if not lines:
        return None
    total = float(lines[0].get("epoch_s", 0.0))
    for before, line in zip(lines, lines[1:], strict=False):
        gap, own = line["time"] - before["time"], float(line.get("epoch_s", 0.0))
        total += own if gap - own > RESTART_GAP_S else gap
    return total


def phase_seconds(run_dir: Path) -> tuple[float, float] | None:
    """Median seconds per epoch of sampling (rollouts, completions and the scoring they wait for) and of the update,
    over the run's epochs; None without a metrics file."""
    lines = [line for line in metrics_lines(run_dir) if "sample_s" in line and "update_s" in line]
    if not lines:
        return None
    return statistics.median(x["sample_s"] for x in lines), statistics.median(x["update_s"] for x in lines)


def phase_line(out: Path, runs: dict[str, list[dict]]) -> str:
    """Markdown: per arm, the median over its runs of their median sampling and update seconds per epoch."""
    parts = []
    for arm, arm_runs in runs.items():
        split = [phase_seconds(out / f"{arm}_s{r['seed']}") for r in arm_runs]
        split = [s for s in split if s is not None]
        if split:
            sample, update = (statistics.median(s[k] for s in split) for k in (0, 1))
            parts.append(f"{arm} {sample:.1f} + {update:.1f}")
    return "Seconds per epoch, sampling + update (medians): " + ("; ".join(parts) or "no metrics files here") + "."


def cost_lines(out: Path, runs: dict[str, list[dict]], jobs: int = 2) -> str:
    """Markdown: mean wall seconds of a run per arm, and the whole sweep's wall time at ``jobs`` runs at once."""
    per_arm, total, counted = [], 0.0, 0
    for arm, arm_runs in runs.items():
        walls = [run_wall_s(out / f"{arm}_s{r['seed']}") for r in arm_runs]
        walls = [w for w in walls if w is not None]
        if walls:
            per_arm.append(f"{arm} {statistics.mean(walls):.0f} s ({len(walls)} run{'s' * (len(walls) != 1)})")
            total, counted = total + sum(walls), counted + len(walls)
    if not counted:
        return "Wall time: no run has a metrics file here."
    return (
        f"Wall time per run (training and evaluations, restarts excluded), mean per arm: {'; '.join(per_arm)}. "
        f"All {counted} runs: {total:.0f} s of run time, {total / jobs / 3600:.2f} h of sweep at --jobs {jobs}."
    )
