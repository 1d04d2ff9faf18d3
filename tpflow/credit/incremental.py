"""Incremental credit: each trained step gets its own reward increment d_i = R_{i+1} − R_i (docs/algorithm.md §0)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow.credit.trend import check_trace
from tpflow.registry import register
from tpflow.types import Credit


class IncrementalOptions(BaseModel):
    """The incremental assigner takes no options."""

    model_config = ConfigDict(extra="forbid")


@register("credit", "incremental", options=IncrementalOptions)
class IncrementalCredit:
    """CreditAssigner that rewards each window step with its local effect only: r_i = d_i = R_{i+1} − R_i.

    This is the paper's incremental step reward r_t (TP-GRPO, arXiv 2602.06422; docs/algorithm.md §0) with no
    turning-point replacement, i.e. what TP-GRPO gives every step that is not a turning point. R_0 is the ODE
    baseline and R_1..R_{W-1} are ODE completions, so ``needs_completions`` is True. No step is a turning point.

    Options: none.
    """

    needs_completions: bool = True

    def __init__(self, options: IncrementalOptions | None = None) -> None:
        self.options = options or IncrementalOptions()

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] -> Credit with step_rewards [N, W] = trace[:, 1:] − trace[:, :-1], no turning points."""
        check_trace(trace, "credit assigner 'incremental'")
        step_rewards = trace[:, 1:] - trace[:, :-1]  # [N, W]
        turning_points = torch.zeros(step_rewards.shape, dtype=torch.bool, device=trace.device)
        return Credit(step_rewards=step_rewards, turning_points=turning_points)
