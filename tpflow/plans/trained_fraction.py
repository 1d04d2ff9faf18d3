"""The ``trained-fraction`` plan: SDE on the whole window, a random subset of its steps trained (DanceGRPO).

DanceGRPO (docs/algorithm.md §10.1) samples every step by its SDE, drops the last transition, and for each
trajectory independently draws a random permutation of the K − 1 remaining steps and trains the first
int((K − 1)·f) of them (``timestep_fraction`` f = 0.6 in its scripts; FLUX K = 16 trains 9). Here the window is the
recipe's (DanceGRPO: ``window_size = num_steps``, ``window_range = [0, K]``), the last window step is left out
when ``exclude_last`` (the reference always does), and each trajectory's subset of int(eligible·f) steps comes from
a stream of the batch seed. The update trains only those (row, step) pairs and weighs each of them alike, which is
the reference's mean over the selected steps (every trajectory trains the same number).

DanceGRPO's other two parts are recipe settings: its SDE step is the ``dance-sde`` sampler, and its shared initial
noise per group is ``[rollout] same_noise = true`` (the reference shares one x_0 per rank and call, so two prompts
on a rank also share it; here the sharing is per prompt group).
"""

from __future__ import annotations

import random

import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow.plans.base import BatchPlan, derived_generator, draw_window, needs_transition_optimizer
from tpflow.registry import register
from tpflow.settings import RolloutSettings


class TrainedFractionOptions(BaseModel):
    """Options of the ``trained-fraction`` plan; defaults are DanceGRPO's scripts (docs/algorithm.md §10.1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    fraction: float = Field(
        0.6,
        gt=0,
        le=1,
        description="f: each trajectory trains int(eligible · f) of its window "
        "steps, a uniform random subset (DanceGRPO: 0.6).",
    )
    exclude_last: bool = Field(
        True, description="Leave the window's last step out of the eligible ones (DanceGRPO always does)."
    )


def trained_count(window_size: int, options: TrainedFractionOptions) -> int:
    """int(eligible · f), eligible = W − 1 with ``exclude_last`` else W."""
    return int((window_size - int(options.exclude_last)) * options.fraction)


@register("plan", "trained-fraction", options=TrainedFractionOptions)
class TrainedFractionPlan:
    """The recipe's window (start drawn as the ``window`` plan draws it), a random subset of int(eligible·f) steps
    per trajectory trained (module docstring). Implements ``RolloutPlan``. Options: fraction, exclude_last."""

    registered_name = "trained-fraction"
    per_row_windows = False
    reweight_only = True  # recompute = "reweight" takes its trained pairs from the rollout

    def __init__(self, options: TrainedFractionOptions | None = None) -> None:
        self.options = options or TrainedFractionOptions()

    @staticmethod
    def check_recipe(options: TrainedFractionOptions, settings: dict) -> list[str]:
        """At least one step must train, and the optimizer must train stored steps."""
        problems = []
        width = settings["rollout"].window_size
        if trained_count(width, options) < 1:
            problems.append(
                f"fraction = {options.fraction:g} of the {width - int(options.exclude_last)} eligible steps of a "
                f"window of {width} trains int(...) = 0 steps: nothing would train. Raise fraction or window_size "
                "(DanceGRPO: fraction 0.6 of K − 1 = 15 steps)."
            )
        return problems + needs_transition_optimizer(
            settings, "trained-fraction", "a subset of them means nothing to it"
        )

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        width = rollout.window_size
        window = draw_window(rollout.num_steps, width, rollout.window_range, random.Random(batch_seed))
        eligible, count = width - int(self.options.exclude_last), trained_count(width, self.options)
        generator = derived_generator(batch_seed, "trained-fraction")
        trained = torch.zeros((n, width), dtype=torch.bool, device="cpu")  # host bookkeeping (tpflow.devices)
        for row in range(n):  # a permutation per trajectory, its first `count` steps trained (the reference's perms)
            trained[row, torch.randperm(eligible, generator=generator, device="cpu")[:count]] = True
        return BatchPlan((window.start,) * n, width, trained)
