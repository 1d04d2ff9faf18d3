"""GARDO's gate: which trajectories get the KL term (docs/algorithm.md §10.9), as pure functions and one small state.

GARDO regularises only the samples whose reward it trusts least. It ranks every sample of the epoch under the main
reward and under auxiliary rewards (rank 1 the highest), takes u = rank_main − mean of the auxiliary ranks (u > 0:
the main reward ranks the sample lower than the others do), and keeps the KL for the fraction φ of the samples with
u ≥ 0 whose u is largest. φ moves with how large u has been lately (:class:`GateFraction`, the reference's
``RiskCompensator``), within [0.02, 0.2].

Built and checked against the reference's formulas (tests/test_gardo.py); not yet wired to the grpo loss: the update
would need each trajectory's auxiliary rewards, and the trainer hands the optimizer one reward per trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def descending_ranks(scores: Tensor) -> Tensor:
    """[N] float64 ranks of ``scores`` [N], 1 for the highest; ties in row order (a stable sort, where the reference's
    ``torch.sort`` leaves their order to the implementation)."""
    order = torch.sort(scores.double(), descending=True, stable=True).indices
    ranks = torch.empty(scores.shape[0], dtype=torch.float64, device=scores.device)
    ranks[order] = torch.arange(1, scores.shape[0] + 1, dtype=torch.float64, device=scores.device)
    return ranks


def rank_disagreement(main: Tensor, auxiliary: Sequence[Tensor]) -> Tensor:
    """u [N] float64: the main reward's rank minus the mean of the auxiliary rewards' ranks (each [N])."""
    if not auxiliary:
        raise ValueError("the gate compares the main reward with at least one auxiliary reward; none was given.")
    others = torch.stack([descending_ranks(a) for a in auxiliary]).mean(dim=0)
    return descending_ranks(main) - others


def gated_rows(u: Tensor, fraction: float) -> Tensor:
    """[N] bool: u above the (1 − fraction) quantile, linear interpolation, of the u ≥ 0 (numpy's ``percentile``
    default). None is gated when no u is ≥ 0."""
    kept = u[u >= 0].double()
    if not kept.numel():
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = torch.quantile(kept, 1.0 - fraction, interpolation="linear")
    return u > threshold


@dataclass
class GateFraction:
    """φ, the share of the u ≥ 0 that the gate keeps, and the recent means of those u it moves by: up by ``step``
    (×1.1) when this epoch's mean exceeds every kept mean, down (×0.9) when it is below every one, held in [low,
    high]; ``window`` means kept. The first epoch sets φ = ``base``."""

    base: float = 0.1
    step: float = 0.1
    low: float = 0.02
    high: float = 0.2
    window: int = 20
    fraction: float = 0.1
    history: list[float] = field(default_factory=list)

    def update(self, u: Tensor) -> float:
        """Move φ by this epoch's u [N] (only the u ≥ 0 count) and return it."""
        kept = u[u >= 0].double()
        mean = float(kept.mean()) if kept.numel() else float("nan")  # the reference's np.mean of nothing: NaN
        if not self.history:
            self.fraction = self.base
        elif mean > max(self.history):
            self.fraction *= 1 + self.step
        elif mean < min(self.history):
            self.fraction *= 1 - self.step
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = [*self.history, mean][-self.window :]
        return self.fraction

    def state_dict(self) -> dict:
        return {"fraction": self.fraction, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.fraction, self.history = float(state["fraction"]), [float(x) for x in state["history"]]
