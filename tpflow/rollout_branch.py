"""TempFlow-GRPO's branching rollout (``rollout(..., branch=True)``, docs/algorithm.md §10.4): a pure-ODE path per
noise row and, at every window step, one SDE child per trajectory from that ODE state, each completed by ODE."""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.rollout_parts import Branch, MainNoise, completion_nodes
from tpflow.samplers.euler import euler_step
from tpflow.types import Rollout, RolloutCost


def branched_rollout(
    engine, sampler, prefix, noise, source, window, noise_level, completion_steps, store_means, guidance, cond,
    completions, row_starts,
) -> Rollout:  # fmt: skip
    """The ``branch`` rollout from the prefix at the window start: the loop, then the Rollout it stored."""
    if completions != "ode" or row_starts is not None:
        raise ValueError("branch needs completions='ode' and one window for the batch (no per-row starts).")
    n, num_steps, s, width = source.shape[0], engine.sigmas.shape[0] - 1, window.start, window.size
    loop = BranchLoop(engine, sampler, window, noise_level, completion_steps, store_means)
    for k in range(s, num_steps):
        loop.step(prefix, k, noise, source)
    parts = [torch.stack(part, dim=1) for part in (loop.latents, loop.next_latents, loop.log_probs)]
    grid = engine.sigmas[s : s + width + 1].float().to(prefix.z.device).expand(n, width + 1).clone()
    return Rollout(
        latents=parts[0],
        next_latents=parts[1],
        log_probs=parts[2],
        sigmas=grid,
        noise_level=float(noise_level),
        guidance=float(guidance),
        cond=cond,
        final=prefix.z[source],  # each trajectory's noise row's ODE image
        completions=loop.completed(),
        cost=RolloutCost(nfe=round(engine.rows_evaluated / n, 2), model_s=engine.model_s),
        means=torch.stack(loop.means, dim=1) if store_means else None,
    )


class BranchLoop:
    """Steps k ≥ s of a branching rollout (TempFlow-GRPO, docs/algorithm.md §10.4): the noise rows' main path by
    Euler ODE; at each window step every trajectory branches once from its row's ODE state by the sampler's SDE step
    (its own ξ_k, so the copies of a prompt sharing z_0 are siblings of one state), and each child rides along by ODE
    to σ_K. All of them share one velocity call per step; a child's first ODE step is at k + 1."""

    def __init__(self, engine, sampler, window, noise_level, steps, means):
        self.engine, self.sampler, self.window, self.noise_level = engine, sampler, window, noise_level
        self.completion_steps, self.store_means = steps, means
        self.children: list[Branch] = []  # child i, born at window step s + i, in order
        self.latents: list[Tensor] = []
        self.next_latents: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.means: list[Tensor] = []

    def step(self, main: Branch, k: int, noise: MainNoise, source: Tensor) -> None:
        others = [c for c in self.children if c.live(k) and c.at < self.engine.sigmas.shape[0] - 1]
        vs = self.engine([main, *others], k)
        sigmas, num_steps = self.engine.sigmas, self.engine.sigmas.shape[0] - 1
        for child, v in zip(others, vs[1:], strict=True):
            nxt = child.target(k)
            child.z, child.at = euler_step(child.z, v, sigmas[k], sigmas[nxt]), nxt
        v_main, s = vs[0], self.window.start
        inside = s <= k < s + self.window.size
        xi = noise.draw(k, keep=inside)  # [N, ...] one ξ per trajectory: the siblings' own noise
        if inside:
            z, v = main.z[source], v_main[source]  # [N, ...] each trajectory's ODE state and its velocity
            out = self.sampler.step(z, v, sigmas[k], sigmas[k + 1], self.noise_level, noise=xi)
            self.latents.append(z)
            self.next_latents.append(out.prev)
            self.log_probs.append(out.log_prob)
            if self.store_means:
                self.means.append(out.mean)
            rows = torch.arange(z.shape[0], device=z.device)
            nodes = completion_nodes(k + 1, num_steps, self.completion_steps)
            self.children.append(Branch(out.prev, rows, nodes, at=k + 1))  # at σ_K already when k + 1 = K
        main.z = euler_step(main.z, v_main, sigmas[k], sigmas[k + 1])

    def completed(self) -> Tensor:
        """The children's ODE completions [N, W, ...], child i born at window step s + i."""
        return torch.stack([c.z for c in self.children], dim=1)
