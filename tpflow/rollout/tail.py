"""MixGRPO-Flash's rollout (docs/algorithm.md §10.5): the SDE window, then DPM-Solver++(2M) over the post-window σ
nodes instead of the schedule's Euler steps, its history seeded with the last window step's x̂_0."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tpflow.interfaces import Sampler
from tpflow.plans.base import Window
from tpflow.rollout.inputs import RolloutInputs
from tpflow.rollout.parts import Branch, Velocity
from tpflow.rollout.retain import Retain
from tpflow.rollout.reweight import Reweight
from tpflow.rollout.window import WindowEngine
from tpflow.samplers.dpm_solver import dpm_solver_2m_step
from tpflow.types import Rollout


class DpmTailEngine(WindowEngine):
    """The window engine (no completions) up to the window's end e = s + W, then DPM-Solver++(2M) over
    ``tail_sigmas`` (σ_e strictly down to 0). ``store`` False keeps the final latents only. ``retain``: the window
    steps run with gradients as the window engine runs them (a recompute-free update; the tail has none)."""

    def __init__(
        self,
        sampler: Sampler,
        window: Window,
        noise_level: float,
        tail_sigmas: Sequence[float],
        store_means: bool = False,
        store: bool = True,
        retain: Retain | Reweight | None = None,
    ) -> None:
        super().__init__(sampler, window, noise_level, None, store_means and store, retain if store else None)
        self.tail_sigmas = [float(x) for x in tail_sigmas]
        self.store = store

    @torch.no_grad()
    def run(self, inputs: RolloutInputs) -> Rollout:
        end = self.window.start + self.window.size
        nodes = checked_tail(self.tail_sigmas, inputs.sigmas, end)
        started, loop, main, _ = self._sample(inputs, end)
        assert loop.last_x0 is not None
        main.z = dpm_tail(started.engine, main, loop.last_x0, float(inputs.sigmas[end - 1]), nodes)
        return self._rollout(started, loop, main, None)


def checked_tail(nodes: list[float], sigmas: Tensor, end: int) -> list[float]:
    """The post-window σ nodes, checked: from σ_end (the window's end) strictly down to 0."""
    if (
        len(nodes) < 2
        or nodes[0] != float(sigmas[end])
        or nodes[-1] != 0
        or any(a <= b for a, b in zip(nodes, nodes[1:], strict=False))
    ):
        raise ValueError(f"tail_sigmas must run strictly down from σ_{end} = {float(sigmas[end])} to 0; got {nodes}.")
    return nodes


def dpm_tail(engine: Velocity, main: Branch, last_x0: Tensor, last_sigma: float, nodes: list[float]) -> Tensor:
    """DPM-Solver++(2M) from nodes[0] (the window's end) to 0, one velocity call per node but the last; the first
    step is second order with the last window step's x̂_0 (at σ = ``last_sigma``) as its history."""
    z, x0_prev, sigma_prev = main.z, last_x0, last_sigma
    for sigma, sigma_next in zip(nodes, nodes[1:], strict=False):
        (v,) = engine.at([main], sigma)
        x0 = z.float() - sigma * v.float()
        z = dpm_solver_2m_step(z, x0, sigma, sigma_next, x0_prev, sigma_prev)
        main.z, x0_prev, sigma_prev = z, x0, sigma
    return z
