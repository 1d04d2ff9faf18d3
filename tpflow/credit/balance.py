"""Balanced selection of turning points across one rollout batch (docs/algorithm.md §4.2 Step B, §8 D4).

The published TP-GRPO runs keep as many "good" turning points (trajectory delta Δ > 0) as "bad" ones (Δ < 0) within
one sampling call, so that the replaced rewards do not shift the batch's reward balance. The reference code breaks
ties in |c| in an unspecified order (``torch.topk``); here the lower flat index b·W + i always wins.
"""

from __future__ import annotations

import torch
from torch import Tensor


def balance(selected: Tensor, c: Tensor) -> Tensor:
    """Keep equally many selected entries with positive and with negative candidate value c.

    If both signs of c occur among the selected entries, let m = min(#positive, #negative): in each sign group keep
    the m entries with the largest |c|, ties broken by the lower flat index b·W + i, and deselect every other entry,
    including selected entries whose c is 0. If only one sign (or none) occurs, the selection is returned unchanged.

    Args:
        selected: [N, W] bool, the raw turning-point indicators of one rollout batch.
        c: [N] candidate value per trajectory (TP-GRPO uses Δ_b = R_W − R_0), or [N, W] per step.

    Returns:
        [N, W] bool, a subset of ``selected`` (a new tensor).
    """
    if selected.dtype != torch.bool or selected.dim() != 2:
        raise ValueError(f"balance expects a bool selection [N, W], got {selected.dtype} {tuple(selected.shape)}.")
    if c.dim() == 1:
        c = c[:, None]
    c = c.expand_as(selected)
    flat_selected = selected.reshape(-1)
    flat_c = c.reshape(-1)
    positive = (flat_selected & (flat_c > 0)).nonzero().squeeze(1)  # flat indices, ascending
    negative = (flat_selected & (flat_c < 0)).nonzero().squeeze(1)
    if positive.numel() == 0 or negative.numel() == 0:
        return selected.clone()
    m = min(positive.numel(), negative.numel())
    kept = torch.zeros_like(flat_selected)
    kept[_largest(positive, flat_c, m)] = True
    kept[_largest(negative, flat_c, m)] = True
    return kept.view_as(selected)


def _largest(indices: Tensor, flat_c: Tensor, m: int) -> Tensor:
    """The m of ``indices`` (ascending flat indices) with the largest |c|; a stable sort keeps lower indices first."""
    order = torch.sort(flat_c[indices].abs(), descending=True, stable=True).indices
    return indices[order[:m]]
