"""Outcome credit: every trained step gets the final image's reward R_W (Flow-GRPO; docs/algorithm.md §4.6)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow.credit.trend import check_trace
from tpflow.registry import register
from tpflow.types import Credit


class OutcomeOptions(BaseModel):
    """The outcome assigner takes no options."""

    model_config = ConfigDict(extra="forbid")


@register("credit", "outcome", options=OutcomeOptions)
class OutcomeCredit:
    """CreditAssigner of plain Flow-GRPO (Liu et al. 2025): r_i = R_W for every window step i.

    This is the sparse-reward baseline TP-GRPO is compared against (docs/algorithm.md §4.6, the reference's
    ``my_train_*_fast.py``). Only the last column of the trace is read, so the rollout needs no ODE completions
    (``needs_completions`` is False) and columns 0..W-1 may hold anything, NaN included. No step is a turning point.

    Options: none.
    """

    needs_completions: bool = False
    same_reward_every_step: bool = True  # a recompute = "reweight" rollout keeps one gradient per trajectory

    def __init__(self, options: OutcomeOptions | None = None) -> None:
        self.options = options or OutcomeOptions()

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] -> Credit with step_rewards [N, W] all equal to trace[:, W], and no turning points."""
        check_trace(trace, "credit assigner 'outcome'")
        n, width = trace.shape[0], trace.shape[1] - 1
        step_rewards = trace[:, -1:].expand(n, width).clone()  # [N, W]
        turning_points = torch.zeros(n, width, dtype=torch.bool, device=trace.device)
        return Credit(step_rewards=step_rewards, turning_points=turning_points)
