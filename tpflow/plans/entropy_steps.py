"""The ``entropy-steps`` plan: branch only at the high-entropy steps, low-entropy steps merged (E-GRPO).

E-GRPO (Zhang et al., arXiv 2601.00423; docs/algorithm.md §10.11) samples each prompt's shared noise by ODE and,
at a few chosen steps, takes one SDE step per copy from that ODE state and completes it by ODE (TempFlow's branch,
§10.4); a transition is trained with the advantage of its completion over the siblings that share its step. Which
steps: the entropy of an SDE step is that of its Gaussian N(μ, s²I), per latent element ½·log(2πe) + log s, with s
= ε(σ_a)·sqrt(σ_a − σ_b) for flow-sde's ε(σ) = α·sqrt(σ̄/(1 − σ̄)) (σ̄ = σ_1 at σ = 1, the reference's guard): a
closed form of the schedule, no model call. A step whose entropy is below the threshold τ is merged with the next
ones into one SDE step from σ_a to the first σ_b whose step entropy reaches τ.

Here the window starts at the step of largest single-step entropy (``first_step`` overrides it) and holds ``[rollout]
window_size`` consecutive segments, each one step, or a merged run when ``entropy_threshold`` is set; every
segment is trained. The choice is a pure function of the schedule and the options: no draw, so every rollout batch,
process and resumed run branches at the same steps (the siblings of a group may span batches).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.plans.base import BatchPlan, needs_transition_optimizer
from tpflow.registry import register
from tpflow.settings import MAX_STEPS, RolloutSettings

HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)


class EntropyStepsOptions(BaseModel):
    """Options of the ``entropy-steps`` plan; defaults are E-GRPO's public scripts (docs/algorithm.md §10.11)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    entropy_threshold: float | None = Field(
        None,
        description="τ, per-element nats: a segment from σ_a ends at the first σ_b whose SDE step entropy "
        "½·log(2πe) + log(ε(σ_a)·sqrt(σ_a − σ_b)) reaches τ (merging low-entropy steps). None: every segment is one "
        "step (E-GRPO's scripts: eta_step_merge_list all 1).",
    )
    first_step: int | None = Field(
        None,
        ge=0,
        le=MAX_STEPS,
        description="The window's first step; None: the step of largest single-step entropy (step 1 on E-GRPO's "
        "FLUX grid, K = 16, shift 3, its eta_step_list's first).",
    )
    entropy_grid: Literal["linspace", "sd3"] = Field(
        "linspace",
        description="The σ grid the entropies are computed on, which must be the backbone's: 'linspace', "
        "φ(1 − j/K) (E-GRPO's code; FLUX with time_shift); 'sd3', diffusers' FlowMatchEulerDiscreteScheduler (SD3.5, "
        "shapes-dit).",
    )
    grid_shift: float = Field(3.0, gt=0, description="The entropy_grid's static time shift φ (E-GRPO: 3.0).")


def grid_sigmas(grid: str, num_steps: int, shift: float) -> list[float]:
    """[K + 1] σ_0 = 1 > … > σ_K = 0 as float64 Python floats: E-GRPO's ``sd3_time_shift(shift, linspace(1, 0, K +
    1))`` or tpflow's ``sd3_sigmas`` (diffusers')."""
    if grid == "sd3":
        from tpflow.samplers.schedules import sd3_sigmas

        return [float(s) for s in sd3_sigmas(num_steps, shift)]
    return [shift * t / (1 + (shift - 1) * t) for t in (1 - j / num_steps for j in range(num_steps + 1))]


def step_entropy(sigmas: list[float], a: int, b: int, alpha: float) -> float:
    """Per-element entropy of one flow-sde step from σ_a to σ_b: ½·log(2πe) + log(ε(σ_a)·sqrt(σ_a − σ_b))."""
    s, s_next = sigmas[a], sigmas[b]
    s_bar = sigmas[1] if s == 1 else s  # the reference's guard: σ_max = sigmas[1] where σ = 1
    return HALF_LOG_2PI_E + math.log(alpha * math.sqrt(s_bar / (1 - s_bar)) * math.sqrt(s - s_next))


def window_nodes(options: EntropyStepsOptions, num_steps: int, width: int, alpha: float) -> tuple[int, ...] | None:
    """The W + 1 grid indices the window's segments join, or None when W segments do not fit before step K."""
    o = options
    return _nodes(o.entropy_threshold, o.first_step, o.entropy_grid, o.grid_shift, num_steps, width, alpha)


@lru_cache(maxsize=64)
def _nodes(
    tau: float | None, start: int | None, grid: str, shift: float, num_steps: int, width: int, alpha: float
) -> tuple[int, ...] | None:
    sigmas = grid_sigmas(grid, num_steps, shift)
    if start is None:  # the highest single-step entropy (the first such step on a tie)
        start = max(range(num_steps), key=lambda k: (step_entropy(sigmas, k, k + 1, alpha), -k))
    nodes = [start]
    while len(nodes) <= width:
        a = nodes[-1]
        if a >= num_steps:
            return None
        b = a + 1
        while tau is not None and b < num_steps and step_entropy(sigmas, a, b, alpha) < tau:
            b += 1
        nodes.append(b)
    return tuple(nodes)


@register("plan", "entropy-steps", options=EntropyStepsOptions)
class EntropyStepsPlan:
    """Branch at W consecutive segments from the highest-entropy step, low-entropy steps merged into one SDE step
    (module docstring). Implements ``RolloutPlan``. Options: entropy_threshold, first_step, entropy_grid,
    grid_shift."""

    registered_name = "entropy-steps"
    per_row_windows = False
    branches = True  # its rollouts' trace columns are branch completions (credit 'branch' reads them)

    def __init__(self, options: EntropyStepsOptions | None = None) -> None:
        self.options = options or EntropyStepsOptions()

    @staticmethod
    def samples_one_window(options: EntropyStepsOptions) -> bool:
        """One-step segments are the branch plan's window; merged ones are not a window of unit steps."""
        return options.entropy_threshold is None

    @staticmethod
    def check_recipe(options: EntropyStepsOptions, settings: dict) -> list[str]:
        """The branch plan's needs (one z_0 per group, ODE completions, branch credit, a transition optimizer), the
        flow-sde 'eta' step the entropy is of, and W segments before step K."""
        problems, rollout = [], settings["rollout"]
        if not rollout.same_noise:
            problems.append(
                "[rollout] same_noise = false: the entropy-steps plan's siblings are the copies of a prompt, which "
                "must share z_0 to branch from one ODE state. Set same_noise = true (E-GRPO's init_same_noise)."
            )
        if rollout.completions != "ode":
            problems.append(f"[rollout] completions = {rollout.completions!r}: each child is completed by ODE: 'ode'.")
        credit = settings["credit"].name
        if not capability(registry.get("credit", credit).factory, "reads_branches"):
            problems.append(
                f"credit {credit!r} reads the trace as one SDE path's completions, but the entropy-steps plan's trace "
                "holds each segment's own child. Use [credit] name = \"branch\" (E-GRPO's per-step group advantage)."
            )
        sampler = settings["sampler"]
        if sampler.name != "flow-sde" or getattr(sampler.options, "noise_schedule", "eta") != "eta":
            problems.append(
                f"[sampler] {sampler.name!r}: the entropy-steps plan computes each step's entropy from flow-sde's "
                "ε(σ) = α·sqrt(σ/(1 − σ)) (E-GRPO's step). Use [sampler] name = \"flow-sde\" (noise_schedule 'eta')."
            )
        if rollout.noise_level <= 0:
            problems.append("[rollout] noise_level = 0: an ODE step has no entropy to rank. Use E-GRPO's 0.7.")
        elif window_nodes(options, rollout.num_steps, rollout.window_size, rollout.noise_level) is None:
            problems.append(
                f"{rollout.window_size} segments from step {options.first_step or 'of largest entropy'} do not fit "
                f"in K = {rollout.num_steps} steps at entropy_threshold = {options.entropy_threshold}. Lower "
                "[rollout] window_size, first_step or entropy_threshold (E-GRPO: 3 unmerged steps from step 1 of 16)."
            )
        backbone = settings["backbone"]  # a schedule its options give is checked now, before anything loads
        static = capability(registry.get("backbone", backbone.name).factory, "static_sigmas")
        sigmas = static(backbone.options, rollout.num_steps) if static else None  # None: not before building
        problem = grid_problem(options, sigmas) if sigmas is not None else None
        problems += [problem] if problem else []
        return problems + needs_transition_optimizer(settings, "entropy-steps", "its branch children are such steps")

    def schedule_problem(self, sigmas: list[float]) -> str | None:
        """Why ``entropy_grid`` is not the backbone's schedule ``sigmas`` [K + 1], whose steps the plan branches at:
        entropies ranked on another grid choose and merge other steps than the run samples."""
        return grid_problem(self.options, sigmas)

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        """The same segments for every batch (a function of the schedule only; the seeds are not read)."""
        nodes = window_nodes(self.options, rollout.num_steps, rollout.window_size, rollout.noise_level)
        if nodes is None:
            raise ValueError("the entropy-steps window does not fit before step K (its recipe check says so).")
        merged = any(b - a > 1 for a, b in zip(nodes[:-1], nodes[1:], strict=True))
        return BatchPlan((nodes[0],) * n, len(nodes) - 1, branch=True, nodes=nodes if merged else None)


def grid_problem(o: EntropyStepsOptions, sigmas: list[float]) -> str | None:
    """``EntropyStepsPlan.schedule_problem``: at recipe time for a backbone whose schedule its options give
    (capability ``static_sigmas``), else once the backbone is built."""
    grid = grid_sigmas(o.entropy_grid, len(sigmas) - 1, o.grid_shift)
    worst = max(abs(a - b) for a, b in zip(grid, sigmas, strict=True))
    if worst <= 1e-4:
        return None
    shown = ", ".join(f"{s:.3f}" for s in sigmas[:4])
    mine = ", ".join(f"{s:.3f}" for s in grid[:4])
    return (
        f"[plan] entropy-steps ranks the steps' entropies on the grid entropy_grid = {o.entropy_grid!r}, "
        f"grid_shift = {o.grid_shift} (σ = {mine}, …), but the backbone samples on σ = {shown}, … (largest "
        f"difference {worst:.3g}): the steps it would choose and merge are not the steps the run takes. Set "
        "[plan] entropy_grid and grid_shift to the backbone's schedule ('sd3' for SD3.5 and shapes-dit, "
        "'linspace' with the time shift for FLUX), or the backbone's shift to the grid's."
    )
