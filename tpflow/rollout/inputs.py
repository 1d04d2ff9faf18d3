"""What every rollout engine starts from, and the start they share: checks, the noise streams, the ODE prefix.

An engine (``tpflow.rollout``'s window, per-row windows, branch and DPM-Solver tail) is built from its own options;
what it samples from is :class:`RolloutInputs` (the model, the conditioning, z_0 and its rows, the σ schedule, the
guidance, the generator, the batch cap). :func:`begin` does what they all do first, in the order that keeps ξ the
same in every arm (docs/algorithm.md §1.6): check the window and the noise rows, count model calls, draw the
independent baseline's seed, then open the main trajectory's ξ stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Backbone
from tpflow.plans.base import Window
from tpflow.rollout.parts import Branch, MainNoise, Velocity, baseline_generator
from tpflow.samplers.euler import euler_step
from tpflow.types import Conditioning, RolloutCost


@dataclass(frozen=True)
class RolloutInputs:
    """What a rollout samples from.

    ``z0`` [P, ...] is the initial noise and ``source`` [N] (host long, default ``arange(P)``) the row of z0 each of
    the N trajectories starts from (``same_noise``: copies of a prompt share a row). ``sigmas`` [K + 1] runs from 1
    to 0. ``generator`` draws ξ (the CPU's global RNG when None); ``max_batch`` caps the rows of one velocity
    call."""

    backbone: Backbone
    cond: Conditioning  # N trajectories
    z0: Tensor  # [P, ...]
    sigmas: Tensor  # [K + 1]
    guidance: float
    source: Tensor | None = None  # [N] long, host
    generator: torch.Generator | None = None
    max_batch: int | None = None

    @property
    def n(self) -> int:
        return len(self.cond)

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1


@dataclass
class Started:
    """The shared start of one rollout: the batched velocity call, the ξ stream, the noise rows."""

    inputs: RolloutInputs
    engine: Velocity
    noise: MainNoise
    fresh: torch.Generator  # the independent baseline's own stream (drawn in every arm)
    source: Tensor  # [N] long on z0's device: each trajectory's noise row
    first: Tensor  # [P] long on z0's device: the first trajectory of each noise row

    def cost(self) -> RolloutCost:
        return RolloutCost(nfe=round(self.engine.rows_evaluated / self.inputs.n, 2), model_s=self.engine.model_s)


def begin(inputs: RolloutInputs, window: Window) -> Started:
    """Check ``window`` and the noise rows, then open the streams (module docstring)."""
    z0 = inputs.z0
    source, first = checked_source(inputs.n, window, inputs.num_steps, z0, inputs.source)
    engine = Velocity(inputs.backbone, inputs.cond, inputs.sigmas, inputs.guidance, inputs.max_batch)
    fresh = baseline_generator(inputs.generator)  # drawn in every arm, so the ξ below are the same in each
    noise = MainNoise(inputs.generator, (inputs.n, *z0.shape[1:]), z0.device)
    return Started(inputs, engine, noise, fresh, source, first)


def checked_source(n: int, window: Window, num_steps: int, z0: Tensor, source: Tensor | None) -> tuple[Tensor, Tensor]:
    """(``source`` [N], ``first`` [P]) on z0's device: the noise row of each trajectory (default: one row each) and
    the first trajectory of each noise row, after checking the window and the indices (every row of z0 used). The
    check reads ``source`` where the caller made it: on the host, as the engines' callers pass it, that costs a GPU
    nothing."""
    if not (window.size >= 1 and 0 <= window.start and window.start + window.size <= num_steps):
        raise ValueError(f"Window {window} does not fit in {num_steps} steps.")
    rows = z0.shape[0]
    source = torch.arange(n, device="cpu") if source is None else source
    trajectories = torch.arange(n, device=source.device)
    first = torch.full((rows,), n, dtype=torch.long, device=source.device)  # [P] n: no trajectory (yet)
    if source.shape == (n,) and n and 0 <= int(source.min()) and int(source.max()) < rows:
        first = first.scatter_reduce(0, source, trajectories, reduce="amin")
    if source.shape != (n,) or int(first.max()) >= n:
        raise ValueError(f"source must be [N] = [{n}] indices into z0's {rows} rows, each row used.")
    return to_device(source, z0.device), to_device(first, z0.device)


def ode_prefix(started: Started, start: int, independent: Branch | None = None) -> Branch:
    """Every noise row by Euler ODE up to the window start (shared by the trajectories of one row), the independent
    baseline riding along; each step's ξ is drawn (and dropped) all the same."""
    engine, sigmas = started.engine, started.inputs.sigmas
    prefix = Branch(started.inputs.z0.clone(), started.first)
    for k in range(start):
        started.noise.draw(k, keep=False)
        live = [prefix] + ([independent] if independent is not None else [])
        for branch, v in zip(live, engine(live, k), strict=True):
            branch.z = euler_step(branch.z, v, sigmas[k], sigmas[k + 1])
    return prefix
