"""The rollout engine: the main trajectory, the ODE baseline and the ODE completions, batched per step.

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

Cheaper completions: with ``completion_steps = c`` an ODE completion integrates the rest of the schedule in c Euler
steps instead of one per remaining step. Its nodes are c + 1 grid indices spread evenly from its start to K
(:func:`completion_nodes`), so each of its velocity calls still falls on a step of the main schedule and rides in that
step's batched call. c = 1 is the one-step x0 estimate z − σ·v; c ≥ the remaining steps is the exact completion.

Noise (docs/algorithm.md §1.6): the generator's first draw seeds the independent baseline's own CPU generator
(:func:`baseline_generator`, drawn whatever ``baseline_noise`` is); then the main trajectory takes one ξ of shape
[N, ...] per generation step k = 0..K-1, in order, whether or not step k is in the window (outside it the draw is
discarded). So ξ_k depends on the generator's state at the call and on k only, not on the window, the baseline, the
completions or ``completion_steps``: arms that differ in those are paired on ξ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from tpflow.devices import cpu_generator, to_device
from tpflow.interfaces import Backbone, Sampler
from tpflow.plans.base import BatchPlan, Window, draw_window  # noqa: F401 (Window, draw_window: tpflow.rollout names)
from tpflow.rollout_branch import branched_rollout
from tpflow.rollout_parts import (  # baseline_generator, completion_nodes: also tpflow.rollout names
    Branch,
    MainNoise,
    Velocity,
    baseline_generator,
    completion_nodes,
)
from tpflow.rollout_tail import checked_tail, dpm_tail
from tpflow.samplers.dpm_solver import compressed_tail, post_window_nodes
from tpflow.samplers.euler import euler_step
from tpflow.settings import RolloutSettings
from tpflow.types import Conditioning, Rollout, RolloutCost


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
    starts: Sequence[int] | None = None,
    store_means: bool = False,
    branch: bool = False,
    tail_sigmas: Sequence[float] | None = None,
) -> Rollout:
    """Sample N trajectories and, when asked, the latents whose rewards form the trace R_0..R_{W-1}.

    Args:
        backbone: gives ``velocity`` (guidance applied inside) and ``initial_noise``.
        sampler: the SDE step used inside the window; outside it the Euler ODE step is used.
        cond: conditioning of the N trajectories.
        z0: [P, ...] initial noise; row ``source[n]`` starts trajectory n.
        sigmas: [K + 1] schedule, σ_0 = 1 .. σ_K = 0.
        window: the SDE window (start s, size W), s + W <= K.
        noise_level: α inside the window.
        guidance: passed to ``backbone.velocity``.
        completions: "ode" completes every j = 0..W-1 by Euler ODE (exact); "x0" takes the one-step estimate
            z_{s+j} − σ_{s+j}·v from the velocity already computed (no extra NFE); None computes neither (outcome
            credit needs only R_W).
        baseline_noise: R_0 from the trajectory's own z_0 ("shared", the paper) or from fresh noise
            ("independent", the reference code; always completed by ODE), drawn from :func:`baseline_generator`,
            a stream apart from the main trajectory's ξ.
        source: [N] long index into z0 (default: z0 has N rows, one per trajectory).
        generator: RNG of the SDE noise ξ, one [N, ...] draw per step k = 0..K-1 whatever the window (module
            docstring), after one draw that seeds :func:`baseline_generator`; the CPU's global RNG when None.
        max_batch: the largest number of rows in one velocity call.
        reuse_main_velocity: start each ODE branch with the main trajectory's velocity at the same latent (exact,
            one evaluation less per branch); False evaluates it again, as the reference does.
        completion_steps: with ``completions="ode"``, the Euler steps of each completion (the shared baseline
            included; :func:`completion_nodes`); None: one per remaining step (exact). The independent baseline is
            always completed exactly.
        transitions: store the window's transitions and log-probs (an optimizer that consumes transitions); False
            keeps the final latents only (one that consumes final samples, ``Optimizer.consumes``): the trajectory is
            the same, the stored window is empty (W = 0 in ``latents``, ``next_latents``, ``log_probs``), and
            ``completions`` must be None.
        starts: [N] per-trajectory window starts (a rollout plan's, ``tpflow.plans``), each s_n + W <= K, their
            minimum ``window.start``: trajectory n is SDE on steps s_n .. s_n + W - 1 and Euler elsewhere, every row
            still in one velocity call per step, and its stored steps and ``sigmas`` are its own window's. Needs
            ``completions`` None. None (or equal starts) is the one window ``window``, bitwise.
        store_means: also store each window step's transition mean μ_old (``Rollout.means``, for GRPO-Guard's
            RatioNorm).
        branch: branch at every window step instead of following one SDE path (TempFlow-GRPO, :class:`_BranchLoop`):
            the main path of each noise row is pure ODE; at window step s + i every trajectory n takes one SDE step
            from its noise row's ODE state with its own ξ, stored as transition i, and that child is ODE-completed
            (``completion_steps`` as for completions) into ``completions[:, i]``; ``final`` is the ODE image. Needs
            ``completions="ode"`` and one window for the batch.
        tail_sigmas: after the window, DPM-Solver++(2M) over these σ nodes (from σ_{s+W} down to 0) instead of the
            Euler steps of the schedule (MixGRPO-Flash, ``tpflow.samplers.dpm_solver``), its history seeded with the
            last window step's x̂_0 = z − σ·v. Needs ``completions`` None and one window.

    Returns:
        Rollout with the W stored transitions (none without ``transitions``), the final latents and (unless
        ``completions`` is None) the completed latents [N, W, ...] for j = 0..W-1 (j = W is ``final``).
    """
    n = len(cond)
    num_steps = sigmas.shape[0] - 1
    s, width = window.start, window.size
    source, first = _checked_source(n, window, num_steps, z0, source, ok=transitions or completions is None)
    row_starts = _checked_starts(starts, n, window, num_steps, completions)  # [N] host long, or None: one window
    engine = Velocity(backbone, cond, sigmas, guidance, max_batch)
    fresh_generator = baseline_generator(generator)  # drawn in every arm, so the ξ below are the same in each
    noise = MainNoise(generator, (n, *z0.shape[1:]), z0.device)
    independent = None  # the reference's baseline from fresh noise: ODE from step 0, alongside everything else
    if completions is not None and baseline_noise == "independent":
        fresh = backbone.initial_noise(n, fresh_generator).to(z0.device, z0.dtype)
        independent = Branch(fresh, torch.arange(n, device=z0.device))
    prefix = _prefix(engine, Branch(z0.clone(), first), independent, noise, s)
    if branch:
        return branched_rollout(engine, sampler, prefix, noise, source, window, noise_level, completion_steps,
                                store_means, guidance, cond, completions, row_starts)  # fmt: skip
    loop = _WindowLoop(engine, sampler, window, noise_level, completions, baseline_noise, first, reuse_main_velocity,
                       steps=completion_steps, store=transitions, starts=row_starts, means=store_means)  # fmt: skip
    main = Branch(prefix.z[source], torch.arange(n, device=z0.device))
    tail = checked_tail(tail_sigmas, sigmas, s + width, completions, row_starts)
    for k in range(s, num_steps if tail is None else s + width):  # the window, then the ODE tail; branches ride along
        loop.step(main, k, noise, independent)
    if tail is not None:  # a solver of its own after the window, on its own nodes
        main.z = dpm_tail(engine, main, loop.last_x0, float(sigmas[s + width - 1]), tail)
    completed = None if completions is None else loop.completed(source, independent)  # [N, W, ...]
    means = None
    if transitions and row_starts is not None:  # each row's own window steps, gathered from the steps taken
        stored, means = loop.gathered(row_starts)
        grid = torch.stack([sigmas[a : a + width + 1] for a in row_starts.tolist()])  # [N, W + 1]
    elif transitions:
        stored = [torch.stack(part, dim=1) for part in (loop.latents, loop.next_latents, loop.log_probs)]
        means = torch.stack(loop.means, dim=1) if store_means else None
        grid = sigmas[s : s + width + 1].expand(n, width + 1)
    else:  # final samples only: an empty window (W = 0), σ of the final latent
        empty = main.z.new_zeros((n, 0, *main.z.shape[1:]))
        stored, grid = [empty, empty, torch.zeros((n, 0), dtype=torch.float32, device=z0.device)], sigmas[-1:]
        grid = grid.expand(n, 1)
    return Rollout(
        latents=stored[0],
        next_latents=stored[1],
        log_probs=stored[2],
        sigmas=grid.float().to(z0.device).clone(),
        noise_level=float(noise_level),
        guidance=float(guidance),
        cond=cond,
        final=main.z,
        completions=completed,
        cost=RolloutCost(nfe=round(engine.rows_evaluated / n, 2), model_s=engine.model_s),
        means=means,
    )


def _checked_source(
    n: int, window: Window, num_steps: int, z0: Tensor, source: Tensor | None, ok: bool
) -> tuple[Tensor, Tensor]:
    """(``source`` [N], ``first`` [P]) on z0's device: the noise row of each trajectory (default: one row each) and
    the first trajectory of each noise row, after checking the window, the indices (every row of z0 used) and that
    completions come with stored transitions (``ok``). The check reads ``source`` where the caller made it: on the
    host, as the engine's callers pass it, that costs a GPU nothing."""
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
    if not ok:
        raise ValueError("completions need the stored window (transitions=True); pass completions=None.")
    return to_device(source, z0.device), to_device(first, z0.device)


def _checked_starts(
    starts: Sequence[int] | None, n: int, window: Window, num_steps: int, completions: str | None
) -> Tensor | None:
    """Per-row window starts [N] on the host (None when there are none or all are equal: the one window)."""
    if starts is None or len(set(starts)) == 1 and (len(starts) == n and starts[0] == window.start):
        return None
    if len(starts) != n or min(starts) != window.start or max(starts) + window.size > num_steps:
        raise ValueError(
            f"starts must be N = {n} window starts whose minimum is window.start = {window.start} and whose "
            f"windows of {window.size} steps fit in {num_steps}; got {list(starts)}."
        )
    if completions is not None:
        raise ValueError("completions need one window for the whole batch; per-row starts take completions=None.")
    return torch.tensor(list(starts), dtype=torch.long, device="cpu")  # host bookkeeping (tpflow.devices)


def _prefix(engine: Velocity, prefix: Branch, independent: Branch | None, noise: MainNoise, s: int) -> Branch:
    """Every noise row by Euler ODE up to the window start s (shared by the trajectories of one row), the
    independent baseline riding along; each step's ξ is drawn (and dropped) all the same."""
    sigmas = engine.sigmas
    for k in range(s):
        noise.draw(k, keep=False)
        live = [prefix] + ([independent] if independent is not None else [])
        for branch, v in zip(live, engine(live, k), strict=True):
            branch.z = euler_step(branch.z, v, sigmas[k], sigmas[k + 1])
    return prefix


class _WindowLoop:
    """Steps k ≥ s of the main trajectory: SDE steps inside the window (stored for the update), a completion branch
    started at each (or an x0 estimate), Euler after it; every live ODE branch advances in the same call."""

    def __init__(
        self,
        engine,
        sampler,
        window,
        noise_level,
        completions,
        baseline_noise,
        first,
        reuse,
        steps=None,
        store=True,
        starts=None,
        means=False,
    ):
        self.engine, self.sampler, self.window, self.noise_level = engine, sampler, window, noise_level
        self.completions, self.baseline_noise, self.first, self.reuse = completions, baseline_noise, first, reuse
        self.completion_steps: int | None = steps  # Euler steps per ODE completion (None: every remaining step)
        self.branches: list[Branch] = []  # ODE branches: the baseline (j = 0) first, then completions j = 1..W-1
        self.estimates: list[Tensor] = []  # x0 mode: [n, ...] per j
        self.latents: list[Tensor] = []
        self.next_latents: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.store = store  # keep the window's transitions (False: final samples only)
        self.store_means = means  # keep each window step's transition mean μ_old too
        self.means: list[Tensor] = []
        self.starts: Tensor | None = starts  # [N] host per-row window starts, or None: one window
        self.taken: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # per-row windows: k -> (z, z', ℓ, μ)
        self.last_x0: Tensor | None = None  # [N, ...] float32 x̂_0 of the last window step

    def step(self, main: Branch, k: int, noise: MainNoise, independent: Branch | None) -> None:
        others = [b for b in self.branches if b.live(k)] + ([independent] if independent is not None else [])
        live = [main, *others]
        vs = self.engine(live, k)
        sigma, sigma_next = self.engine.sigmas[k], self.engine.sigmas[k + 1]
        for branch, v in zip(others, vs[1:], strict=True):
            self._advance(branch, v, k)
        v_main, s = vs[0], self.window.start
        if self.starts is not None:
            self._row_window_step(main, v_main, k, noise)
            return
        inside = s <= k < s + self.window.size
        xi = noise.draw(k, keep=inside)  # ξ_k is drawn at every step, kept inside the window only
        if not inside:
            main.z = euler_step(main.z, v_main, sigma, sigma_next)
            return
        if k == s + self.window.size - 1:  # the last window step's x̂_0: a post-window solver's history
            self.last_x0 = main.z.float() - float(sigma) * v_main.float()
        self._start_completion(main, v_main, k - s, k, sigma, sigma_next)
        out = self.sampler.step(main.z, v_main, sigma, sigma_next, self.noise_level, noise=xi)
        if self.store:
            self.latents.append(main.z)
            self.next_latents.append(out.prev)
            self.log_probs.append(out.log_prob)
            if self.store_means:
                self.means.append(out.mean)
        main.z = out.prev

    def _row_window_step(self, main: Branch, v_main: Tensor, k: int, noise: MainNoise) -> None:
        """Step k with per-row windows: rows inside their window take the SDE step, the others the Euler step,
        both from the one velocity call (each row's values are those of a batch with its window for all)."""
        inside = (self.starts <= k) & (k < self.starts + self.window.size)  # [N] host bool
        xi = noise.draw(k, keep=bool(inside.any()))  # ξ_k drawn at every step, as with one window
        sigma, sigma_next = self.engine.sigmas[k], self.engine.sigmas[k + 1]
        ode = euler_step(main.z, v_main, sigma, sigma_next)
        if xi is None:
            main.z = ode
            return
        out = self.sampler.step(main.z, v_main, sigma, sigma_next, self.noise_level, noise=xi)
        on = to_device(inside, main.z.device).reshape(-1, *([1] * (main.z.dim() - 1)))
        prev = torch.where(on, out.prev, ode)
        if self.store:
            self.taken[k] = (main.z, prev, out.log_prob, out.mean if self.store_means else None)  # means: RatioNorm
        main.z = prev

    def gathered(self, starts: Tensor) -> tuple[list[Tensor], Tensor | None]:
        """Each row's own W window steps from the steps taken: ([latents, next_latents, log_probs] [N, W, ...],
        means [N, W, ...] or None)."""
        steps = sorted(self.taken)
        rows = torch.arange(starts.shape[0], device="cpu")
        picks = [[steps.index(int(a) + i) for i in range(self.window.size)] for a in starts.tolist()]
        at = torch.tensor(picks, dtype=torch.long, device="cpu")  # [N, W] position of each row's step in `steps`
        parts = []
        for field in range(4 if self.store_means else 3):
            taken = torch.stack([self.taken[k][field] for k in steps])  # [len(steps), N, ...]
            index = (at.to(taken.device), rows.to(taken.device)[:, None])
            parts.append(taken[index])  # [N, W, ...]
        return parts[:3], parts[3] if self.store_means else None

    def _start_completion(self, main: Branch, v_main: Tensor, j: int, k: int, sigma, sigma_next) -> None:
        """Completion j from the main latent z_{s+j}: an x0 estimate, or an ODE branch whose first step is taken."""
        shared = self.baseline_noise == "shared"
        if self.completions == "x0":
            pick = self.first if j == 0 and shared else slice(None)
            self.estimates.append((main.z[pick].float() - sigma * v_main[pick].float()).to(main.z.dtype))
        elif self.completions == "ode" and (j > 0 or shared):
            pick = self.first if j == 0 else torch.arange(main.z.shape[0], device=main.z.device)
            num_steps = self.engine.sigmas.shape[0] - 1
            branch = Branch(main.z[pick], pick, completion_nodes(k, num_steps, self.completion_steps), at=k)
            v_branch = v_main[pick] if self.reuse else self.engine([branch], k)[0]
            self._advance(branch, v_branch, k)
            self.branches.append(branch)

    def _advance(self, branch: Branch, v: Tensor, k: int) -> None:
        """One Euler step of an ODE branch from σ_k to its next node's σ (σ_{k+1} for an every-step branch)."""
        nxt = branch.target(k)
        branch.z = euler_step(branch.z, v, self.engine.sigmas[k], self.engine.sigmas[nxt])
        branch.at = nxt

    def completed(self, source: Tensor, independent: Branch | None) -> Tensor:
        """The completed latents [N, W, ...], j = 0..W-1 (j = W is the final image)."""
        ends = self.estimates if self.completions == "x0" else [b.z for b in self.branches]
        if independent is not None:
            ends = [independent.z, *ends] if self.completions == "ode" else [independent.z, *ends[1:]]
        elif self.baseline_noise == "shared":
            ends = [ends[0][source], *ends[1:]]  # the baseline ran once per noise row
        return torch.stack(ends, dim=1)


@torch.no_grad()
def sample_ode(
    backbone: Backbone,
    cond: Conditioning,
    z0: Tensor,
    sigmas: Tensor,
    guidance: float,
    max_batch: int | None = None,
) -> Tensor:
    """Deterministic Euler sampling of z0 [N, ...] along ``sigmas`` (evaluation, docs/algorithm.md §6.3): final
    latents."""
    n = z0.shape[0]
    chunk = max_batch or n
    finals = []
    for lo in range(0, n, chunk):
        rows = torch.arange(lo, min(lo + chunk, n), device=z0.device)
        z, part = z0[rows], cond.index(rows)
        for k in range(sigmas.shape[0] - 1):
            sigma = to_device(sigmas[k : k + 1].float(), z.device).expand(z.shape[0])  # filled there: no wait
            v = backbone.velocity(z, sigma, part, guidance)
            z = euler_step(z, v, sigmas[k], sigmas[k + 1])
        finals.append(z)
    return torch.cat(finals)


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
) -> Rollout:
    """``rollout`` as a recipe's ``[rollout]`` section asks: draws z_0 (one per group with ``same_noise``, else one
    per trajectory; ``groups`` [N] names each trajectory's prompt group) and passes the section's options on.

    With ``same_noise``, ``group_seeds`` (group -> seed) makes a group's z_0 independent of the batch it is in, so
    copies of one prompt in different rollout batches (or processes) still share it; without it, z_0 is drawn from
    ``generator`` per distinct group of this batch. ``transitions`` False keeps the final latents only (an
    optimizer that consumes final samples). ``window`` is one window for the batch, or a rollout plan's
    ``BatchPlan`` (per-row starts and the trained steps, which the returned ``Rollout.trained`` carries; its ``[N, W]``
    mask moves to the rollout's device). ``store_means`` keeps the window's transition means (``Rollout.means``)."""
    plan = window if isinstance(window, BatchPlan) else None
    if plan is not None:
        window = Window(min(plan.starts), plan.size)
    if settings.same_noise:
        unique = sorted(set(groups))
        if group_seeds is not None:
            z0 = torch.cat([backbone.initial_noise(1, cpu_generator(group_seeds[g])) for g in unique])
        else:
            z0 = backbone.initial_noise(len(unique), generator)
        source = torch.tensor([unique.index(g) for g in groups], device="cpu")  # host: checked there, then moved
    else:
        z0, source = backbone.initial_noise(len(groups), generator), None
    out = rollout(
        backbone,
        sampler,
        cond,
        z0,
        sigmas=backbone.sigmas(settings.num_steps),
        window=window,
        noise_level=settings.noise_level,
        guidance=settings.guidance,
        completions=completions,
        baseline_noise=settings.baseline_noise,
        source=source,
        generator=generator,
        max_batch=settings.max_batch,
        completion_steps=None if settings.completion_steps == "all" else settings.completion_steps,
        transitions=transitions,
        starts=None if plan is None or plan.uniform else plan.starts,
        store_means=store_means,
        branch=plan is not None and plan.branch,
        tail_sigmas=None if plan is None or plan.tail_ratio is None else _tail(backbone, settings, window, plan),
    )
    if plan is None or plan.trained is None or not transitions:
        return out
    return dataclasses.replace(out, trained=plan.trained.to(out.device))


def _tail(backbone: Backbone, settings: RolloutSettings, window: Window, plan: BatchPlan) -> list[float]:
    """MixGRPO-Flash's σ nodes after the window, on the backbone's own schedule (``compressed_tail``)."""
    num_steps, end = settings.num_steps, window.start + window.size
    nodes = post_window_nodes(num_steps, end, plan.tail_ratio)
    tail = compressed_tail(backbone.sigmas(num_steps * (nodes - 1)), num_steps, end, nodes)
    tail[0] = float(backbone.sigmas(num_steps)[end])  # the latent's own σ, bit for bit
    return tail
