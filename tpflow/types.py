"""Named containers that flow between the components.

Shape letters (DESIGN.md §2): N trajectories in a batch (prompts × group size G), K sampling steps, W trained SDE
window steps, i window position (0..W-1), j number of SDE window steps taken (0..W). ``...`` stands for the latent
shape of the backbone (C, H, W for SD3 and the shapes model; tokens, channels for FLUX).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor


@dataclass(frozen=True)
class StepOutput:
    """Result of one sampler step (or of re-scoring a stored transition with ``Sampler.log_prob``).

    ``std`` is the true standard deviation of the Gaussian transition, so ``prev = mean + std · ξ``.
    ``std_dev_t`` is the noise coefficient the reference code returns under that name and divides by in its KL
    term (ALGORITHM.md §1.4, §6.2): ε_k for ``flow-sde`` (without the √h factor), ρ_k (= ``std``) for ``cps``.
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


@dataclass(frozen=True)
class RolloutCost:
    """What one rollout cost: network evaluations and where the time went (seconds)."""

    nfe: int  # velocity evaluations per trajectory (a CFG-doubled call counts once)
    model_s: float = 0.0
    decode_s: float = 0.0
    reward_s: float = 0.0
    other_s: float = 0.0


@dataclass(frozen=True)
class Rollout:
    """The stored window transitions of N trajectories, what the optimizer re-scores (ALGORITHM.md §2)."""

    latents: Tensor  # [N, W, ...] z_{s+i}, the latent entering window step i
    next_latents: Tensor  # [N, W, ...] z_{s+i+1}, the sampled latent after window step i
    log_probs: Tensor  # [N, W] float32 old log-probabilities ℓ_old(z_{s+i+1} | z_{s+i})
    sigmas: Tensor  # [W + 1] float32 σ_{s}..σ_{s+W}; step i goes from sigmas[i] to sigmas[i + 1]
    noise_level: float  # α used inside the window
    final: Tensor  # [N, ...] final latent z_K (its image scores R_W)
    completions: Tensor | None  # [N, W, ...] completed latents after j = 0..W-1 SDE steps, or None
    cost: RolloutCost


class PromptItem(NamedTuple):
    """One prompt of a dataset with its task metadata (GenEval: tag, include, exclude; OCR: the target text...)."""

    prompt: str
    metadata: dict[str, Any]
