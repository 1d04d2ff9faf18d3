"""The experiment's figure: every seed's evaluation curve (thin) and each arm's mean (thick), against epochs and
against training seconds, one colour per arm (``tpflow compare``; benchmarks/_evidence_plot.py draws Evidence II's
with it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_curves(
    by_arm: dict[str, list[dict]],
    path: Path,
    metric: str,
    title: str,
    ylabel: str | None = None,
    seconds_label: str = "training seconds",
    colours: dict[str, str] | None = None,
) -> dict[str, tuple]:
    """Two panels (x = epoch, x = training seconds) of ``metric`` for every run summary of every arm. Returns each
    arm's thick line: (epochs, mean seconds, mean value) at the evaluations every run of the arm has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_second) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    lines = {}
    for index, (arm, runs) in enumerate(by_arm.items()):
        colour = (colours or {}).get(arm, f"C{index % 10}")  # one colour per arm, its seeds' thin lines too
        epochs = [[e["epoch"] for e in run["evals"]] for run in runs]
        seconds = [[e["seconds"] for e in run["evals"]] for run in runs]
        values = [[e[metric] for e in run["evals"]] for run in runs]
        for x_e, x_s, y in zip(epochs, seconds, values, strict=True):
            by_epoch.plot(x_e, y, color=colour, alpha=0.25, lw=0.8)
            by_second.plot(x_s, y, color=colour, alpha=0.25, lw=0.8)
        n = min(len(y) for y in values)  # evaluations every run of the arm has (all of them once runs finish)
        mean = np.mean([y[:n] for y in values], axis=0)
        label = f"{arm} ({len(runs)} seed{'s' * (len(runs) != 1)})"
        by_epoch.plot(epochs[0][:n], mean, color=colour, lw=2.2, marker="o", label=label)
        mean_seconds = np.mean([x[:n] for x in seconds], axis=0)
        by_second.plot(mean_seconds, mean, color=colour, lw=2.2, marker="o")
        lines[arm] = (epochs[0][:n], mean_seconds.tolist(), mean.tolist())
    by_epoch.set_xlabel("epoch")
    by_second.set_xlabel(seconds_label)
    by_epoch.set_ylabel(ylabel or metric)
    by_epoch.legend(fontsize=8)
    for ax in (by_epoch, by_second):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return lines
