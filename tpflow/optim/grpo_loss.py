"""The GRPO loss terms of one window step, as pure functions of tensors (the ``grpo`` optimizer: tpflow.optim.grpo).

The PPO-clipped likelihood ratio (:func:`clipped_surrogate`) and the KL of the policy's Gaussian transition to the
adapter-disabled model's (:func:`kl_to_reference`), docs/algorithm.md §6.2. Kept apart from the optimizer, as
``nft_loss`` is from ``nft``, so that the tests check the formulas alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate of one (micro-batch, window position), per row: the update sums the rows' losses over
    each optimizer step (loop.py) and reads its diagnostics (approx KL, clip fraction) from ``log_ratio``."""

    row_losses: Tensor  # [N] differentiable max(−A·κ, −A·clip(κ)) per row
    ratio: Tensor  # [N] detached κ = exp(ℓ_θ − ℓ_old)
    log_ratio: Tensor  # [N] detached ℓ_θ − ℓ_old


def clipped_surrogate(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float) -> PolicyLoss:
    """PPO-clip loss of one window step (docs/algorithm.md §6.2).

    ``loss = mean_b max(−A_b·κ_b, −A_b·clip(κ_b, 1 − ε, 1 + ε))`` with ``κ = exp(log_prob − old_log_prob)``. On
    policy (κ = 1) its gradient is that of ``−mean(A·log_prob)``. Off policy, a sample whose ratio left the trust
    region in the direction its advantage pushes (κ > 1 + ε with A > 0, κ < 1 − ε with A < 0) gets no gradient.

    Args:
        log_prob: [N] ℓ_θ, recomputed with grad (float32).
        old_log_prob: [N] ℓ_old stored at rollout time; treated as a constant (detached).
        advantages: [N] advantages of this window step; cast to the dtype of ``log_prob``.
        clip_range: ε > 0 (``GRPOOptions.clip_range``, 1e-5 in the published runs).

    Returns:
        PolicyLoss with the differentiable per-row losses (their mean is the loss above) and the detached ratio.
    """
    if log_prob.dim() != 1:
        raise ValueError(f"log_prob must be 1-D [N] (one per trajectory), got shape {tuple(log_prob.shape)}.")
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if value.shape != log_prob.shape:
            raise ValueError(
                f"{name} must have the shape of log_prob {tuple(log_prob.shape)}, got {tuple(value.shape)}; "
                "pass one window position's column, e.g. advantages[:, i]."
            )
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 (the published runs use 1e-5), got {clip_range!r}.")

    advantages = advantages.detach().to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return PolicyLoss(torch.maximum(unclipped, clipped), ratio.detach(), log_ratio.detach())


def kl_to_reference(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-trajectory KL between the Gaussian transitions of the policy and of the reference (docs/algorithm.md §6.2).

    ``KL_b = mean_elems((μ_θ − μ_ref)²) / (2·std_b²)``, the reference code's form: ``std`` is the sampler's
    ``StepOutput.std_dev_t`` (ρ_k for cps; ε_k without the √h for flow-sde), or the transition std ``StepOutput.std``
    under ``kl_std = "transition"`` (TempFlow-GRPO). The gradient flows through ``mean``
    only; ``ref_mean`` (the adapter-disabled model, computed without grad) and ``std`` are constants.

    Where ``std`` is 0 (an ODE step, e.g. cps at σ_{k+1} = 0, docs/algorithm.md §8 item 8) the KL is 0 with no
    gradient instead of the reference's x/0 (NaN or inf): such a step is deterministic, has no likelihood ratio
    and is never trained (docs/algorithm.md §8 D7).

    Args:
        mean: [N, ...] transition mean μ_θ of the policy, with grad.
        ref_mean: [N, ...] transition mean μ_ref of the reference model.
        std: [N] noise coefficient of each trajectory's step.

    Returns:
        [N] KL per trajectory, float32 or wider; average it over the micro-batch and weight it by β.
    """
    if mean.dim() < 1 or ref_mean.shape != mean.shape:
        raise ValueError(
            f"mean and ref_mean must have the same shape [N, ...], got {tuple(mean.shape)} and "
            f"{tuple(ref_mean.shape)}."
        )
    if std.shape != mean.shape[:1]:
        raise ValueError(
            f"std must be [N] = {tuple(mean.shape[:1])} (StepOutput.std_dev_t), got shape {tuple(std.shape)}."
        )
    dtype = torch.promote_types(mean.dtype, torch.float32)
    diff = mean.to(dtype) - ref_mean.detach().to(dtype)
    mean_sq = diff.square().reshape(diff.shape[0], -1).mean(dim=1)
    std = std.detach().to(dtype)
    nonzero = std != 0
    safe_std = torch.where(nonzero, std, torch.ones_like(std))  # keeps the masked branch (and its gradient) finite
    return torch.where(nonzero, mean_sq / (2.0 * safe_std.square()), torch.zeros_like(mean_sq))
