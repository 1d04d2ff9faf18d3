"""Consistent turning-point credit: TP-GRPO "with constraint", the published runs (docs/algorithm.md §4.4, §4.5)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.credit.balance import balance
from tpflow.credit.trend import FIRST_STEP_HELP, Trend, check_trace, trend
from tpflow.registry import register
from tpflow.types import Credit


class ConsistentOptions(BaseModel):
    """Options of the ``consistent`` credit assigner."""

    model_config = ConfigDict(extra="forbid")

    balanced: bool = Field(
        default=True,
        description=(
            "Keep equally many turning points of trajectories with Δ > 0 and Δ < 0 within one rollout batch, "
            "largest |Δ| first, ties to the lower flat index (docs/algorithm.md §4.2 Step B; on in the published "
            "TP-GRPO runs, absent from the paper)."
        ),
    )
    first_step: bool = Field(default=True, description=FIRST_STEP_HELP)


@register("credit", "consistent", options=ConsistentOptions)
class ConsistentCredit:
    """CreditAssigner of TP-GRPO "with constraint": consistent turning points, Definition 5.1 (arXiv 2602.06422).

    This is exactly what the published TP-GRPO scripts run (docs/algorithm.md §4.4). With d_i = R_{i+1} − R_i,
    Δ = R_W − R_0, g_i = sgn(d_i)·sgn(Δ) and a_j = R_W − R_j (docs/algorithm.md §0), window step i is a turning
    point when

    * i ≥ 1: g_{i−1} < 0, g_i > 0 and sgn(d_i)·sgn(a_{i+1}) > 0 (Definition 5.1: the rest of the trajectory after
      this step keeps moving the way this step did, so |a_i| = |a_{i+1}| + |d_i| > |d_i|). The last window step
      i = W−1 is never selected, since a_W = 0;
    * i = 0: ``first_step`` and sgn(d_0)·sgn(a_1) > 0 (the published first-step rule; it implies g_0 > 0).

    The selection is then balanced across the batch if ``balanced`` (``tpflow.credit.balance``, c = Δ_b). A selected
    step gets the aggregated reward r_i = a_i, every other step its increment r_i = d_i (docs/algorithm.md §8 D5).
    Selected steps satisfy sgn(r_i) = sgn(d_i) = sgn(Δ) and |r_i| > |d_i|.

    Options:
        balanced: balance good (Δ > 0) and bad (Δ < 0) turning points per call (default True).
        first_step: allow i = 0 to be a turning point (default True).
    """

    needs_completions: bool = True
    marks_turning_points: bool = True  # the run logs its turning points per trajectory

    def __init__(self, options: ConsistentOptions | None = None) -> None:
        self.options = options or ConsistentOptions()

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] of one rollout batch -> Credit(step_rewards [N, W], turning_points [N, W] bool)."""
        check_trace(trace, "credit assigner 'consistent'")
        t = trend(trace)
        selected = self._select(t)
        if self.options.balanced:
            selected = balance(selected, t.delta)
        step_rewards = torch.where(selected, t.a[:, :-1], t.d)  # [N, W]
        return Credit(step_rewards=step_rewards, turning_points=selected)

    def _select(self, t: Trend) -> Tensor:
        """Raw consistent turning-point indicators [N, W] bool (before balancing)."""
        selected = torch.zeros(t.d.shape, dtype=torch.bool, device=t.d.device)
        against_before = t.g[:, :-1] < 0  # [N, W-1] g_{i-1} < 0 for i = 1..W-1
        with_now = t.g[:, 1:] > 0  # [N, W-1] g_i > 0
        rest_agrees = torch.sign(t.d[:, 1:]) * torch.sign(t.a[:, 2:]) > 0  # [N, W-1] sgn(d_i)·sgn(a_{i+1}) > 0
        selected[:, 1:] = against_before & with_now & rest_agrees
        if self.options.first_step:
            selected[:, 0] = torch.sign(t.d[:, 0]) * torch.sign(t.a[:, 1]) > 0
        return selected
