"""A recipe's rollout: z_0 as its ``[rollout]`` section draws it, and the engine its rollout plan names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, Protocol

import torch

from tpflow.devices import cpu_generator
from tpflow.interfaces import Backbone, Sampler
from tpflow.plans.base import BatchPlan, Window
from tpflow.rollout.branch import BranchEngine
from tpflow.rollout.inputs import RolloutInputs
from tpflow.rollout.per_row import RowWindowsEngine
from tpflow.rollout.retain import Retain
from tpflow.rollout.reweight import Reweight
from tpflow.rollout.solver import SolverEngine
from tpflow.rollout.tail import DpmTailEngine
from tpflow.rollout.window import Completions, FinalSamplesEngine, WindowEngine
from tpflow.samplers.dpm_solver import compressed_tail, post_window_nodes
from tpflow.settings import RolloutSettings
from tpflow.types import Conditioning, Rollout


class Engine(Protocol):
    """A way of sampling a batch (``tpflow.rollout``): built from its own options, run on the inputs."""

    def run(self, inputs: RolloutInputs) -> Rollout: ...


def engine_for(
    backbone: Backbone,
    sampler: Sampler,
    plan: Window | BatchPlan,
    settings: RolloutSettings,
    completions: Literal["ode", "x0"] | None,
    transitions: bool = True,
    store_means: bool = False,
    retain: Retain | Reweight | None = None,
) -> Engine:
    """The engine a plan names: a whole-trajectory solver (AWM's SA-Solver, DGPO's DPM-Solver++), the branch
    (TempFlow-GRPO), the DPM-Solver tail (MixGRPO-Flash), per-row windows, or the one window, with completions when
    the credit reads them and transitions when the optimizer trains them.
    ``retain`` (a recompute-free update, ``tpflow.rollout.retain`` or ``.reweight``) is the one window's only: the
    GRPO options' recipe check refuses it with any other plan before anything loads."""
    batch_plan = plan if isinstance(plan, BatchPlan) else None
    if batch_plan is not None and batch_plan.solver is not None:  # a whole-trajectory solver: final samples only
        if transitions or completions is not None or retain is not None:
            raise ValueError("a whole-trajectory solver (plans dpm-solver, sa-solver) makes final samples only: "
                             "pass transitions=False, no completions and no retain.")  # fmt: skip
        return SolverEngine(batch_plan.solver, settings.noise_level)
    # one window for the batch, every step trained (a DPM-Solver tail after it or not): what retain runs with grads
    one_window = batch_plan is None or (batch_plan.uniform and batch_plan.trained is None)  # the branch's too
    # reweight back-propagates a trained subset of one window's pairs too (DanceGRPO's trained-fraction)
    subset = batch_plan is not None and batch_plan.trained is not None and isinstance(retain, Reweight) and (
        batch_plan.uniform and not batch_plan.branch and batch_plan.tail_ratio is None)  # fmt: skip
    # and per-row windows (Flow-GRPO-Fast's window-per-image), every step of each row's window trained
    rows = batch_plan is not None and not batch_plan.uniform and isinstance(retain, Reweight) and (
        not batch_plan.branch and batch_plan.tail_ratio is None and batch_plan.trained is None)  # fmt: skip
    if retain is not None and not ((one_window or subset or rows) and transitions):
        raise ValueError("retain runs with the one-window plan's engine only (every stored step trained).")
    window = Window(batch_plan.start, batch_plan.size) if batch_plan is not None else plan
    assert isinstance(window, Window)
    noise_level, steps = (
        settings.noise_level,
        None if settings.completion_steps == "all" else settings.completion_steps,
    )
    store_means = store_means and transitions
    if completions is not None and not transitions:
        raise ValueError("completions need the stored window (transitions=True); pass completions=None.")
    if batch_plan is not None and batch_plan.branch:
        if completions != "ode" or not transitions:
            raise ValueError("the branch plan needs ODE completions and stored transitions (a GRPO optimizer).")
        return BranchEngine(sampler, window, noise_level, steps, store_means, retain, batch_plan.nodes)
    if batch_plan is not None and (batch_plan.tail_ratio is not None or not batch_plan.uniform) and completions:
        raise ValueError("completions need one window for the whole batch and the schedule's Euler steps after it.")
    if batch_plan is not None and batch_plan.tail_ratio is not None:
        tail = _tail(backbone, settings, window, batch_plan.tail_ratio)
        if not batch_plan.uniform:
            raise ValueError("a solver after the window (tail_ratio) needs one window for the batch.")
        return DpmTailEngine(sampler, window, noise_level, tail, store_means, store=transitions, retain=retain)
    if batch_plan is not None and not batch_plan.uniform:
        return RowWindowsEngine(sampler, batch_plan.starts, window.size, noise_level, store_means, store=transitions,
                                retain=retain)  # fmt: skip
    if not transitions:
        return FinalSamplesEngine(sampler, window, noise_level)
    wanted = None
    if completions is not None:
        wanted = Completions(completions, settings.baseline_noise, steps=steps)
    trained = batch_plan.trained if subset else None  # [N, W] host: the pairs reweight back-propagates
    return WindowEngine(sampler, window, noise_level, wanted, store_means, retain, trained)


def rollout_from_settings(
    backbone: Backbone,
    sampler: Sampler,
    cond: Conditioning,
    groups: list[int],
    window: Window | BatchPlan,
    settings: RolloutSettings,
    completions: Literal["ode", "x0"] | None,
    generator: torch.Generator,
    group_seeds: Mapping[int, int] | None = None,
    transitions: bool = True,
    store_means: bool = False,
    retain: Retain | Reweight | None = None,
) -> Rollout:
    """A rollout as a recipe's ``[rollout]`` section asks: draws z_0 (one per group with ``same_noise``, else one
    per trajectory; ``groups`` [N] names each trajectory's prompt group) and runs :func:`engine_for`'s engine.

    With ``same_noise``, ``group_seeds`` (group -> seed) makes a group's z_0 independent of the batch it is in, so
    copies of one prompt in different rollout batches (or processes) still share it; without it, z_0 is drawn from
    ``generator`` per distinct group of this batch. ``transitions`` False keeps the final latents only (an
    optimizer that consumes final samples). ``window`` is one window for the batch, or a rollout plan's
    ``BatchPlan`` (per-row starts and the trained steps, which the returned ``Rollout.trained`` carries; its ``[N, W]``
    mask moves to the rollout's device). ``store_means`` keeps the window's transition means (``Rollout.means``);
    ``retain`` the first window steps' differentiable log-probabilities or their gradients (``Rollout.retained``)."""
    plan = window if isinstance(window, BatchPlan) else None
    if settings.same_noise:
        unique = sorted(set(groups))
        if group_seeds is not None:
            z0 = torch.cat([backbone.initial_noise(1, cpu_generator(group_seeds[g])) for g in unique])
        else:
            z0 = backbone.initial_noise(len(unique), generator)
        source = torch.tensor([unique.index(g) for g in groups], device="cpu")  # host: checked there, then moved
    else:
        z0, source = backbone.initial_noise(len(groups), generator), None
    engine = engine_for(backbone, sampler, window, settings, completions, transitions, store_means, retain)
    sigmas = backbone.sigmas(settings.num_steps)
    out = engine.run(
        RolloutInputs(backbone, cond, z0, sigmas, settings.guidance, source, generator, settings.max_batch)
    )
    if plan is None or plan.trained is None or not transitions:
        return out
    return dataclasses.replace(out, trained=plan.trained.to(out.device))


def _tail(backbone: Backbone, settings: RolloutSettings, window: Window, tail_ratio: float) -> list[float]:
    """MixGRPO-Flash's σ nodes after the window, on the backbone's own schedule (``compressed_tail``)."""
    num_steps, end = settings.num_steps, window.start + window.size
    nodes = post_window_nodes(num_steps, end, tail_ratio)
    tail = compressed_tail(backbone.sigmas(num_steps * (nodes - 1)), num_steps, end, nodes)
    tail[0] = float(backbone.sigmas(num_steps)[end])  # the latent's own σ, bit for bit
    return tail
