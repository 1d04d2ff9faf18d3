"""Named containers that flow between the components.

Shape letters (docs/architecture.md, "Conventions"): N trajectories in a batch (prompts × group size G), K sampling
steps, W trained SDE window steps, i window position (0..W-1), j number of SDE window steps taken (0..W). ``...``
stands for the latent shape of the backbone (C, H, W for SD3 and the shapes model; tokens, channels for FLUX).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepOutput:
    """Result of one sampler step (or of re-scoring a stored transition with ``Sampler.log_prob``).

    ``std`` is the true standard deviation of the Gaussian transition, so ``prev = mean + std · ξ``.
    ``std_dev_t`` is the noise coefficient the reference code returns under that name and divides by in its KL
    term (docs/algorithm.md §1.4, §6.2): ε_k for ``flow-sde`` (without the √h factor), ρ_k (= ``std``) for ``cps``.
    """

    prev: Tensor  # [N, ...] next latent z_{k+1}, in the dtype of the input latent
    mean: Tensor  # [N, ...] float32 transition mean μ_k
    std: Tensor  # [N] float32 transition std (ε_k·√h for flow-sde, ρ_k for cps, 0 for an ODE step)
    log_prob: Tensor  # [N] float32 log-probability of ``prev`` (a surrogate for cps), mean over latent elements
    std_dev_t: Tensor  # [N] float32 noise coefficient used by the reference KL (ε_k, or ρ_k)


@dataclass(frozen=True)
class Credit:
    """Per-step rewards produced by a CreditAssigner from a reward trace [N, W+1]."""

    step_rewards: Tensor  # [N, W] reward of window step i, dtype of the trace
    turning_points: Tensor  # [N, W] bool, steps whose reward was replaced by the aggregated a_i = R_W - R_i


@dataclass(frozen=True)
class RewardOutput:
    """Scores of a batch of images; higher is better."""

    scores: Tensor  # [N] float32
    details: dict[str, Tensor] = field(default_factory=dict)  # name -> [N], e.g. the parts of a weighted reward


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning of a batch, as produced by ``Backbone.encode``; only the backbone reads its fields.

    ``tensors`` holds every per-prompt tensor with the batch in dim 0 (so the rollout can index, repeat and
    concatenate conditionings without knowing what they mean); ``extras`` holds what is shared by the batch.
    """

    tensors: dict[str, Tensor]  # name -> [N, ...]
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def index(self, idx: Tensor | slice | list[int]) -> Conditioning:
        """The conditioning of a subset (or repetition) of the batch rows."""
        return Conditioning({k: v[idx] for k, v in self.tensors.items()}, dict(self.extras))

    @staticmethod
    def cat(conds: list[Conditioning]) -> Conditioning:
        """Stack the rows of several conditionings of one backbone (their extras must agree)."""
        return Conditioning({k: torch.cat([c.tensors[k] for c in conds]) for k in conds[0].tensors}, conds[0].extras)


@dataclass(frozen=True)
class RolloutCost:
    """What one rollout cost: network evaluations and the time in the velocity calls. Decoding and scoring are
    timed where they happen, after the rollout (``tpflow.train.scoring.ScoredBatch.decode_s`` / ``reward_s``)."""

    nfe: float  # velocity evaluations per trajectory (a CFG-doubled row counts once)
    model_s: float = 0.0  # seconds in the velocity calls


@dataclass(frozen=True)
class RetainedPart:
    """One rollout batch's retained steps: the tensors its rollout kept, each graph that batch's own."""

    log_prob: Tensor  # [n, M] float32 ℓ_θ(z_{s+i+1} | z_{s+i}) of the stored transition, differentiable
    mean: Tensor | None  # [n, M, ...] float32 transition mean μ_θ, differentiable (for the KL or RatioNorm), or None
    std: Tensor  # [n, M] float32 transition std (detached)
    std_dev_t: Tensor  # [n, M] float32 the KL's noise coefficient (detached)

    def rows(self, local: Tensor) -> RetainedPart:
        mean = None if self.mean is None else self.mean[local]
        return RetainedPart(self.log_prob[local], mean, self.std[local], self.std_dev_t[local])


@dataclass(frozen=True)
class RetainedSteps:
    """The first M window steps' log-probabilities with their autograd graphs, kept by a rollout that ran them with
    gradients (``[optimizer] recompute = "retain"``, ``tpflow.rollout.retain``): the on-policy update back-propagates
    these instead of recomputing the velocity. Each step's graph starts at its own detached latent.

    Kept per rollout batch (``parts``, the first row of each at ``starts``, host ints), never concatenated: a backward
    through a concatenation runs every input's graph, so a loss over some rows would pay for every batch's backward.
    :meth:`select` gathers rows from the parts they lie in, and only those parts' graphs are back-propagated."""

    parts: tuple[RetainedPart, ...]
    starts: tuple[int, ...]  # host: the epoch row of each part's first row

    @property
    def steps(self) -> int:
        return self.parts[0].log_prob.shape[1]

    @property
    def end(self) -> int:
        """One past the last epoch row the parts cover (the batches after them keep no graphs: ``Retain.rows``)."""
        return self.starts[-1] + self.parts[-1].log_prob.shape[0]

    def select(self, rows: Tensor) -> RetainedPart:
        """The rows ``rows`` ([m] host long, any order) as one part, gathered from the parts that hold them."""
        bounds = torch.tensor([*self.starts[1:], 2**62], dtype=torch.long, device="cpu")  # host bookkeeping
        which = torch.bucketize(rows, bounds, right=True)  # [m] the part of each row
        order = torch.argsort(which, stable=True)  # rows grouped by part, in their order within each
        pieces = []
        for p in which.unique().tolist():
            local = rows[which == p] - self.starts[p]
            pieces.append(self.parts[p].rows(local.to(self.parts[p].log_prob.device)))
        gathered = RetainedPart(*(None if f[0] is None else torch.cat(f) for f in zip(
            *((q.log_prob, q.mean, q.std, q.std_dev_t) for q in pieces), strict=True)))  # fmt: skip
        if torch.equal(order, torch.arange(len(rows), device="cpu")):
            return gathered
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(rows), device="cpu")
        return gathered.rows(inverse.to(gathered.log_prob.device))

    def index(self, rows: Tensor) -> RetainedSteps:
        return RetainedSteps((self.select(rows.cpu()),), (0,))

    @staticmethod
    def cat(retained: list[RetainedSteps | None], sizes: list[int]) -> RetainedSteps:
        """The retained steps of consecutive rollout batches of ``sizes`` rows each, their parts kept apart; the
        batches past the first optimizer step's rows keep none (None) and are left out."""
        parts, starts, offset = [], [], 0
        for kept, size in zip(retained, sizes, strict=True):
            if kept is not None:
                parts += kept.parts
                starts += [offset + s for s in kept.starts]
            offset += size
        return RetainedSteps(tuple(parts), tuple(starts))


@dataclass(frozen=True)
class ReweightedSteps:
    """The provisional gradients of the first M window steps, back-propagated by the rollout as it sampled them with
    advantage 1 (``[optimizer] recompute = "reweight"``, ``tpflow.rollout.reweight``): per trainable parameter (the
    optimizer's order), ∇ℓ_θ per trajectory, summed over its live steps (``per_step`` False: every step's advantage
    is the same), or per trajectory and step. The update's on-policy step weighs them by the advantages instead of
    recomputing and back-propagating the steps. No graph is kept."""

    grads: tuple[Tensor, ...]  # per parameter: [N, *θ.shape] or, per_step, [N, M, *θ.shape] float32
    live: Tensor  # [N, M] bool: the step's transition had std ≠ 0 (its log-probability has a gradient)
    per_step: bool
    scale: float  # the loss scale the rollout's backward ran with (the fp16 GradScaler's; 1 otherwise)

    @property
    def steps(self) -> int:
        return self.live.shape[1]

    def __len__(self) -> int:
        return self.live.shape[0]

    def index(self, rows: Tensor) -> ReweightedSteps | None:
        """The rows ``rows`` ([m] long, any device) of every buffer; None when one of them has none (the buffers
        cover the epoch's first rows only: ``Reweight.rows``)."""
        if len(rows) and int(rows.max()) >= len(self):
            return None
        rows = rows.to(self.live.device)
        grads = tuple(g[rows] for g in self.grads)
        return ReweightedSteps(grads, self.live[rows], self.per_step, self.scale)

    select = index

    @staticmethod
    def cat(parts: list[ReweightedSteps | None]) -> ReweightedSteps:
        """The buffers of consecutive rollout batches (one loss scale: no optimizer step runs between them); the
        batches past the first step's rows keep none (None), and the result covers the ones before them."""
        kept = [p for p in parts if p is not None]
        if any(p is not None for p in parts[len(kept) :]):
            raise ValueError("Only the first rollout batches of an epoch keep reweight's gradients.")
        parts, first = kept, kept[0]
        if any(p.per_step != first.per_step or p.scale != first.scale for p in parts):
            raise ValueError("Rollout batches to concatenate must keep their gradients alike (per step, loss scale).")
        grads = tuple(torch.cat(column) for column in zip(*(p.grads for p in parts), strict=True))
        return ReweightedSteps(grads, torch.cat([p.live for p in parts]), first.per_step, first.scale)


@dataclass(frozen=True)
class Rollout:
    """The stored window transitions of N trajectories, what the optimizer re-scores (docs/algorithm.md §2)."""

    latents: Tensor  # [N, W, ...] z_{s+i}, the latent entering window step i
    next_latents: Tensor  # [N, W, ...] z_{s+i+1}, the sampled latent after window step i
    log_probs: Tensor  # [N, W] float32 old log-probabilities ℓ_old(z_{s+i+1} | z_{s+i})
    sigmas: Tensor  # [N, W + 1] float32 σ_s..σ_{s+W} of each trajectory; step i goes from [:, i] to [:, i + 1]
    noise_level: float  # α used inside the window
    guidance: float  # the guidance the velocities were computed with (training recomputes them the same way)
    cond: Conditioning  # conditioning of the N trajectories
    final: Tensor  # [N, ...] final latent z_K (its image scores R_W)
    completions: Tensor | None  # [N, W, ...] latents completed after j = 0..W-1 SDE steps (j = 0: R_0), or None
    cost: RolloutCost
    trained: Tensor | None = None  # [N, W] bool, the stored steps the update trains (a rollout plan's); None: all
    means: Tensor | None = None  # [N, W, ...] float32 transition means μ_old at rollout time (RatioNorm), or None
    # the first M steps' differentiable log-probs ("retain") or their per-trajectory gradients ("reweight"), or None
    retained: RetainedSteps | ReweightedSteps | None = None
    # [N] long on the CPU: each trajectory's prompt group, numbered over the epoch's rows of every process (the ids
    # ``Optimizer.advantages`` got), set by the trainer before the update; None where no trainer set them. An update
    # whose loss couples a group's members (DGPO's group weight) reads it; the others never need it.
    groups: Tensor | None = None
    # [N] long on the CPU: each trajectory's row in the epoch's global order (its rollout batch's first row over the
    # plan's batches, plus its row in that batch), set by the sampling stage; what keys an update's per-sample draws
    # (final-sample optimizers' times and noise), so that they do not depend on how many processes share the epoch.
    # None: rows numbered in process order (an update called without the trainer)
    epoch_rows: Tensor | None = None
    # details key -> [N] float32 on the CPU: the reward's parts of each final sample (its ``details``), kept by the
    # sampling stage for an optimizer that reads them (capability ``reads_reward_details``: GARDO's KL gate); else None
    reward_details: dict[str, Tensor] | None = None
    # [N] bool on the CPU: True for a row replayed from an earlier epoch (tpflow.train.replay), whose ``log_probs`` are
    # the behaviour policy's, not the update's starting one's (the optimizer corrects it); None: none replayed
    replayed: Tensor | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the stored transitions live: the backbone's device (tpflow.devices, rule 2)."""
        return self.log_probs.device

    def index(self, rows: Tensor) -> Rollout:
        """The rollout of a subset of trajectories (rows: [M] long indices)."""
        return Rollout(
            latents=self.latents[rows],
            next_latents=self.next_latents[rows],
            log_probs=self.log_probs[rows],
            sigmas=self.sigmas[rows],
            noise_level=self.noise_level,
            guidance=self.guidance,
            cond=self.cond.index(rows),
            final=self.final[rows],
            completions=None if self.completions is None else self.completions[rows],
            cost=self.cost,
            trained=None if self.trained is None else self.trained[rows],
            means=None if self.means is None else self.means[rows],
            retained=None if self.retained is None else self.retained.index(rows),
            groups=None if self.groups is None else self.groups[rows.cpu()],
            epoch_rows=None if self.epoch_rows is None else self.epoch_rows[rows.cpu()],
            reward_details=_rows_of(self.reward_details, rows),
            replayed=None if self.replayed is None else self.replayed[rows.cpu()],
        )

    def transitions(self, rows: Tensor, steps: Tensor) -> Rollout:
        """The stored transitions (rows[p], steps[p]) as a rollout of P one-step trajectories (rows, steps: [P] long
        indices on this rollout's device): what an update that trains a subset of (trajectory, step) pairs packs
        into full velocity calls, whatever steps the pairs come from."""
        return Rollout(
            latents=self.latents[rows, steps].unsqueeze(1),
            next_latents=self.next_latents[rows, steps].unsqueeze(1),
            log_probs=self.log_probs[rows, steps].unsqueeze(1),
            sigmas=torch.stack([self.sigmas[rows, steps], self.sigmas[rows, steps + 1]], dim=1),
            noise_level=self.noise_level,
            guidance=self.guidance,
            cond=self.cond.index(rows),
            final=self.final[rows],
            completions=None,
            cost=self.cost,
            means=None if self.means is None else self.means[rows, steps].unsqueeze(1),
            groups=None if self.groups is None else self.groups[rows.cpu()],
        )

    @staticmethod
    def cat(rollouts: list[Rollout]) -> Rollout:
        """Concatenate rollout batches of one epoch (same W, α and guidance; windows may start differently)."""
        first = rollouts[0]
        if any(
            (r.noise_level, r.guidance, r.latents.shape[1:])
            != (first.noise_level, first.guidance, first.latents.shape[1:])
            for r in rollouts
        ):
            raise ValueError("Rollouts to concatenate need the same window size, noise level and guidance.")
        if len({r.means is None for r in rollouts}) > 1:
            raise ValueError("Rollouts to concatenate must all store their transition means, or none of them.")
        kept = [r.retained is not None for r in rollouts]
        if kept != sorted(kept, reverse=True):  # the first optimizer step's batches keep them (Retain/Reweight.rows)
            raise ValueError("Only the first rollout batches of an epoch keep retained graphs or gradients.")
        completions = None if first.completions is None else torch.cat([r.completions for r in rollouts])
        trained = None  # a batch without a mask trains every stored step
        if any(r.trained is not None for r in rollouts):
            trained = torch.cat([r.trained if r.trained is not None else r.log_probs.new_ones(
                r.log_probs.shape, dtype=torch.bool) for r in rollouts])  # fmt: skip
        return Rollout(
            latents=torch.cat([r.latents for r in rollouts]),
            next_latents=torch.cat([r.next_latents for r in rollouts]),
            log_probs=torch.cat([r.log_probs for r in rollouts]),
            sigmas=torch.cat([r.sigmas for r in rollouts]),
            noise_level=first.noise_level,
            guidance=first.guidance,
            cond=Conditioning.cat([r.cond for r in rollouts]),
            final=torch.cat([r.final for r in rollouts]),
            completions=completions,
            cost=RolloutCost(
                nfe=sum(r.cost.nfe * len(r) for r in rollouts) / sum(len(r) for r in rollouts),
                model_s=sum(r.cost.model_s for r in rollouts),
            ),
            trained=trained,
            means=None if first.means is None else torch.cat([r.means for r in rollouts]),
            retained=_cat_retained([r.retained for r in rollouts], [len(r) for r in rollouts]),
            groups=_cat_optional([r.groups for r in rollouts]),
            epoch_rows=_cat_optional([r.epoch_rows for r in rollouts]),
            reward_details=_cat_details([r.reward_details for r in rollouts]),
        )


def _cat_optional(parts: list[Tensor | None]) -> Tensor | None:
    """A per-row tensor of consecutive rollout batches (their groups, their epoch rows): None unless every batch has
    it (replayed rows have no epoch rows)."""
    return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]


def _cat_details(parts: list[dict[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """The reward details of consecutive rollout batches (None unless every batch has them)."""
    if any(p is None for p in parts):
        return None
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}  # type: ignore[index]


def _rows_of(details: dict[str, Tensor] | None, rows: Tensor) -> dict[str, Tensor] | None:
    """The reward details of ``rows`` ([M] long, any device; the details stay on the CPU)."""
    return None if details is None else {key: value[rows.cpu()] for key, value in details.items()}


def _cat_retained(kept: list, sizes: list[int]) -> RetainedSteps | ReweightedSteps | None:
    if kept[0] is None:
        return None
    if isinstance(kept[0], ReweightedSteps):
        return ReweightedSteps.cat(kept)  # the epoch's first batches (Reweight.rows)
    return RetainedSteps.cat(kept, sizes)


class PromptItem(NamedTuple):
    """One prompt of a dataset with its task metadata (GenEval: tag, include, exclude; OCR: the target text...)."""

    prompt: str
    metadata: dict[str, Any]


class BatchLayout(NamedTuple):
    """How an optimizer's update batches the epoch's rows (``Optimizer.batch_layout``): the run's layout line and the
    out-of-memory advice read it, so that train/ names no optimizer's options."""

    micro_batch_size: int  # rows per forward/backward pass
    accumulation: int  # micro-batches per optimizer step
    micro_batch_option: str  # the recipe key that sets micro_batch_size, e.g. "optimizer.micro_batch_size"
    accumulation_option: str  # the recipe key that sets accumulation
