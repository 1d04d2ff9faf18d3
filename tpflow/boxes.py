"""GenEval's position rule on boxes, with numpy alone: shared by the GenEval scorer (``tpflow.rewards.geneval``) and
the shapes world's renderer (``tpflow.shapes.render``), which must place objects so that the scorer agrees. Its own
module because the renderer cannot import the rewards package (which imports the shapes detector, which imports the
renderer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

POSITION_MARGIN = 0.1  # fraction of the summed box sizes an offset must exceed to count as a relation


def direction(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN) -> np.ndarray:
    """GenEval's direction of box a from box b: the centre offset a − b, reduced by ``margin`` × (size of a + size
    of b) along each axis (not below 0), divided by the length of the full offset; [2] (x, y), y grows downwards.
    Zero when the boxes are too close to tell."""
    a, b = np.asarray(box_a[:4], dtype=np.float64), np.asarray(box_b[:4], dtype=np.float64)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2  # [2] centre of a − centre of b
    sizes = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])  # [2] summed widths, summed heights
    reduced = np.maximum(np.abs(offset) - margin * sizes, 0) * np.sign(offset)
    if np.all(np.abs(reduced) < 1e-3):
        return np.zeros(2)
    return reduced / np.linalg.norm(offset)


def relation_holds(
    box_a: Sequence[float], box_b: Sequence[float], relation: str, margin: float, threshold: float
) -> bool:
    """Whether box a is in ``relation`` ("left of", "right of", "above", "below") to box b: ``direction`` beyond
    ±``threshold`` along the relation's axis (GenEval: margin 0.1, threshold 0.5; "above" is a negative y)."""
    dx, dy = direction(box_a, box_b, margin)
    return {"left of": dx < -threshold, "right of": dx > threshold, "above": dy < -threshold, "below": dy > threshold}[
        relation
    ]
