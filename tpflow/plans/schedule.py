"""The ``window-schedule`` plan: the SDE window moves over training (MixGRPO's sliding window).

MixGRPO (docs/algorithm.md §10.1, ``GRPOTrainingStates``) keeps one window of w SDE steps for every trajectory of
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
(MixGRPO's hi is its ``max_timesteps`` = K − 2; its l = hi, an empty window, is not a start here). MixGRPO cuts
progressive windows only: its random start is ``rng.integers(0, max_timesteps − w + 1)``, a full window every
time, so ``random`` with ``truncate`` is refused rather than given a distribution no reference draws. The start is
a pure function of (options, range, run seed, epoch), so the plan needs no state of its own to resume exactly.

With ``after_window = "dpm-solver++"`` every window the schedule can reach must end before step K: the solver runs
from the window's end e to σ = 0 and needs at least one step there (e ≤ K − 1); a window ending at K leaves it the
nodes [σ_K, 0] = [0, 0], and the rollout of that epoch fails. ``check_recipe`` refuses such recipes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.plans.base import BatchPlan, derived_rng
from tpflow.registry import register
from tpflow.settings import MAX_COUNT, RolloutSettings


class WindowScheduleOptions(BaseModel):
    """Options of the ``window-schedule`` plan; defaults are MixGRPO's script values (docs/algorithm.md §10.1)."""

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
        "instead of every window holding W steps and the last start being hi − W. Progressive only: MixGRPO's random "
        "strategy draws full windows.",
    )
    after_window: Literal["euler", "dpm-solver++"] = Field(
        "euler",
        description="After the window: the schedule's Euler steps (MixGRPO), or DPM-Solver++(2M) on a compressed "
        "schedule of int((K − e)·post_ratio) nodes (MixGRPO-Flash; outcome credit only).",
    )
    post_ratio: float = Field(
        0.4, gt=0, le=1, description="ρ of MixGRPO-Flash's compressed schedule (Flash: 0.4, Flash*: 0.2)."
    )


def start_range(options: WindowScheduleOptions, rollout: RolloutSettings) -> tuple[int, int]:
    """The first and last start (both included): lo..hi − W, or lo..hi − 1 with ``truncate``."""
    lo, hi = rollout.window_range
    return lo, hi - 1 if options.truncate else hi - rollout.window_size


def reachable_starts(options: WindowScheduleOptions, first: int, last: int) -> list[int]:
    """Every start :func:`schedule_start` gives over first..last in a run of any length: all of them when random;
    first + m·stride up to last when progressive, and last itself without ``roll_back`` (a move past it stays
    there). The run's epochs are not counted: a resumed run may train longer than the recipe first said."""
    if options.strategy == "random":
        return list(range(first, last + 1))
    starts = list(range(first, last + 1, options.stride))
    if not options.roll_back and starts[-1] != last:
        starts.append(last)
    return starts


def _span(starts: list[int]) -> str:
    """Starts for a message: "6..9" for three or more consecutive ones, else listed ("6", "6, 7", "4, 8")."""
    if len(starts) > 2 and starts == list(range(starts[0], starts[-1] + 1)):
        return f"{starts[0]}..{starts[-1]}"
    return ", ".join(map(str, starts))


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

    @staticmethod
    def samples_one_window(options: WindowScheduleOptions) -> bool:
        """Always: one window per epoch, every step trained (MixGRPO-Flash's DPM-Solver tail comes after it)."""
        return True

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        first, last = start_range(self.options, rollout)
        start = schedule_start(self.options, first, last, epoch, run_seed)
        size = min(rollout.window_size, rollout.window_range[1] - start)  # W, or fewer where truncate cuts at hi
        flash = self.options.after_window == "dpm-solver++"
        return BatchPlan((start,) * n, size, tail_ratio=self.options.post_ratio if flash else None)

    @staticmethod
    def check_recipe(options: WindowScheduleOptions, settings: dict) -> list[str]:
        """A solver after the window leaves the schedule's grid, where completions cannot branch, and needs a step
        after every window; cut windows are progressive only (module docstring)."""
        problems = []
        credit = settings["credit"].name
        needs = capability(registry.get("credit", credit).factory, "needs_completions")
        if options.after_window == "dpm-solver++" and needs:
            problems.append(
                f"after_window = 'dpm-solver++' steps off the schedule's grid after the window, where no completion "
                f'can ride along, and credit {credit!r} needs completions. Use [credit] name = "outcome" '
                "(MixGRPO-Flash's own), or after_window = 'euler'."
            )
        if options.strategy == "random" and options.truncate:
            problems.append(
                "[plan] strategy = 'random' with truncate = true would draw window-schedule starts up to hi − 1 and "
                "cut their windows at hi, which MixGRPO never does: its random start is drawn from "
                "0..max_timesteps − w, a full window every time (its cut applies to progressive starts that run past "
                "max_timesteps − w). Set truncate = false (random starts lo..hi − W, every window W steps, as "
                "MixGRPO draws them), or strategy = 'progressive' to keep the cut windows."
            )
        if options.after_window == "dpm-solver++":
            problems += _tail_problems(options, settings["rollout"])
        return problems


def _tail_problems(options: WindowScheduleOptions, rollout: RolloutSettings) -> list[str]:
    """DPM-Solver++ after the window runs from its end e down to σ = 0, at least one step (module docstring): every
    reachable window [l, min(l + W, hi)) must end at e ≤ K − 1, which fails only when hi = K and l + W ≥ K."""
    steps, width, (lo, hi) = rollout.num_steps, rollout.window_size, rollout.window_range
    reaching = [a for a in reachable_starts(options, *start_range(options, rollout)) if min(a + width, hi) >= steps]
    if not reaching:
        return []
    cut = ", windows cut at hi" if options.truncate else ""
    if steps - 1 - width >= 0:
        fix = (
            f"Set [rollout] window_range = [{min(lo, steps - 1 - width)}, {steps - 1}] (hi ≤ K − 1; MixGRPO-Flash's "
            f"is K − 2 = {steps - 2}), or after_window = 'euler'."
        )
    else:
        fix = "Use after_window = 'euler': a window of all K steps leaves none for a solver after it."
    starts = (
        f"starts {_span(reaching)} end their windows" if len(reaching) > 1 else f"start {reaching[0]} ends its window"
    )
    return [
        f"[plan] after_window = 'dpm-solver++' needs at least one step after every window for its solver, but the "
        f"window-schedule's {starts} at step K = {steps} (window_range = [{lo}, {hi}], window_size = {width}{cut}), "
        "leaving the solver no step (σ from 0 to 0): the rollout fails in the first epoch at such a start. " + fix
    ]
