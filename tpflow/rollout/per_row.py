"""Per-row windows: trajectory n is SDE on its own steps s_n .. s_n + W − 1 and Euler elsewhere (Flow-GRPO-Fast's
per-image windows, MixGRPO's schedule across a mixed batch, ``tpflow.plans``), every row still in one velocity call
per step. Completions need one window for the batch, so this engine has none."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Sampler
from tpflow.plans.base import Window
from tpflow.rollout.inputs import RolloutInputs, begin, ode_prefix
from tpflow.rollout.parts import Branch, MainNoise, Velocity
from tpflow.rollout.retain import log_prob_with_grad
from tpflow.rollout.reweight import Reweight
from tpflow.rollout.window import FinalSamplesEngine, WindowEngine, graded_velocities, stored_rollout
from tpflow.samplers.euler import euler_step
from tpflow.types import Rollout


class RowWindowsEngine:
    """``starts`` [N] window starts, one per trajectory, each window of ``size`` steps; the stored steps and
    ``sigmas`` of row n are its own window's. Equal starts are the one window (:class:`WindowEngine`), bitwise.
    ``store`` False keeps the final latents only (an optimizer that consumes final samples)."""

    def __init__(
        self,
        sampler: Sampler,
        starts: Sequence[int],
        size: int,
        noise_level: float,
        store_means: bool = False,
        store: bool = True,
        retain: Reweight | None = None,
    ) -> None:
        self.sampler, self.starts, self.size = sampler, tuple(int(a) for a in starts), size
        self.noise_level, self.store_means, self.store = noise_level, store_means and store, store
        self.retain = retain if store else None  # reweight: each row's window steps back-propagated as sampled

    @torch.no_grad()
    def run(self, inputs: RolloutInputs) -> Rollout:
        window, n, num_steps = Window(min(self.starts), self.size), inputs.n, inputs.num_steps
        if len(self.starts) != n or max(self.starts) + self.size > num_steps:
            raise ValueError(
                f"starts must be N = {n} window starts whose windows of {self.size} steps fit in {num_steps}; got "
                f"{list(self.starts)}."
            )
        if len(set(self.starts)) == 1:  # the one window
            if not self.store:
                return FinalSamplesEngine(self.sampler, window, self.noise_level).run(inputs)
            return WindowEngine(self.sampler, window, self.noise_level, store_means=self.store_means,
                                retain=self.retain).run(inputs)  # fmt: skip
        started = begin(inputs, window)
        starts = torch.tensor(self.starts, dtype=torch.long, device="cpu")  # [N] host bookkeeping (tpflow.devices)
        prefix = ode_prefix(started, window.start)
        main = Branch(prefix.z[started.source], torch.arange(n, device=inputs.z0.device))
        loop = RowWindowsLoop(started.engine, self.sampler, starts, self.size, self.noise_level, self.store_means,
                              self.store, self.retain)  # fmt: skip
        for k in range(window.start, num_steps):
            loop.step(main, k, started.noise)
        if not self.store:
            return stored_rollout(started, self.noise_level, main.z)
        parts, means = loop.gathered()
        grid = torch.stack([inputs.sigmas[a : a + self.size + 1] for a in self.starts])  # [N, W + 1]
        out = stored_rollout(started, self.noise_level, main.z, parts, grid, means)
        return out if loop.log is None else dataclasses.replace(out, retained=loop.log.stacked())


class RowWindowsLoop:
    """Steps k ≥ min s_n: rows inside their window take the SDE step, the others the Euler step, both from the one
    velocity call (each row's values are those of a batch with its window for all)."""

    def __init__(
        self, engine: Velocity, sampler: Sampler, starts: Tensor, size: int, noise_level: float, means: bool,
        store: bool = True, retain: Reweight | None = None,
    ) -> None:  # fmt: skip
        self.engine, self.sampler, self.starts, self.size = engine, sampler, starts, size
        self.noise_level, self.store_means, self.store = noise_level, means, store
        self.taken: dict[int, tuple[Tensor, Tensor, Tensor, Tensor | None]] = {}  # k -> (z, z', ℓ, μ)
        self.log = None if retain is None else retain.log(engine.backbone, engine, size)

    def step(self, main: Branch, k: int, noise: MainNoise) -> None:
        inside = (self.starts <= k) & (k < self.starts + self.size)  # [N] host bool
        graded = None
        if self.log is not None and bool((inside & (k - self.starts < self.log.steps)).any()):
            rows = inside & (k - self.starts < self.log.steps)  # [N] host: the rows whose kept window step this is
            graded, (v_main,) = graded_velocities(self.engine, self.log, main, [], k, rows)
        else:
            (v_main,) = self.engine([main], k)
        xi = noise.draw(k, keep=bool(inside.any()))  # ξ_k drawn at every step, as with one window
        sigma, sigma_next = self.engine.sigmas[k], self.engine.sigmas[k + 1]
        ode = euler_step(main.z, v_main, sigma, sigma_next)
        if xi is None:
            main.z = ode
            return
        out = self.sampler.step(main.z, v_main, sigma, sigma_next, self.noise_level, noise=xi)
        on = to_device(inside, main.z.device).reshape(-1, *([1] * (main.z.dim() - 1)))
        prev = torch.where(on, out.prev, ode)
        if graded is not None:  # the kept rows' log-probabilities of their sampled step, back-propagated now
            pick, v_grad = graded
            pick = to_device(torch.arange(len(inside), device="cpu"), main.z.device) if pick is None else pick
            positions = to_device(k - self.starts, main.z.device)[pick]  # [P] each row's window step
            self.log.keep(log_prob_with_grad(self.sampler, out.prev[pick], main.z[pick], v_grad, sigma, sigma_next,
                                             self.noise_level), len(inside), pick, positions)  # fmt: skip
        if self.store:
            self.taken[k] = (main.z, prev, out.log_prob, out.mean if self.store_means else None)  # μ: RatioNorm
        main.z = prev

    def gathered(self) -> tuple[list[Tensor], Tensor | None]:
        """Each row's own W window steps from the steps taken: ([latents, next_latents, log_probs] [N, W, ...],
        means [N, W, ...] or None)."""
        steps = sorted(self.taken)
        rows = torch.arange(self.starts.shape[0], device="cpu")
        picks = [[steps.index(int(a) + i) for i in range(self.size)] for a in self.starts.tolist()]
        at = torch.tensor(picks, dtype=torch.long, device="cpu")  # [N, W] position of each row's step in `steps`
        parts = []
        for field in range(4 if self.store_means else 3):
            taken = torch.stack([self.taken[k][field] for k in steps])  # [len(steps), N, ...]
            index = (at.to(taken.device), rows.to(taken.device)[:, None])
            parts.append(taken[index])  # [N, W, ...]
        return parts[:3], parts[3] if self.store_means else None
