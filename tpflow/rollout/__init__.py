"""The rollout engines: one per way of sampling a batch, on one shared step loop.

Every engine runs the same loop (``tpflow.rollout.inputs``, ``tpflow.rollout.parts``): the N trajectories' latents
and every branch alive at step k go through one velocity call per step (split only by ``max_batch``), on the σ
schedule, with the main trajectory's noise ξ drawn on the CPU generator. What differs is what an engine samples and
stores, and each takes only its own options:

- :class:`WindowEngine`: one SDE window for the batch, the rest Euler ODE, with TP-GRPO's ODE completions when the
  credit reads them (:class:`Completions`); :class:`FinalSamplesEngine` the same trajectory, nothing stored (an
  optimizer that consumes final samples); :func:`rollout` both in one call.
- :class:`RowWindowsEngine`: a window per trajectory (Flow-GRPO-Fast, MixGRPO across a mixed batch).
- :class:`BranchEngine`: TempFlow-GRPO's branching from the ODE path.
- :class:`DpmTailEngine`: MixGRPO-Flash's DPM-Solver++(2M) after the window.
- :class:`SolverEngine`: a whole trajectory by DPM-Solver++(2M) or SA-Solver, final samples only (DGPO's and AWM's
  rollouts).

A rollout plan (``tpflow.plans``) names its engine through its ``BatchPlan``; :func:`engine_for` builds it and
:func:`rollout_from_settings` runs it as a recipe's ``[rollout]`` section asks.

Noise (docs/algorithm.md §1.6): the generator's first draw seeds the independent baseline's own CPU generator
(:func:`baseline_generator`, drawn whatever the engine); then the main trajectory takes one ξ of shape [N, ...] per
generation step k = 0..K-1, in order, whether or not step k is in the window (outside it the draw is discarded). So
ξ_k depends on the generator's state at the call and on k only, not on the window, the baseline, the completions or
their steps: arms that differ in those are paired on ξ.
"""

from tpflow.plans.base import Window, draw_window
from tpflow.rollout.branch import BranchEngine
from tpflow.rollout.from_settings import Engine, engine_for, rollout_from_settings
from tpflow.rollout.inputs import RolloutInputs
from tpflow.rollout.ode import eval_solver, sample_ode
from tpflow.rollout.parts import baseline_generator, completion_nodes
from tpflow.rollout.per_row import RowWindowsEngine
from tpflow.rollout.solver import SolverEngine
from tpflow.rollout.tail import DpmTailEngine
from tpflow.rollout.window import Completions, FinalSamplesEngine, WindowEngine, rollout

__all__ = [
    "BranchEngine",
    "Completions",
    "DpmTailEngine",
    "Engine",
    "FinalSamplesEngine",
    "RolloutInputs",
    "RowWindowsEngine",
    "SolverEngine",
    "Window",
    "WindowEngine",
    "baseline_generator",
    "completion_nodes",
    "draw_window",
    "engine_for",
    "rollout",
    "rollout_from_settings",
    "eval_solver",
    "sample_ode",
]
