"""The window engine: one SDE window for the batch, with the ODE completions TP-GRPO scores, batched per step.

TP-GRPO needs, for every trajectory, the reward R_j of the image obtained after j SDE window steps with the rest
completed by ODE, j = 0..W (docs/algorithm.md §3). The reference runs the main trajectory, then each completion branch,
then the baseline, one after another. Here every live latent is at the same noise level σ_k at step k — the main
trajectory, the baseline and every branch started so far — so all of them go through **one** velocity call per step
(split only by ``max_batch``).

NFE per trajectory with s = 0 is the reference's (W + 1)·K − W(W − 1)/2 = 64 for K = 10, W = 9 (Flow-GRPO: K).
With ``reuse_main_velocity`` (the default) it is W fewer, 55: a branch j starts at window step k = s + j from the
main latent z_{s+j}, which the main trajectory evaluates at that very step anyway, so the branch's first Euler step
reuses that velocity instead of recomputing it. The result is the same.

Trajectories that start from the same noise (``source`` maps several of them to one row of ``z0``, the
``same_noise`` option) share their pre-window prefix and their shared-noise baseline: both run once per noise row.

Cheaper completions: with ``Completions.steps = c`` an ODE completion integrates the rest of the schedule in c Euler
steps instead of one per remaining step. Its nodes are c + 1 grid indices spread evenly from its start to K
(:func:`completion_nodes`), so each of its velocity calls still falls on a step of the main schedule and rides in that
step's batched call. c = 1 is the one-step x0 estimate z − σ·v; c ≥ the remaining steps is the exact completion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Backbone, Sampler
from tpflow.plans.base import Window
from tpflow.rollout.inputs import RolloutInputs, Started, begin, ode_prefix
from tpflow.rollout.parts import Branch, MainNoise, Velocity, completion_nodes
from tpflow.rollout.retain import Retain, log_prob_with_grad
from tpflow.rollout.reweight import Reweight
from tpflow.samplers.euler import euler_step
from tpflow.types import Conditioning, Rollout


@dataclass(frozen=True)
class Completions:
    """The completed latents whose rewards form the trace R_0..R_{W-1} (docs/algorithm.md §3).

    ``kind`` "ode" completes every j = 0..W-1 by Euler ODE (exact, or in ``steps`` Euler steps each:
    :func:`completion_nodes`); "x0" takes the one-step estimate z_{s+j} − σ_{s+j}·v from the velocity already
    computed (no extra NFE). ``baseline_noise``: R_0 from the trajectory's own z_0 ("shared", the paper) or from
    fresh noise ("independent", the reference code; always completed exactly), drawn from the baseline's own stream
    (``tpflow.rollout.parts.baseline_generator``). ``reuse_main_velocity`` starts each ODE completion with the main
    trajectory's velocity at the same latent (exact, one evaluation less per completion); False evaluates it again,
    as the reference does."""

    kind: Literal["ode", "x0"] = "ode"
    baseline_noise: Literal["shared", "independent"] = "shared"
    reuse_main_velocity: bool = True
    steps: int | None = None


class WindowEngine:
    """Steps s .. s + W − 1 by the sampler's SDE step, stored for the update; Euler ODE before and after; the
    completions along when asked (:class:`Completions`), every live latent in one velocity call per step.
    ``store_means`` also keeps each window step's transition mean μ_old (``Rollout.means``, GRPO-Guard's
    RatioNorm); ``retain`` runs the main trajectory's first window steps with gradients and keeps their
    differentiable log-probabilities (``Rollout.retained``, ``tpflow.rollout.retain``) or, a :class:`Reweight`,
    back-propagates them at once into per-trajectory gradients (``tpflow.rollout.reweight``)."""

    store = True  # the window's transitions are kept (FinalSamplesEngine: not)

    def __init__(
        self,
        sampler: Sampler,
        window: Window,
        noise_level: float,
        completions: Completions | None = None,
        store_means: bool = False,
        retain: Retain | Reweight | None = None,
        trained: Tensor | None = None,
    ) -> None:
        self.sampler, self.window, self.noise_level = sampler, window, noise_level
        self.completions, self.store_means, self.retain = completions, store_means, retain
        self.trained = trained  # [N, W] host bool: with a Reweight, the pairs it back-propagates (None: all)

    @torch.no_grad()
    def run(self, inputs: RolloutInputs) -> Rollout:
        """Sample the N trajectories of ``inputs``: the Rollout with the W stored transitions, the final latents and
        (with completions) the completed latents [N, W, ...] for j = 0..W-1 (j = W is ``final``)."""
        started, loop, main, independent = self._sample(inputs, inputs.num_steps)
        completed = None if self.completions is None else loop.completed(started.source, independent)
        return self._rollout(started, loop, main, completed)

    def _sample(self, inputs: RolloutInputs, end: int) -> tuple[Started, WindowLoop, Branch, Branch | None]:
        """The prefix, then steps s .. end − 1 (the window, then the ODE tail up to ``end``)."""
        started = begin(inputs, self.window)
        z0, n, c = inputs.z0, inputs.n, self.completions
        independent = None  # the reference's baseline from fresh noise: ODE from step 0, alongside everything else
        if c is not None and c.baseline_noise == "independent":
            fresh = inputs.backbone.initial_noise(n, started.fresh).to(z0.device, z0.dtype)
            independent = Branch(fresh, torch.arange(n, device=z0.device))
        prefix = ode_prefix(started, self.window.start, independent)
        loop = WindowLoop(started.engine, self.sampler, self.window, self.noise_level, c, started.first,
                          store=self.store, means=self.store_means, retain=self.retain,
                          trained=self.trained)  # fmt: skip
        main = Branch(prefix.z[started.source], torch.arange(n, device=z0.device))
        for k in range(self.window.start, end):  # the window, then the ODE tail; completions ride along
            loop.step(main, k, started.noise, independent)
        return started, loop, main, independent

    def _rollout(self, started: Started, loop: WindowLoop, main: Branch, completed: Tensor | None) -> Rollout:
        if not self.store:
            return stored_rollout(started, self.noise_level, main.z)
        s, width, n = self.window.start, self.window.size, started.inputs.n
        parts = [torch.stack(part, dim=1) for part in (loop.latents, loop.next_latents, loop.log_probs)]
        means = torch.stack(loop.means, dim=1) if self.store_means else None
        grid = started.inputs.sigmas[s : s + width + 1].expand(n, width + 1)
        out = stored_rollout(started, self.noise_level, main.z, parts, grid, means, completed)
        if loop.retained is None:
            return out
        return dataclasses.replace(out, retained=loop.retained.stacked())


def stored_rollout(
    started: Started,
    noise_level: float,
    final: Tensor,
    parts: list[Tensor] | None = None,
    grid: Tensor | None = None,
    means: Tensor | None = None,
    completed: Tensor | None = None,
) -> Rollout:
    """The Rollout of an engine: ``parts`` [latents, next_latents, log_probs] [N, W, ...] with their σ ``grid``
    [N, W + 1]; None keeps the final latents [N, ...] only (an empty window, W = 0, σ of the final latent)."""
    inputs = started.inputs
    n, device = inputs.n, inputs.z0.device
    if parts is None:
        empty = final.new_zeros((n, 0, *final.shape[1:]))
        parts = [empty, empty, torch.zeros((n, 0), dtype=torch.float32, device=device)]
        grid = inputs.sigmas[-1:].expand(n, 1)
    assert grid is not None
    return Rollout(
        latents=parts[0],
        next_latents=parts[1],
        log_probs=parts[2],
        sigmas=grid.float().to(device).clone(),
        noise_level=float(noise_level),
        guidance=float(inputs.guidance),
        cond=inputs.cond,
        final=final,
        completions=completed,
        cost=started.cost(),
        means=means,
    )


class FinalSamplesEngine(WindowEngine):
    """The window engine's trajectory without storing it: an optimizer that consumes final samples
    (``Optimizer.consumes``). The stored window is empty (W = 0 in ``latents``, ``next_latents``, ``log_probs``)."""

    store = False

    def __init__(self, sampler: Sampler, window: Window, noise_level: float) -> None:
        super().__init__(sampler, window, noise_level)


class WindowLoop:
    """Steps k ≥ s of the main trajectory: SDE steps inside the window (stored for the update), a completion branch
    started at each (or an x0 estimate), Euler after it; every live ODE branch advances in the same call."""

    def __init__(
        self,
        engine: Velocity,
        sampler: Sampler,
        window: Window,
        noise_level: float,
        completions: Completions | None,
        first: Tensor,
        store: bool = True,
        means: bool = False,
        retain: Retain | Reweight | None = None,
        trained: Tensor | None = None,
    ) -> None:
        self.engine, self.sampler, self.window, self.noise_level = engine, sampler, window, noise_level
        self.completions, self.first = completions, first  # first: [P] the first trajectory of each noise row
        self.branches: list[Branch] = []  # ODE branches: the baseline (j = 0) first, then completions j = 1..W-1
        self.estimates: list[Tensor] = []  # x0 mode: [n, ...] per j
        self.latents: list[Tensor] = []
        self.next_latents: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.store = store  # keep the window's transitions (False: final samples only)
        self.store_means = means  # keep each window step's transition mean μ_old too
        self.means: list[Tensor] = []
        self.last_x0: Tensor | None = None  # [N, ...] float32 x̂_0 of the last window step
        # the steps run with gradients: their graphs kept ("retain") or back-propagated at once ("reweight")
        self.retained = None if retain is None or not store else retain.log(engine.backbone, engine, window.size)
        self.trained = trained  # [N, W] host bool: the pairs run with gradients (None: every row of a covered step)

    def step(self, main: Branch, k: int, noise: MainNoise, independent: Branch | None) -> None:
        others = [b for b in self.branches if b.live(k)] + ([independent] if independent is not None else [])
        s = self.window.start
        inside = s <= k < s + self.window.size
        retained = self.retained is not None and inside and self.retained.covers(k - s)
        rows = None if not retained or self.trained is None else self.trained[:, k - s]  # [N] host bool, or None
        if rows is not None and not rows.any():  # no trajectory trains this step
            self.retained.skip(main.z.shape[0])
            retained, rows = False, None
        if retained:  # the main trajectory's (trained rows) with gradients, in a call of their own; the rest without
            assert self.retained is not None
            graded, vs = graded_velocities(self.engine, self.retained, main, others, k, rows)
        else:
            vs = self.engine([main, *others], k)
        sigma, sigma_next = self.engine.sigmas[k], self.engine.sigmas[k + 1]
        for branch, v in zip(others, vs[1:], strict=True):
            self._advance(branch, v, k)
        v_main = vs[0]
        xi = noise.draw(k, keep=inside)  # ξ_k is drawn at every step, kept inside the window only
        if not inside:
            main.z = euler_step(main.z, v_main, sigma, sigma_next)
            return
        if k == s + self.window.size - 1:  # the last window step's x̂_0: a post-window solver's history
            self.last_x0 = main.z.float() - float(sigma) * v_main.float()
        self._start_completion(main, v_main, k - s, k, sigma)
        out = self.sampler.step(main.z, v_main, sigma, sigma_next, self.noise_level, noise=xi)
        if retained:
            assert self.retained is not None
            pick, v_grad = graded
            prev, z = (out.prev, main.z) if pick is None else (out.prev[pick], main.z[pick])
            self.retained.keep(log_prob_with_grad(self.sampler, prev, z, v_grad, sigma, sigma_next,
                                                  self.noise_level), main.z.shape[0], pick)  # fmt: skip
        if self.store:
            self.latents.append(main.z)
            self.next_latents.append(out.prev)
            self.log_probs.append(out.log_prob)
            if self.store_means:
                self.means.append(out.mean)
        main.z = out.prev

    def _start_completion(self, main: Branch, v_main: Tensor, j: int, k: int, sigma: Tensor) -> None:
        """Completion j from the main latent z_{s+j}: an x0 estimate, or an ODE branch whose first step is taken."""
        c = self.completions
        if c is None:
            return
        shared = c.baseline_noise == "shared"
        if c.kind == "x0":
            pick = self.first if j == 0 and shared else slice(None)
            self.estimates.append((main.z[pick].float() - sigma * v_main[pick].float()).to(main.z.dtype))
        elif j > 0 or shared:
            pick = self.first if j == 0 else torch.arange(main.z.shape[0], device=main.z.device)
            num_steps = self.engine.sigmas.shape[0] - 1
            branch = Branch(main.z[pick], pick, completion_nodes(k, num_steps, c.steps), at=k)
            v_branch = v_main[pick] if c.reuse_main_velocity else self.engine([branch], k)[0]
            self._advance(branch, v_branch, k)
            self.branches.append(branch)

    def _advance(self, branch: Branch, v: Tensor, k: int) -> None:
        """One Euler step of an ODE branch from σ_k to its next node's σ (σ_{k+1} for an every-step branch)."""
        nxt = branch.target(k)
        branch.z = euler_step(branch.z, v, self.engine.sigmas[k], self.engine.sigmas[nxt])
        branch.at = nxt

    def completed(self, source: Tensor, independent: Branch | None) -> Tensor:
        """The completed latents [N, W, ...], j = 0..W-1 (j = W is the final image)."""
        assert self.completions is not None
        ode = self.completions.kind == "ode"
        ends = [b.z for b in self.branches] if ode else self.estimates
        if independent is not None:
            ends = [independent.z, *ends] if ode else [independent.z, *ends[1:]]
        elif self.completions.baseline_noise == "shared":
            ends = [ends[0][source], *ends[1:]]  # the baseline ran once per noise row
        return torch.stack(ends, dim=1)


def graded_velocities(engine: Velocity, log, main: Branch, others: list[Branch], k: int, rows: Tensor | None) -> tuple:
    """Step k's velocities [main, *others] with the main trajectory's ``rows`` ([N] host bool; None: all) run with
    gradients in a call of their own (``log``: a retain or reweight record), the rest in one call without; and
    (their device indices or None, that differentiable velocity)."""
    n = main.z.shape[0]
    if rows is None or bool(rows.all()):
        v_grad = log.velocity(lambda: engine([main], k)[0], n)
        return (None, v_grad), [v_grad.detach(), *(engine(others, k) if others else [])]
    pick, rest = (to_device(r.nonzero().squeeze(1), main.z.device) for r in (rows, ~rows))  # [P], [N − P]
    trained = Branch(main.z[pick], main.rows[pick])
    v_grad = log.velocity(lambda: engine([trained], k)[0], len(pick))
    v_rest, *vs = engine([Branch(main.z[rest], main.rows[rest]), *others], k)
    v_main = v_rest.new_empty((n, *v_rest.shape[1:]))
    v_main[pick], v_main[rest] = v_grad.detach().to(v_main.dtype), v_rest
    return (pick, v_grad), [v_main, *vs]


@torch.no_grad()
def rollout(
    backbone: Backbone,
    sampler: Sampler,
    cond: Conditioning,
    z0: Tensor,
    sigmas: Tensor,
    window: Window,
    noise_level: float,
    guidance: float,
    completions: Literal["ode", "x0"] | None = "ode",
    baseline_noise: Literal["shared", "independent"] = "shared",
    source: Tensor | None = None,
    generator: torch.Generator | None = None,
    max_batch: int | None = None,
    reuse_main_velocity: bool = True,
    completion_steps: int | None = None,
    transitions: bool = True,
    store_means: bool = False,
) -> Rollout:
    """The window engine in one call (:class:`WindowEngine`, :class:`FinalSamplesEngine` when ``transitions`` is
    False; the arguments as :class:`RolloutInputs` and :class:`Completions` name them, ``completions`` None for
    none). Per-row windows, the branch and the DPM-Solver tail are engines of their own (``tpflow.rollout``)."""
    inputs = RolloutInputs(backbone, cond, z0, sigmas, guidance, source, generator, max_batch)
    if not transitions:
        if completions is not None:
            raise ValueError("completions need the stored window (transitions=True); pass completions=None.")
        return FinalSamplesEngine(sampler, window, noise_level).run(inputs)
    wanted = None
    if completions is not None:
        wanted = Completions(completions, baseline_noise, reuse_main_velocity, completion_steps)
    return WindowEngine(sampler, window, noise_level, wanted, store_means).run(inputs)
