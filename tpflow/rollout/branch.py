"""TempFlow-GRPO's branching rollout (docs/algorithm.md §10.4): a pure-ODE path per noise row and, at every window
step, one SDE child per trajectory from that ODE state, each completed by ODE. E-GRPO's merged steps (§10.11) are
window steps that span several schedule steps (``nodes``): one SDE step from σ_a to σ_b, the child completed from b."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from tpflow.interfaces import Sampler
from tpflow.plans.base import Window
from tpflow.rollout.inputs import RolloutInputs, begin, ode_prefix
from tpflow.rollout.parts import Branch, MainNoise, Velocity, completion_nodes
from tpflow.rollout.retain import Retain, log_prob_with_grad
from tpflow.rollout.reweight import Reweight
from tpflow.rollout.window import stored_rollout
from tpflow.samplers.euler import euler_step
from tpflow.types import Rollout


class BranchEngine:
    """Branch at every step of ``window`` instead of following one SDE path: the main path of each noise row is pure
    ODE; at window step s + i every trajectory n takes one SDE step from its noise row's ODE state with its own ξ,
    stored as transition i, and that child is ODE-completed (in ``completion_steps`` Euler steps, None: every step)
    into ``completions[:, i]``; ``final`` is the ODE image. ``store_means`` keeps the transition means. ``nodes``
    (W + 1 grid indices, None: s .. s + W): window step i goes from σ_{nodes[i]} to σ_{nodes[i + 1]}."""

    def __init__(
        self,
        sampler: Sampler,
        window: Window,
        noise_level: float,
        completion_steps: int | None = None,
        store_means: bool = False,
        retain: Retain | Reweight | None = None,
        nodes: tuple[int, ...] | None = None,
    ) -> None:
        self.sampler, self.window, self.noise_level = sampler, window, noise_level
        self.completion_steps, self.store_means, self.retain = completion_steps, store_means, retain
        self.nodes = tuple(range(window.start, window.start + window.size + 1)) if nodes is None else tuple(nodes)

    @torch.no_grad()
    def run(self, inputs: RolloutInputs) -> Rollout:
        started = begin(inputs, self.window)
        prefix = ode_prefix(started, self.window.start)
        n, s, width = inputs.n, self.window.start, self.window.size
        loop = BranchLoop(started.engine, self.sampler, self.window, self.noise_level, self.completion_steps,
                          self.store_means, self.retain, started.first, self.nodes)  # fmt: skip
        for k in range(s, inputs.num_steps):
            loop.step(prefix, k, started.noise, started.source)
        parts = [torch.stack(part, dim=1) for part in (loop.latents, loop.next_latents, loop.log_probs)]
        grid = inputs.sigmas[list(self.nodes)].expand(n, width + 1)  # [N, W + 1] each window step's σ ends
        means = torch.stack(loop.means, dim=1) if self.store_means else None
        final = prefix.z[started.source]  # each trajectory's noise row's ODE image
        out = stored_rollout(started, self.noise_level, final, parts, grid, means, loop.completed())
        return out if loop.log is None else dataclasses.replace(out, retained=loop.log.stacked())


class BranchLoop:
    """Steps k ≥ s of a branching rollout (TempFlow-GRPO, docs/algorithm.md §10.4): the noise rows' main path by
    Euler ODE; at each window step every trajectory branches once from its row's ODE state by the sampler's SDE step
    (its own ξ_k, so the copies of a prompt sharing z_0 are siblings of one state), and each child rides along by ODE
    to σ_K. All of them share one velocity call per step; a child's first ODE step is at k + 1."""

    def __init__(
        self, engine: Velocity, sampler: Sampler, window: Window, noise_level: float, steps: int | None, means: bool,
        retain: Retain | Reweight | None = None, first: Tensor | None = None, nodes: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.engine, self.sampler, self.window, self.noise_level = engine, sampler, window, noise_level
        self.completion_steps, self.store_means = steps, means
        # a recompute-free update's record: the window steps run with gradients per trajectory (``first`` [P]: the
        # first trajectory of each noise row, whose velocity the ODE path then takes)
        self.log = None if retain is None else retain.log(engine.backbone, engine, window.size)
        self.first = first
        s = window.start
        # window step i starts at grid index nodes[i] and ends at nodes[i + 1] (one schedule step unless merged)
        self.nodes = tuple(range(s, s + window.size + 1)) if nodes is None else tuple(nodes)
        self.origin = {k: i for i, k in enumerate(self.nodes[:-1])}
        self.children: list[Branch] = []  # child i, born at window step s + i, in order
        self.latents: list[Tensor] = []
        self.next_latents: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.means: list[Tensor] = []

    def step(self, main: Branch, k: int, noise: MainNoise, source: Tensor) -> None:
        others = [c for c in self.children if c.live(k) and c.at < self.engine.sigmas.shape[0] - 1]
        i = self.origin.get(k)  # the window step that starts at k, None outside the window
        inside = i is not None
        v_grad = None
        if self.log is not None and i is not None and self.log.covers(i):
            # every trajectory's ODE state with gradients, one row each (copies of a noise row are separate rows:
            # their gradients are their own); the ODE path takes its first copy's velocity, the children theirs
            each = Branch(main.z[source], torch.arange(source.shape[0], device=main.z.device))
            v_grad = self.log.velocity(lambda: self.engine([each], k)[0], source.shape[0])
            vs = [v_grad.detach()[self.first], *(self.engine(others, k) if others else [])]
        else:
            vs = self.engine([main, *others], k)
        sigmas, num_steps = self.engine.sigmas, self.engine.sigmas.shape[0] - 1
        for child, v in zip(others, vs[1:], strict=True):
            nxt = child.target(k)
            child.z, child.at = euler_step(child.z, v, sigmas[k], sigmas[nxt]), nxt
        v_main = vs[0]
        xi = noise.draw(k, keep=inside)  # [N, ...] one ξ per trajectory: the siblings' own noise
        if i is not None:
            dest = self.nodes[i + 1]  # k + 1 unless the step is merged
            z = main.z[source]  # [N, ...] each trajectory's ODE state and its velocity
            v = v_main[source] if v_grad is None else v_grad.detach()
            out = self.sampler.step(z, v, sigmas[k], sigmas[dest], self.noise_level, noise=xi)
            if v_grad is not None:
                self.log.keep(log_prob_with_grad(self.sampler, out.prev, z, v_grad, sigmas[k], sigmas[dest],
                                                 self.noise_level), z.shape[0])  # fmt: skip
            self.latents.append(z)
            self.next_latents.append(out.prev)
            self.log_probs.append(out.log_prob)
            if self.store_means:
                self.means.append(out.mean)
            rows = torch.arange(z.shape[0], device=z.device)
            nodes = completion_nodes(dest, num_steps, self.completion_steps)
            if nodes is None and dest > k + 1:  # a merged child waits until the path reaches its σ
                nodes = list(range(dest, num_steps + 1))
            self.children.append(Branch(out.prev, rows, nodes, at=dest))  # at σ_K already when dest = K
        main.z = euler_step(main.z, v_main, sigmas[k], sigmas[k + 1])

    def completed(self) -> Tensor:
        """The children's ODE completions [N, W, ...], child i born at window step s + i."""
        return torch.stack([c.z for c in self.children], dim=1)
