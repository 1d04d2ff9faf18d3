"""The DiffusionNFT loss and its parts, as pure functions of tensors (the ``nft`` optimizer: ``tpflow.optim.nft``).

Each final latent x₀ is noised again, x_t = (1 − t)·x₀ + t·ε (σ = t = 1 is pure noise, tpflow's convention), and
the trained velocity v_θ is pulled towards an implicit positive policy and away from an implicit negative one, both
defined around a frozen "old" velocity v_old:

    v⁺ = β·v_θ + (1 − β)·v_old,        v⁻ = (1 + β)·v_old − β·v_θ
    x̂± = x_t − t·v±,                   L± = mean_elems((x̂± − x₀)²) / sg(mean_elems|x̂± − x₀|)
    L  = (adv_clip_max / β) · mean_b [ r_b·L⁺_b + (1 − r_b)·L⁻_b ]  +  kl_weight · mean_b mean_elems((v_θ − v_ref)²)

where r = clip(clip(A, ±adv_clip_max) / adv_clip_max / 2 + 1/2, 0, 1) is the sample's "optimality probability"
from its group-normalised advantage A, sg stops the gradient (the paper's adaptive weight), and v_ref is the
adapter-disabled model (or GARDO's adaptive reference copy, docs/algorithm.md §10.9; with GARDO's gate each
sample's KL carries a weight, ``kl_weights``). Kept apart from the optimizer so that the hand-computed float64 tests
(tests/test_nft.py) check the formula alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NFTLoss:
    """The NFT loss of one micro-batch at one draw of (t, ε), per sample: the optimizer sums ``rows`` over each
    optimizer step (tpflow.optim.loop); the loss of the module docstring is their mean."""

    rows: Tensor  # [N] differentiable per-sample loss: policy + kl_weight·KL
    positive: Tensor  # [N] detached L⁺
    negative: Tensor  # [N] detached L⁻
    policy_rows: Tensor  # [N] detached per-sample policy part
    kl_rows: Tensor  # [N] detached per-sample KL (zeros without a reference)


def optimality(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """r = clip(clip(A, ±c) / c / 2 + 1/2, 0, 1): A = +c gives 1 (train towards v⁺ only), A = −c gives 0."""
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max!r}.")
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def implicit_velocities(v: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(v⁺, v⁻) = (β·v + (1 − β)·v_old, (1 + β)·v_old − β·v); v_old is a constant (detached)."""
    v_old = v_old.detach()
    return beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v


def nft_loss(
    x0: Tensor,
    x_t: Tensor,
    t: Tensor,
    v: Tensor,
    v_old: Tensor,
    r: Tensor,
    beta: float,
    adv_clip_max: float,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
    kl_weights: Tensor | None = None,
) -> NFTLoss:
    """The NFT loss (module docstring) of N samples; every input [N, ...] except t, r and ``kl_weights`` [N] (each
    sample's KL multiplied by its weight, in the loss and in ``kl_rows``; None: 1).

    The x₀ errors and their adaptive weights are computed in float32 or wider; the weights in float64 and detached
    (floored at 1e-5, as the public code does, so a perfect prediction does not divide by 0).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (the loss is scaled by 1/β), got {beta!r}.")
    for name, value in (("x_t", x_t), ("v", v), ("v_old", v_old)):
        if value.shape != x0.shape:
            raise ValueError(f"{name} must have the shape of x0 {tuple(x0.shape)}, got {tuple(value.shape)}.")
    n = x0.shape[0]
    if t.shape != (n,) or r.shape != (n,):
        raise ValueError(f"t and r must be [N] = [{n}], got {tuple(t.shape)} and {tuple(r.shape)}.")
    dtype = torch.promote_types(v.dtype, torch.float32)
    x0, x_t, v, v_old = x0.to(dtype).detach(), x_t.to(dtype).detach(), v.to(dtype), v_old.to(dtype)
    tt = t.to(dtype).reshape(-1, *([1] * (x0.dim() - 1)))
    v_pos, v_neg = implicit_velocities(v, v_old, beta)
    positive = _weighted_error(x_t - tt * v_pos, x0)  # [N]
    negative = _weighted_error(x_t - tt * v_neg, x0)  # [N]
    r = r.detach().to(dtype)
    policy_rows = (adv_clip_max / beta) * (r * positive + (1 - r) * negative)  # [N]
    rows, kl_rows = policy_rows, torch.zeros_like(policy_rows)
    if v_ref is not None and kl_weight > 0:
        kl_rows = (v - v_ref.detach().to(dtype)).square().reshape(n, -1).mean(dim=1)
        kl_rows = kl_rows if kl_weights is None else kl_weights.detach().to(dtype) * kl_rows
        rows = policy_rows + kl_weight * kl_rows
    return NFTLoss(rows, positive.detach(), negative.detach(), policy_rows.detach(), kl_rows.detach())


def _weighted_error(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """[N] mean((x̂ − x₀)²) / sg(mean|x̂ − x₀|), the paper's adaptive weighting of the x₀ error."""
    err = (x0_pred - x0).reshape(x0.shape[0], -1)
    with torch.no_grad():
        weight = err.double().abs().mean(dim=1).clamp(min=1e-5).to(err.dtype)
    return err.square().mean(dim=1) / weight
