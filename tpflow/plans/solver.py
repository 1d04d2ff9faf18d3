"""The ``dpm-solver`` and ``sa-solver`` plans: the whole trajectory by one multistep solver, final samples only.

Optimizers that train on the epoch's final samples (``consumes = "final_samples"``: NFT, AWM, DGPO) need no SDE
window; their public code samples with a solver of its own. DGPO's code (docs/algorithm.md §10.8) runs diffusers'
``DPMSolverMultistepScheduler`` (DPM-Solver++(2M)) over the whole trajectory with CFG on diffusers' flow-sigmas grid;
AWM's (§10.7) runs SA-Solver's stochastic predictor–corrector on SD3's grid with two edits. These plans put that
in place of the window and the Euler steps (``tpflow.rollout.solver``); the ``[sampler]`` step is not used, and
nothing is stored but the final latents, so an optimizer that trains stored transitions is refused. Nothing is
drawn: every batch's plan is the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.plans.base import BatchPlan, Solver
from tpflow.registry import register
from tpflow.settings import RolloutSettings

GRID = Field(
    "schedule",
    description="σ nodes: the backbone's own K-step schedule, or diffusers' use_flow_sigmas grid "
    "φ(0.999·(1 − j/K)) with shift flow_shift (DGPO's scheduler; not SD3's own grid).",
)
FLOW_SHIFT = Field(3.0, gt=0, le=100, description="The static shift φ of grid = 'flow-sigmas' (DGPO: 3).")


class DpmSolverOptions(BaseModel):
    """Options of the ``dpm-solver`` plan (DPM-Solver++(2M), data prediction, midpoint, last step first order)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    grid: Literal["schedule", "flow-sigmas"] = GRID
    flow_shift: float = FLOW_SHIFT


class SaSolverOptions(BaseModel):
    """Options of the ``sa-solver`` plan; defaults are AWM's code (predictor and corrector order 2, PEC)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    grid: Literal["schedule", "flow-sigmas"] = GRID
    flow_shift: float = FLOW_SHIFT
    first_sigma: float = Field(0.999, gt=0, lt=1, description="σ_0 becomes this (AWM: 1 − 1e-3; λ is −∞ at σ = 1).")
    halve_last: bool = Field(
        True,
        description="σ_{K−1} becomes σ_{K−2}/2 (AWM); the last step returns the data prediction made there.",
    )
    noise_range: tuple[float, float] = Field(
        (0.3, 0.9),
        description="τ = [rollout] noise_level on steps whose destination σ lies in [lo, hi], else 0 (AWM: "
        "0.3, 0.9; noise_level 0.4 GenEval/OCR, 0 PickScore).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SaSolverOptions:
        lo, hi = self.noise_range
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"noise_range must be [lo, hi] with 0 <= lo <= hi <= 1, got {list(self.noise_range)}.")
        return self


def _final_samples_only(settings: dict, plan: str) -> list[str]:
    """The recipe-check sentence of a solver plan under an optimizer that trains stored transitions."""
    optimizer = settings["optimizer"].name
    if capability(registry.get("optimizer", optimizer).factory, "consumes") == "final_samples":
        return []
    return [
        f"[plan] name = {plan!r} samples whole trajectories by a solver and keeps the final samples only, but "
        f"optimizer {optimizer!r} trains stored SDE steps. Use an optimizer that trains on final samples (nft, awm, "
        'dgpo), or [plan] name = "window".'
    ]


@register("plan", "dpm-solver", options=DpmSolverOptions)
class DpmSolverPlan:
    """The whole trajectory by DPM-Solver++(2M) with CFG at the rollout's guidance, final samples only (DGPO's
    rollout). Implements ``RolloutPlan``. Options: grid, flow_shift."""

    registered_name = "dpm-solver"
    per_row_windows = False

    def __init__(self, options: DpmSolverOptions | None = None) -> None:
        self.options = options or DpmSolverOptions()

    @staticmethod
    def samples_one_window(options: DpmSolverOptions) -> bool:
        """Never: no window, no stored step."""
        return False

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        solver = Solver("dpm-solver++", self.options.grid, self.options.flow_shift)
        return BatchPlan((0,) * n, rollout.window_size, solver=solver)  # W: the trace's width, as the window's

    @staticmethod
    def check_recipe(options: DpmSolverOptions, settings: dict) -> list[str]:
        """Final-sample optimizers only; the solver is deterministic, so noise_level must be 0."""
        problems = _final_samples_only(settings, "dpm-solver")
        level = settings["rollout"].noise_level
        if level != 0:
            problems.append(
                f"[plan] name = 'dpm-solver' samples deterministically (DPM-Solver++(2M)), and [rollout] noise_level "
                f"= {level:g} would not be used. Set noise_level = 0, or use [plan] name = 'sa-solver' for noise."
            )
        return problems


@register("plan", "sa-solver", options=SaSolverOptions)
class SaSolverPlan:
    """The whole trajectory by SA-Solver's predictor–corrector (orders 2/2, PEC; τ = noise_level inside
    noise_range), final samples only (AWM's rollout). Implements ``RolloutPlan``. Options: grid, flow_shift,
    first_sigma, halve_last, noise_range."""

    registered_name = "sa-solver"
    per_row_windows = False

    def __init__(self, options: SaSolverOptions | None = None) -> None:
        self.options = options or SaSolverOptions()

    @staticmethod
    def samples_one_window(options: SaSolverOptions) -> bool:
        """Never: no window, no stored step."""
        return False

    def plan(self, rollout: RolloutSettings, n: int, epoch: int, batch_seed: int, run_seed: int) -> BatchPlan:
        o = self.options
        solver = Solver("sa-solver", o.grid, o.flow_shift, o.first_sigma, o.halve_last, o.noise_range)
        return BatchPlan((0,) * n, rollout.window_size, solver=solver)  # W: the trace's width, as the window's

    @staticmethod
    def check_recipe(options: SaSolverOptions, settings: dict) -> list[str]:
        """Final-sample optimizers only; SA-Solver's second order needs K >= 2 steps."""
        problems = _final_samples_only(settings, "sa-solver")
        steps = settings["rollout"].num_steps
        if steps < 2:
            problems.append(
                f"[plan] name = 'sa-solver' needs [rollout] num_steps >= 2 (AWM: 14), got {steps}: its predictor "
                "runs from the second node and the last step returns the prediction made at σ_{K−1}."
            )
        return problems
