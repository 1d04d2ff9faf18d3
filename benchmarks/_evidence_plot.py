"""The Evidence II figure: eval reward of every sweep run against epochs and against training seconds.

One colour per arm; a thin line per seed (every seed drawn, none dropped) and a thick line through the arm's mean
at each evaluation (mean epoch-seconds on the right). Written by ``evidence.py report`` beside the tables, so the
figure and docs/results/evidence_sweep.md always show the same runs.
"""

from __future__ import annotations

from pathlib import Path

COLOURS = {
    "outcome": "#444444",
    "consistent": "#d62728",
    "incremental": "#ff7f0e",
    "consistent_x0": "#9467bd",
    "consistent_k3": "#e377c2",
    "nft": "#1f77b4",
}


def plot_sweep(by_arm: dict[str, list[dict]], path: Path, key: str) -> dict[str, tuple]:
    """Evidence II's figure: ``tpflow.experiments.plot.plot_curves`` with its labels and colours."""
    from tpflow.experiments.plot import plot_curves

    return plot_curves(
        by_arm,
        path,
        key,
        "Evidence II: eval set of docs/results.md §2.1 (126 distinct prompts, 780 images); thin: one seed",
        ylabel="eval reward (soft, mean over the 6 tags)",
        seconds_label="training seconds (2-core CPU, two runs at a time)",
        colours=COLOURS,
    )
