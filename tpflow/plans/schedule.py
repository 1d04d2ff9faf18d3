"""The ``window-schedule`` plan: the SDE window moves over training (MixGRPO's sliding window).

MixGRPO (../shared/RIVALS.md §3(a), ``GRPOTrainingStates``) keeps one window of w SDE steps for every trajectory of
an iteration and moves its start l between iterations:

* ``progressive``: l starts at the lowest start and grows by ``stride`` every ``iters_per_group`` iterations
  (MixGRPO: 25 and 1, ``--prog_overlap``; stride w without it); past the last start it rolls back to the first
  (``roll_back``) or stays at the last;
* ``random``: l uniform over the starts at every iteration. MixGRPO draws it unseeded on each rank; here it is
  drawn from (run seed, epoch), so every process agrees and a resumed run continues the same sequence (the seeded
  form of verl-omni's ``sde_window_scheduler.py``).

An iteration is a tpflow epoch (one sampling stage and its update). The starts are lo..hi − W of
``[rollout] window_range``, and the window holds W steps. With ``truncate`` (MixGRPO's code) the starts run on to
hi − 1 and a window that would pass hi is cut there: W = [l, min(l + w, hi)), fewer SDE steps in those epochs
(MixGRPO's hi is its ``max_timesteps`` = K − 2; its l = hi, an empty window, is not a start here). The start is a
pure function of (options, range, run seed, epoch), so the plan needs no state of its own to resume exactly.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tpflow import registry
from tpflow.plans.base import BatchPlan, derived_rng
from tpflow.registry import register
from tpflow.settings import MAX_COUNT, RolloutSettings


class WindowScheduleOptions(BaseModel):
    """Options of the ``window-schedule`` plan; defaults are MixGRPO's script values (RIVALS.md §3(a))."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["progressive", "random"] = Field(
        "progressive",
        description="progressive: the start slides by `stride` every `iters_per_group` epochs; "
        "random: a start drawn per epoch from (run seed, epoch).",
    )
    iters_per_group: int = Field(25, ge=1, le=MAX_COUNT, description="Epochs spent at each start (MixGRPO: 25).")
    stride: int = Field(
        1, ge=1, le=MAX_COUNT, description="Steps the start moves each time (MixGRPO: 1; w without --prog_overlap)."
    )
    roll_back: bool = Field(
        True, description="Past the last start, go back to the first (MixGRPO) instead of staying at the last."
    )
    truncate: bool = Field(
        False,
        description="Let the start run on to hi − 1 and cut the window at hi (MixGRPO's code: [l, min(l + w, hi))), "
        "instead of every window holding W steps and the last start being hi − W.",
    )
    after_window: Literal["euler", "dpm-solver++"] = Field(
        "euler",
        description="After the window: the schedule's Euler steps (MixGRPO), or DPM-Solver++(2M) on a compressed "
        "schedule of int((K − e)·post_ratio) nodes (MixGRPO-Flash; outcome credit only).",
    )
    post_ratio: float = Field(
        0.4, gt=0, le=1, description="ρ of MixGRPO-Flash's compressed schedule (Flash: 0.4, Flash*: 0.2)."
    )


def schedule_start(options: WindowScheduleOptions, first: int, last: int, epoch: int, run_seed: int) -> int:
    """The window start of ``epoch`` over the starts first..last (both included)."""
    if options.strategy == "random":
        return derived_rng(run_seed, epoch, "window-schedule").randint(first, last)
    start = first
    for _ in range(epoch // options.iters_per_group):  # one move per finished group of epochs
        start += options.stride
        if start > last:
            start = first if options.roll_back else last
    return start


@register("plan", "window-schedule", options=WindowScheduleOptions)
class WindowSchedulePlan:
    """One window for every trajectory of an epoch, its start moved over training (module docstring); all W steps
    trained. Implements ``RolloutPlan``. Options: strategy, iters_per_group, stride, roll_back, truncate."""

    registered_name = "window-schedule"
    per_row_windows = False

    def __init__(self, options: WindowScheduleOptions | None = None) -> None:
        self.options = options or WindowScheduleOptions()

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        lo, hi = rollout.window_range
        last = hi - 1 if self.options.truncate else hi - rollout.window_size
        start = schedule_start(self.options, lo, last, epoch, run_seed)
        size = min(rollout.window_size, hi - start)  # W, or fewer where truncate cuts the window at hi
        flash = self.options.after_window == "dpm-solver++"
        return BatchPlan((start,) * n, size, tail_ratio=self.options.post_ratio if flash else None)

    @staticmethod
    def check_recipe(options: WindowScheduleOptions, settings: dict) -> list[str]:
        """A solver after the window leaves the schedule's grid, where completions cannot branch."""
        credit = settings["credit"].name
        needs = getattr(registry.get("credit", credit).factory, "needs_completions", False)
        if options.after_window == "dpm-solver++" and needs:
            return [
                f"after_window = 'dpm-solver++' steps off the schedule's grid after the window, where no completion "
                f'can ride along, and credit {credit!r} needs completions. Use [credit] name = "outcome" '
                "(MixGRPO-Flash's own), or after_window = 'euler'."
            ]
        return []
