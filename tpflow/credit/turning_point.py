"""Turning-point credit: TP-GRPO "w/o constraint", paper Definition 4.1 + Remark 5.2 (docs/algorithm.md §4.1, §4.5)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.credit.balance import balance
from tpflow.credit.trend import FIRST_STEP_HELP, Trend, check_trace, trend
from tpflow.registry import register
from tpflow.types import Credit


class TurningPointOptions(BaseModel):
    """Options of the ``turning_point`` credit assigner."""

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


@register("credit", "turning_point", options=TurningPointOptions)
class TurningPointCredit:
    """CreditAssigner of TP-GRPO "w/o constraint": turning points by the paper's Definition 4.1 (arXiv 2602.06422).

    With d_i = R_{i+1} − R_i, Δ = R_W − R_0, g_i = sgn(d_i)·sgn(Δ) and a_i = R_W − R_i (docs/algorithm.md §0), window
    step i is a turning point when

    * i ≥ 1: g_{i−1} < 0, g_i > 0 and sgn(d_i)·sgn(a_i) > 0 (Definition 4.1: the previous step went against the
      global trend, this one goes with it, and its aggregated reward has the sign of its own increment). The
      reference code omits the third condition; tpflow keeps it (docs/algorithm.md §8 D3 and item 5);
    * i = 0: ``first_step`` and g_0 > 0 (Remark 5.2).

    The selection is then balanced across the batch if ``balanced`` (``tpflow.credit.balance``, c = Δ_b). A selected
    step gets the aggregated reward r_i = a_i, every other step its increment r_i = d_i (docs/algorithm.md §8 D5).
    Selected steps satisfy sgn(r_i) = sgn(d_i) = sgn(Δ), but unlike ``consistent`` not always |r_i| > |d_i|: the
    rest of the trajectory may partly undo step i (R = [0, −1, 3, 2] selects i = 1 with a_1 = 3 < d_1 = 4).

    Options:
        balanced: balance good (Δ > 0) and bad (Δ < 0) turning points per call (default True).
        first_step: allow i = 0 to be a turning point (default True).
    """

    needs_completions: bool = True
    marks_turning_points: bool = True  # the run logs its turning points per trajectory

    def __init__(self, options: TurningPointOptions | None = None) -> None:
        self.options = options or TurningPointOptions()

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] of one rollout batch -> Credit(step_rewards [N, W], turning_points [N, W] bool)."""
        check_trace(trace, "credit assigner 'turning_point'")
        t = trend(trace)
        selected = self._select(t)
        if self.options.balanced:
            selected = balance(selected, t.delta)
        step_rewards = torch.where(selected, t.a[:, :-1], t.d)  # [N, W]
        return Credit(step_rewards=step_rewards, turning_points=selected)

    def _select(self, t: Trend) -> Tensor:
        """Raw turning-point indicators [N, W] bool (before balancing)."""
        selected = torch.zeros(t.d.shape, dtype=torch.bool, device=t.d.device)
        against_before = t.g[:, :-1] < 0  # [N, W-1] g_{i-1} < 0 for i = 1..W-1
        with_now = t.g[:, 1:] > 0  # [N, W-1] g_i > 0
        agg_agrees = torch.sign(t.d[:, 1:]) * torch.sign(t.a[:, 1:-1]) > 0  # [N, W-1] sgn(d_i)·sgn(a_i) > 0
        selected[:, 1:] = against_before & with_now & agg_agrees
        if self.options.first_step:
            selected[:, 0] = t.g[:, 0] > 0
        return selected
