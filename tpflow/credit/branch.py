"""Branch credit: each trained step gets the reward of its own branch's ODE completion (TempFlow-GRPO).

With the ``branch`` rollout plan, window step i of trajectory n is one SDE step from the ODE state its prompt's
copies share (they start from one z_0), and column i of the trace is the reward of that child completed by ODE:
R(ODE(x̃ⁿ_{s+i+1})). This assigner gives step i exactly that reward. The group advantages then z-score column i
over the copies of the prompt, the siblings branched from one state, which is TempFlow-GRPO's per-step advantage
over its "seed group" (docs/algorithm.md §10.4); since the siblings share R(ODE(x_{s+i})), it equals TP-GRPO's
incremental reward of the step, normalised over the siblings with their mean as the baseline.

The trace's last column (the ODE image of the shared noise) is not read. The columns mean what they mean only under
the ``branch`` plan, so ``tpflow validate`` refuses this assigner with any other plan, and that plan with any other
assigner. No step is a turning point.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow import registry
from tpflow.credit.trend import check_trace
from tpflow.interfaces import capability
from tpflow.registry import register
from tpflow.types import Credit


class BranchOptions(BaseModel):
    """The branch assigner takes no options."""

    model_config = ConfigDict(extra="forbid")


@register("credit", "branch", options=BranchOptions)
class BranchCredit:
    """CreditAssigner of TempFlow-GRPO: r_i = trace[:, i], the reward of window step i's own branch (module
    docstring). Options: none."""

    needs_completions: bool = True
    reads_branches: bool = True  # its trace columns are branch completions: only with a plan that branches

    def __init__(self, options: BranchOptions | None = None) -> None:
        self.options = options or BranchOptions()

    @staticmethod
    def check_recipe(options: BranchOptions, settings: dict) -> list[str]:
        plan = settings["plan"].name
        if capability(registry.get("plan", plan).factory, "branches"):
            return []
        return [
            f"credit 'branch' reads column i of the trace as the reward of a child branched at window step i, which "
            f"only a branching rollout plan produces, and plan {plan!r} does not branch. Use [plan] name = "
            '"branch" (TempFlow-GRPO), or another credit assigner.'
        ]

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] (column i: the reward of step i's branch) -> step_rewards [N, W] = trace[:, :W]."""
        check_trace(trace, "credit assigner 'branch'")
        step_rewards = trace[:, :-1].clone()  # [N, W]
        turning_points = torch.zeros(step_rewards.shape, dtype=torch.bool, device=trace.device)
        return Credit(step_rewards=step_rewards, turning_points=turning_points)
