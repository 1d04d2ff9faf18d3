"""Monte Carlo values of a trajectory's window states: what TP-GRPO's ODE completions are taken to measure.

TP-GRPO's step credit reads R_j, the reward of the ODE completion from the latent x_j entering window step j
(docs/algorithm.md §3.3), as the value of that state. The value the policy gradient needs is the expected final
reward under the policy that generated the trajectory, V(x_j) = E[R(x_K) | x_j]: SDE steps (the sampler, the same
noise level α) for the window steps j..W-1 left, then the Euler ODE after the window, as the trajectory itself went.
The ODE completion is one deterministic path of that process, not its mean, so the two can disagree; estimating V
by M independent continuations measures by how much. V_W is the final image's reward R_W exactly (nothing is left
to sample).

The continuations are the rollout engine's own (``tpflow.rollout.rollout``): from the state at schedule index s + j
(window start s), the schedule σ_{s+j}..σ_K, a window of the W − j steps left starting at its first step, M rows that
all start from the state (``source``), nothing stored but the finals. They are scored on the trainer's scoring path
(``tpflow.train.scoring.score_rollout``): decode, reward with the prompt's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tpflow.devices import cpu_generator
from tpflow.interfaces import Backbone, RewardModel, Sampler
from tpflow.rollout import Window, rollout
from tpflow.scoring.call import DEFAULT_POLICY, RewardPolicy
from tpflow.train.scoring import score_rollout
from tpflow.types import Conditioning, Rollout


@dataclass(frozen=True)
class Values:
    """Per (trajectory, j) Monte Carlo estimates of V(x_j), j = 0..W; host tensors."""

    mean: Tensor  # [N, W+1] float64 mean reward of the M continuations; column W: R_W of the final latent
    se: Tensor  # [N, W+1] float64 its standard error sd/√M (sd with M − 1 degrees of freedom); column W: 0
    nfe: Tensor  # [N, W+1] float64 velocity evaluations spent on the state, M·(K − s − j); column W: 0
    samples: int  # M


def mc_values(
    backbone: Backbone,
    sampler: Sampler,
    reward: RewardModel,
    batch: Rollout,
    sigmas: Tensor,
    start: int,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    samples: int,
    generator: torch.Generator,
    chunk: int = 256,
    policy: RewardPolicy = DEFAULT_POLICY,
    max_batch: int | None = None,
) -> Values:
    """Estimate V(x_j) for every stored window state of ``batch`` by ``samples`` continuations each.

    Args:
        backbone: the policy the trajectories were sampled with (its adapter loaded), decodes the finals.
        sampler: the SDE step of the window (the recipe's).
        reward: scores the continuations' images.
        batch: N trajectories sampled with stored transitions (``transitions=True``); ``batch.latents[:, j]`` is x_j,
            its noise level α and guidance are the continuations'.
        sigmas: [K + 1] the full schedule σ_0..σ_K the trajectories were sampled on.
        start: the window start s; the states must sit at σ_s..σ_{s+W} (checked against ``batch.sigmas``).
        prompts, metadata: per trajectory, for the reward.
        samples: M ≥ 2 continuations per state.
        generator: one 63-bit seed per (trajectory, j) is drawn from it up front, trajectory-major, and seeds that
            continuation's own CPU generator: an estimate depends on the generator's state, n and j only.
        chunk, policy: decode / reward chunk size and reward policy, as ``score_rollout`` takes them.
        max_batch: the largest number of rows in one velocity call.
    """
    _check_states(batch, sigmas, start, len(prompts), len(metadata), samples)
    n, width = batch.latents.shape[:2]
    device = generator.device
    seeds = torch.randint(0, 2**63 - 1, (n, width), generator=generator, device=device, dtype=torch.int64)
    mean = torch.zeros((n, width + 1), dtype=torch.float64, device="cpu")  # host bookkeeping (tpflow.devices)
    se = torch.zeros((n, width + 1), dtype=torch.float64, device="cpu")
    nfe = torch.zeros((n, width + 1), dtype=torch.float64, device="cpu")
    source = torch.zeros(samples, dtype=torch.long, device=batch.latents.device)  # [M] every row from the state
    for b in range(n):
        cond = batch.cond.index(torch.full((samples,), b, dtype=torch.long, device=batch.latents.device))
        finals = []
        for j in range(width):
            out = _continue(backbone, sampler, batch, b, j, cond, sigmas, start, source, int(seeds[b, j]), max_batch)
            finals.append(out.final)  # [M, ...]
            nfe[b, j] = out.cost.nfe * samples
        latents = torch.cat([*finals, batch.final[b : b + 1]])  # [W·M + 1, ...]
        count = latents.shape[0]
        scores = score_rollout(
            backbone.decode, reward, latents, None, [prompts[b]] * count, [metadata[b]] * count, 0, chunk,
            policy=policy,
        ).trace[:, 0].double()  # fmt: skip
        per_state = scores[:-1].view(width, samples)  # [W, M]
        mean[b, :width] = per_state.mean(dim=1)
        se[b, :width] = per_state.std(dim=1) / samples**0.5
        mean[b, width] = scores[-1]
    return Values(mean=mean, se=se, nfe=nfe, samples=samples)


def _check_states(batch: Rollout, sigmas: Tensor, start: int, prompts: int, metadata: int, samples: int) -> None:
    """Refuse inputs whose estimates would be wrong rather than fail: fewer than 2 continuations (no standard error),
    no stored states or a prompt count off the trajectories', or states not on σ_s..σ_{s+W} of the schedule (the
    continuations would resume on the wrong noise levels)."""
    n, width = batch.latents.shape[:2]
    if samples < 2:
        raise ValueError(f"a standard error needs at least 2 continuations per state, got M = {samples}.")
    if width < 1 or not (n == prompts == metadata):
        raise ValueError("batch needs stored transitions (W >= 1) and one prompt and metadata per trajectory.")
    expected = sigmas[start : start + width + 1].float().to(batch.sigmas.device)
    if start + width >= sigmas.shape[0] or not torch.equal(batch.sigmas, expected.expand(n, width + 1)):
        raise ValueError(f"the trajectories' σ are not the schedule's σ_{start}..σ_{start + width}: wrong start.")


def _continue(
    backbone: Backbone,
    sampler: Sampler,
    batch: Rollout,
    b: int,
    j: int,
    cond: Conditioning,
    sigmas: Tensor,
    start: int,
    source: Tensor,
    seed: int,
    max_batch: int | None,
) -> Rollout:
    """M continuations of trajectory ``b`` from its state x_j, as the trajectory itself went on from there: the SDE
    for the window steps j..W-1 left (its noise level and guidance), then the ODE to σ_K; only the finals kept."""
    width = batch.latents.shape[1]
    return rollout(
        backbone,
        sampler,
        cond,  # [M] trajectory b's condition, once per continuation
        batch.latents[b : b + 1, j],  # [1, ...] x_j
        sigmas=sigmas[start + j :],  # σ_{s+j}..σ_K
        window=Window(0, width - j),  # SDE for window steps j..W-1, then ODE
        noise_level=batch.noise_level,
        guidance=batch.guidance,
        completions=None,
        source=source,  # [M] every row from the state
        generator=cpu_generator(seed),
        max_batch=max_batch,
        transitions=False,
    )
