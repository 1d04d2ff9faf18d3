"""The ``window-per-image`` plan: every trajectory its own SDE window at a random start (Flow-GRPO-Fast's code).

Flow-GRPO-Fast as its current code runs it (docs/algorithm.md §10.1) draws the window start a uniformly from
lo..hi − w per pipeline call, and each GPU's call draws its own, so the images of one prompt group mostly have
different windows and different ODE prefixes; every step outside the window is Euler ODE, the w window steps are
SDE and trained. Here each trajectory draws its own start from lo..hi − W (``[rollout] window_range``), from a
stream of the batch's seed: the members of a group differ as they do across the reference's GPUs, and the draw
does not depend on how many processes share the epoch. All rows still go through one velocity call per step.

Completions need every row of a batch at the same window step, so this plan takes only credit that reads the final
reward (``outcome``): ``tpflow validate`` refuses the others.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.plans.base import BatchPlan, derived_rng
from tpflow.registry import register
from tpflow.settings import RolloutSettings


class WindowPerImageOptions(BaseModel):
    """Options of the ``window-per-image`` plan: none (``[rollout] window_size`` and ``window_range`` say where)."""

    model_config = ConfigDict(extra="forbid")


@register("plan", "window-per-image", options=WindowPerImageOptions)
class WindowPerImagePlan:
    """A window start per trajectory, uniform in lo..hi − W from the batch seed; all W steps trained. Implements
    ``RolloutPlan``. Options: none."""

    registered_name = "window-per-image"
    per_row_windows = True
    reweight_only = True  # recompute = "reweight" takes each row's window steps from the rollout

    def __init__(self, options: WindowPerImageOptions | None = None) -> None:
        self.options = options or WindowPerImageOptions()

    @staticmethod
    def check_recipe(options: WindowPerImageOptions, settings: dict) -> list[str]:
        """Per-row windows leave no common step at which to start completions: only final-reward credit."""
        credit = settings["credit"].name
        if capability(registry.get("credit", credit).factory, "needs_completions"):
            return [
                f"the trajectories of a batch start their windows at different steps, so there is no step at which "
                f"every row could branch into ODE completions, and credit {credit!r} needs them. Use [credit] name = "
                '"outcome" (Flow-GRPO-Fast\'s own credit), or [plan] name = "window" for one window per batch.'
            ]
        return []

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        lo, hi = rollout.window_range
        rng = derived_rng(batch_seed, "window-per-image")
        return BatchPlan(tuple(rng.randint(lo, hi - rollout.window_size) for _ in range(n)), rollout.window_size)
