"""The Evidence II figure: eval reward of every sweep run against epochs and against training seconds.

One colour per arm; a thin line per seed (every seed drawn, none dropped) and a thick line through the arm's mean
at each evaluation (mean epoch-seconds on the right). Written by ``evidence.py report`` beside the tables, so the
figure and docs/results/evidence_sweep.md always show the same runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLOURS = {
    "outcome": "#444444",
    "consistent": "#d62728",
    "incremental": "#ff7f0e",
    "consistent_x0": "#9467bd",
    "consistent_k3": "#e377c2",
    "nft": "#1f77b4",
}


def plot_sweep(by_arm: dict[str, list[dict]], path: Path, key: str) -> dict[str, tuple]:
    """Two panels (x = epoch, x = training seconds) of ``key`` for every run of every arm in ``by_arm``. Returns
    each arm's thick line: (epochs, mean seconds, mean value) at the evaluations every run of the arm has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_second) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    lines = {}
    for arm, runs in by_arm.items():
        colour = COLOURS.get(arm)  # None: matplotlib picks one
        epochs = [[e["epoch"] for e in run["evals"]] for run in runs]
        seconds = [[e["seconds"] for e in run["evals"]] for run in runs]
        values = [[e[key] for e in run["evals"]] for run in runs]
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
    by_second.set_xlabel("training seconds (2-core CPU, two runs at a time)")
    by_epoch.set_ylabel("eval reward (soft, mean over the 6 tags)")
    by_epoch.legend(fontsize=8)
    for ax in (by_epoch, by_second):
        ax.grid(alpha=0.3)
    fig.suptitle("Evidence II: eval set of docs/results.md §2.1 (126 distinct prompts, 780 images); thin: one seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return lines
