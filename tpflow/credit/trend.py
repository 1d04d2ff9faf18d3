"""Trend quantities of a reward trace, shared by the turning-point credit assigners (docs/algorithm.md §0, §4).

A trace holds, per trajectory, R_0..R_W: ``trace[:, j]`` is the reward of the image obtained after exactly j SDE
window steps with the rest completed by ODE (j = 0: the pure-ODE baseline, j = W: the final image). From it:

* local increment (the paper's r_t):        d_i = R_{i+1} − R_i                 i = 0..W−1
* global delta:                             Δ   = R_W − R_0
* trend-agreement sign (the paper's s_t):   g_i = sgn(d_i)·sgn(Δ) ∈ {−1, 0, +1}  with sgn(0) = 0
* aggregated long-term reward (r_t^agg):    a_j = R_W − R_j                     j = 0..W  (a_0 = Δ, a_W = 0)

Everything is computed in the trace's dtype and on its device. Signs come from ``torch.sign`` and products of signs
(exactly −1, 0 or +1 in any floating dtype), so the tests on them have no rounding issues: a floating-point
difference is zero exactly when its operands are equal and otherwise has the sign of the exact difference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# the ``first_step`` option of both turning-point assigners, described once (each applies its own first-step test)
FIRST_STEP_HELP = (
    "Allow window step i = 0 to be a turning point when it passes the assigner's first-step test: turning_point's "
    "agreement with the global trend, g_0 > 0 (TP-GRPO paper, arXiv 2602.06422, Remark 5.2; docs/algorithm.md "
    "§4.1); consistent's consistency test sgn(d_0)·sgn(R_W − R_1) > 0 (the published runs' first-step rule, the "
    "consistent form of Remark 5.2; docs/algorithm.md §4.4)."
)


class Trend(NamedTuple):
    """The per-trajectory trend quantities of a trace [N, W+1] (docs/algorithm.md §0)."""

    d: Tensor  # [N, W] local increments d_i = R_{i+1} − R_i
    delta: Tensor  # [N] global delta Δ = R_W − R_0
    g: Tensor  # [N, W] trend-agreement signs g_i = sgn(d_i)·sgn(Δ), values in {−1, 0, +1}
    a: Tensor  # [N, W+1] aggregated rewards a_j = R_W − R_j; a[:, 0] = Δ, a[:, W] = 0


def check_trace(trace: Tensor, who: str) -> None:
    """Raise ValueError unless ``trace`` is a floating tensor [N, W+1] with W ≥ 1.

    Args:
        trace: the reward trace handed to a credit assigner.
        who: the assigner's name, for the message (e.g. ``"credit assigner 'consistent'"``).
    """
    if not isinstance(trace, Tensor):
        raise ValueError(f"{who} expects a torch.Tensor reward trace [N, W+1], got {type(trace).__name__}.")
    if trace.dim() != 2 or trace.shape[1] < 2:
        raise ValueError(
            f"{who} expects a reward trace of shape [N, W+1] with W >= 1 (one row per trajectory, column j = reward "
            f"after j SDE window steps completed by ODE, j = 0..W), got shape {tuple(trace.shape)}. "
            "Stack the per-trajectory rewards R_0..R_W as rows."
        )
    if not trace.is_floating_point():
        raise ValueError(
            f"{who} expects a floating-point reward trace, got dtype {trace.dtype}. Convert it first, "
            "e.g. trace.float()."
        )


def trend(trace: Tensor) -> Trend:
    """d, Δ, g and a of a trace [N, W+1] (see the module docstring); the trace is not validated here."""
    d = trace[:, 1:] - trace[:, :-1]  # [N, W]
    final = trace[:, -1:]  # [N, 1] R_W
    a = final - trace  # [N, W+1]
    delta = a[:, 0]  # [N]
    g = torch.sign(d) * torch.sign(delta)[:, None]  # [N, W]
    return Trend(d=d, delta=delta, g=g, a=a)
