"""The ``branch`` plan: a pure-ODE path that branches into SDE children at every window step (TempFlow-GRPO).

TempFlow-GRPO (docs/algorithm.md §10.4) follows each prompt's noise by Euler ODE and, at every step k, draws C SDE
children x̃ᵇ_{k+1} ~ N(μ_k, s_k²) from the same ODE state x_k, completes each by ODE and scores it; the transition
x_k → x̃ᵇ_{k+1} is trained with the advantage of its reward over the C siblings. Here the siblings are the copies of
a prompt in a group that start from one z_0 (``[rollout] same_noise = true``, group size C: TempFlow's 6), so the
prompt group is TempFlow's "seed group": trajectory b of the group is child b at every window step, its ξ_k its own,
and the credit assigner ``branch`` gives window step i the reward of its child's completion. The window (start and
size as the ``window`` plan draws them) is where the path branches: TempFlow's SD3 code branches at k = 0..K − 2
(``window_size = K − 1``), its FLUX code at every step.

NFE per trajectory (one velocity call per step for the path, every child alive, ``[rollout] max_batch`` apart): the
path's K over the C siblings plus each child's remaining steps, K/C + Σ_i (K − s − i − 1); for K = 10, W = 9, C = 6,
≈ 46.7, i.e. 280 per ODE path (TempFlow's count, 279, does not finish the path's last step; tpflow does, for the
logged final reward). ``completion_steps = k`` completes each child in at most k Euler steps instead.

Siblings must branch at the same steps, so the window's start is drawn once per epoch, from (run seed, epoch), and
every rollout batch and process of the epoch uses it (a wide ``window_range`` varies it between epochs).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.plans.base import BatchPlan, derived_rng, draw_window, needs_transition_optimizer
from tpflow.registry import register
from tpflow.settings import RolloutSettings


class BranchOptions(BaseModel):
    """Options of the ``branch`` plan: none (the siblings are ``[train] group_size`` copies sharing z_0)."""

    model_config = ConfigDict(extra="forbid")


@register("plan", "branch", options=BranchOptions)
class BranchPlan:
    """A pure-ODE path per shared noise with one SDE child per trajectory at every window step; every window step
    trained. Implements ``RolloutPlan``. Options: none."""

    registered_name = "branch"
    per_row_windows = False
    branches = True  # its rollouts' trace columns are branch completions (credit 'branch' reads them)

    def __init__(self, options: BranchOptions | None = None) -> None:
        self.options = options or BranchOptions()

    @staticmethod
    def samples_one_window(options: BranchOptions) -> bool:
        """Its stored steps are one window's, every one trained (each an SDE step from the ODE path)."""
        return True

    @staticmethod
    def check_recipe(options: BranchOptions, settings: dict) -> list[str]:
        """Siblings need one z_0 per group, exact-or-k-step ODE completions, branch credit and a transition
        optimizer."""
        problems, rollout = [], settings["rollout"]
        if not rollout.same_noise:
            problems.append(
                "[rollout] same_noise = false: the branch plan's siblings are the copies of a prompt, which must "
                "share z_0 to branch from one ODE state. Set same_noise = true (and group_size to the number of "
                "children, TempFlow-GRPO: 6)."
            )
        if rollout.completions != "ode":
            problems.append(
                f"[rollout] completions = {rollout.completions!r}: each child is completed by ODE; use 'ode' "
                "(completion_steps = k for cheaper ones)."
            )
        credit = settings["credit"].name
        if not capability(registry.get("credit", credit).factory, "reads_branches"):
            problems.append(
                f"credit {credit!r} reads the trace as one SDE path's completions, but the branch plan's trace "
                'holds each window step\'s own child. Use [credit] name = "branch" (TempFlow-GRPO).'
            )
        return problems + needs_transition_optimizer(settings, "branch", "the branch plan's children are such steps")

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        """One window start per epoch, drawn from (run seed, epoch): the copies of a prompt, which may fall in
        several rollout batches (and processes), are siblings only if all of them branch at the same steps. A
        start per batch (an earlier release) made a group's column i z-score children taken at different σ."""
        rng = derived_rng(run_seed, epoch, "branch")
        window = draw_window(rollout.num_steps, rollout.window_size, rollout.window_range, rng)
        return BatchPlan((window.start,) * n, window.size, branch=True)
