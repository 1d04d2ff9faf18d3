"""The ``window`` plan: one SDE window per rollout batch, every stored step trained (Flow-GRPO, TP-GRPO).

The window start s is drawn uniformly from lo..hi − W (``[rollout] window_range``) with the batch's seed, exactly
as tpflow has always drawn it (docs/algorithm.md §2): the default plan, bitwise the behaviour of recipes without a
``[plan]`` section. With ``[rollout] same_noise`` the trajectories of a group share their ODE prefix up to s and
branch there (Flow-GRPO-Fast as its README describes it, MixGRPO's ``init_same_noise``).
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict

from tpflow.plans.base import BatchPlan, draw_window
from tpflow.registry import register
from tpflow.settings import RolloutSettings


class WindowOptions(BaseModel):
    """Options of the ``window`` plan: none (the window is ``[rollout] window_size`` and ``window_range``)."""

    model_config = ConfigDict(extra="forbid")


@register("plan", "window", options=WindowOptions)
class WindowPlan:
    """One window per batch, start drawn from ``window_range`` by the batch seed; all W steps trained. Implements
    ``RolloutPlan``. Options: none."""

    registered_name = "window"
    per_row_windows = False

    def __init__(self, options: WindowOptions | None = None) -> None:
        self.options = options or WindowOptions()

    @staticmethod
    def samples_one_window(options: WindowOptions) -> bool:
        """Always: one window per batch, every step trained, Euler after it."""
        return True

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        window = draw_window(rollout.num_steps, rollout.window_size, rollout.window_range, random.Random(batch_seed))
        return BatchPlan((window.start,) * n, window.size)
