"""Plots of the learning-curve sweep: eval curves with 95% bootstrap bands, and turning-point positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {
    "outcome": "tab:gray",
    "consistent": "tab:red",
    "turning_point": "tab:orange",
    "incremental": "tab:blue",
    "consistent_x0": "tab:green",
}


def _band(curves: np.ndarray, seed: int = 0, resamples: int = 10_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean [T] and 95% bootstrap band [T] of per-seed curves [S, T] (resampling seeds; ``resamples`` draws, as
    _learning_stats.RESAMPLES: a parameter, not an import, so the two modules do not import each other)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(curves), size=(resamples, len(curves)))
    means = curves[picks].mean(axis=1)  # [R, T]
    return curves.mean(axis=0), np.percentile(means, 2.5, axis=0), np.percentile(means, 97.5, axis=0)


def plot_curves(results: dict, tasks: list[str], arms: list[str], path: Path, labels: dict[str, str]) -> None:
    """One row per task: eval reward against epochs and against training seconds, mean and band per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(18, 4.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        base = {r["seed"]: np.array(r["eval_reward"]) for r in results[task].get("outcome", [])}
        for arm in arms:
            runs = results[task].get(arm, [])
            if not runs:
                continue
            curves = np.array([r["eval_reward"] for r in runs])  # [S, T]
            mean, low, high = _band(curves)
            epochs = np.array(runs[0]["epochs"])
            seconds = np.array([r["seconds"] for r in runs]).mean(axis=0)
            color = COLORS.get(arm)
            for ax, x in ((axes[row, 0], epochs), (axes[row, 1], seconds)):
                ax.plot(x, mean, color=color, marker="o", markersize=3, label=f"{arm} (n={len(runs)})")
                ax.fill_between(x, low, high, color=color, alpha=0.15)
            paired = np.array([np.array(r["eval_reward"]) - base[r["seed"]] for r in runs if r["seed"] in base])
            if len(paired):  # [S, T] difference to the same seed's outcome run
                mean, low, high = _band(paired)
                axes[row, 2].plot(epochs, mean, color=color, marker="o", markersize=3, label=arm)
                axes[row, 2].fill_between(epochs, low, high, color=color, alpha=0.12)
        axes[row, 0].set_xlabel("epochs")
        axes[row, 1].set_xlabel("training seconds (mean over seeds, eval excluded)")
        axes[row, 2].set_xlabel("epochs")
        for ax in axes[row]:
            ax.set_ylabel("eval reward (eval set: mostly training prompts)")
            ax.set_title(labels[task], fontsize=10)
            ax.grid(alpha=0.3)
        axes[row, 2].set_ylabel("eval reward − same seed's outcome run")
        axes[row, 2].axhline(0, color="black", linewidth=0.8)
        axes[row, 0].legend(fontsize=8)
    fig.suptitle("shapes world: eval reward, mean over seeds with 95% bootstrap band")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_turning_points(results: dict, tasks: list[str], path: Path, labels: dict[str, str]) -> None:
    """Per task: the share of trajectories with a turning point at each window step, per turning-point arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 3.8), squeeze=False)
    for col, task in enumerate(tasks):
        ax = axes[0, col]
        arms = [a for a, runs in results[task].items() if runs and any(sum(r["tp_positions"]) > 0 for r in runs)]
        width = 0.8 / max(len(arms), 1)
        for k, arm in enumerate(arms):
            share = np.mean([r["tp_positions"] for r in results[task][arm]], axis=0)  # [W]
            ax.bar(np.arange(len(share)) + k * width, share, width, color=COLORS.get(arm), label=arm)
        ax.set_xlabel("window step i (0 = first SDE step of the window)")
        ax.set_ylabel("share of trajectories with a turning point")
        ax.set_title(labels[task], fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        if arms:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
