"""The DGPO loss and its group weight, as pure functions of tensors (the ``dgpo`` optimizer: ``tpflow.optim.dgpo``).

Direct Group Preference Optimization (Luo et al., arXiv 2510.08425; code Luo-Yihong/DGPO,
``scripts/train_sd3_dgpo.py``) trains the pretraining flow-matching loss on final samples x₀, noised again at a
time t shared by the step's rows, x_t = (1 − t)·x₀ + t·ε_g with one ε per group g, target u = ε_g − x₀. Per row i
(sample i at one time t):

    L_θ,i   = mean_elems (v_θ − u)²        L_old,i = mean_elems (v_old − u)²        L_ref,i = mean_elems (v_ref′ − u)²
    ρ_i     = exp(L_old,i − L_θ,i)
    clipped = (A_i > 0 and ρ_i > 1 + c) or (A_i ≤ 0 and ρ_i < 1 − c)          (a trust region: no policy gradient)
    s_g     = Σ_{i∈g} A_i·β_dpo·(sg(L_θ,i) − L_ref,i) / G_g                   (the group's score; G_g its rows)
    w_g     = σ(s_g)
    ℓ_i     = sg(w_g)·A_i·L̃_θ,i  +  β·mean_elems (v_θ − v_ref)²            (L̃ = sg(L_θ) where clipped, else L_θ)

with A the group-normalised advantage clipped to ±5 (not rescaled), v_old the lagged "EMA reference" copy of the
adapter, v_ref the base model (adapter disabled), v_ref′ = v_old with ``use_ema_ref`` else v_ref. The weight is
the gradient of a Bradley–Terry likelihood of the group's better half over its worse half, −log σ(−s_g), without
its factor β_dpo/G: β_dpo sets only the sigmoid's sharpness. At the start (θ = base) s_g = 0 and every w_g = ½;
groups whose positives the policy already fits (s_g < 0) fade out. Kept apart from the optimizer so that the float64
tests (tests/test_dgpo.py) check the formulas alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DGPOLoss:
    """The DGPO loss of one micro-batch at one time t, per row: the optimizer sums ``rows``."""

    rows: Tensor  # [N] differentiable: sg(w)·A·L̃_θ + β·KL
    policy_rows: Tensor  # [N] detached sg(w)·A·L̃_θ
    kl_rows: Tensor  # [N] detached mean (v_θ − v_ref)² (zeros without a reference)
    clipped: Tensor  # [N] float 1 where the trust region cut the policy gradient
    mse: Tensor  # [N] detached L_θ


def matching_mse(v: Tensor, target: Tensor) -> Tensor:
    """[N] float64 mean over the elements of (v − target)² per row (L of the module docstring)."""
    n = v.shape[0]
    return (v.double() - target.double()).square().reshape(n, -1).mean(dim=1)


def group_scores(
    advantage: Tensor, l_theta: Tensor, l_ref: Tensor, groups: Tensor, beta_dpo: float, num_groups: int
) -> tuple[Tensor, Tensor]:
    """The partial sums of s_g over these rows: (Σ_i A_i·β_dpo·(L_θ,i − L_ref,i), row counts), both [num_groups]
    float64 indexed by the group ids ``groups`` [N] long. A group's rows may lie on several processes or micro-batches:
    the caller adds the partial sums of all of them, then divides (``group_weights``)."""
    device = advantage.device
    terms = advantage.double() * beta_dpo * (l_theta.detach().double() - l_ref.detach().double())  # [N]
    sums = torch.zeros(num_groups, dtype=torch.float64, device=device).index_add_(0, groups.to(device), terms)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=device)
    counts.index_add_(0, groups.to(device), torch.ones_like(terms))
    return sums, counts


def group_weights(sums: Tensor, counts: Tensor) -> Tensor:
    """[num_groups] float64 w_g = σ(s_g), s_g = sums_g / counts_g (a group with no rows: ½, never read)."""
    return torch.sigmoid(sums / counts.clamp(min=1.0))


def score_metrics(scores: list[Tensor]) -> dict[str, float]:
    """The update's group scores s_g (one [pairs] tensor per step: the (group, time) pairs with rows) and weights
    σ(s_g), summarised: s_g's mean, mean |s_g|, min and max; w_g's (population) std, min and max. Empty: none."""
    if not scores or sum(len(s) for s in scores) == 0:
        return {}
    s = torch.cat(scores).double()
    w = torch.sigmoid(s)
    return {
        "group_score_mean": float(s.mean()),
        "group_score_abs_mean": float(s.abs().mean()),
        "group_score_min": float(s.min()),
        "group_score_max": float(s.max()),
        "group_weight_std": float(w.std(correction=0)),
        "group_weight_min": float(w.min()),
        "group_weight_max": float(w.max()),
    }


def dgpo_loss(
    v: Tensor,
    target: Tensor,
    advantage: Tensor,
    weight: Tensor,
    l_old: Tensor,
    clip_range: float,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
) -> DGPOLoss:
    """The DGPO loss (module docstring) of N rows: v, target u [N, ...]; the advantage A, the group weight w of each
    row's group and L_old (from ``matching_mse`` of the old copy's velocity) [N]; v_ref [N, ...] for the KL or None.
    The matching losses and the ratio are float64, as the trust region compares ρ with 1 ± c for small c."""
    n = v.shape[0]
    if target.shape != v.shape:
        raise ValueError(f"target must have the shape of v {tuple(v.shape)}, got {tuple(target.shape)}.")
    if advantage.shape != (n,) or weight.shape != (n,) or l_old.shape != (n,):
        raise ValueError(f"advantage, weight and l_old must be [N] = [{n}], got {tuple(advantage.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(l_old.shape)}.")  # fmt: skip
    l_theta = matching_mse(v, target.detach())  # [N] float64, differentiable
    a = advantage.detach().double()
    ratio = torch.exp(l_old.detach().double() - l_theta.detach())
    clipped = ((a > 0) & (ratio > 1 + clip_range)) | ((a <= 0) & (ratio < 1 - clip_range))
    kept = torch.where(clipped, l_theta.detach(), l_theta)
    policy = weight.detach().double() * a * kept  # [N]
    if v_ref is not None and kl_weight > 0:
        kl = (v.double() - v_ref.detach().double()).square().reshape(n, -1).mean(dim=1)
    else:
        kl = torch.zeros(n, dtype=torch.float64, device=v.device)
    rows = policy + kl_weight * kl
    return DGPOLoss(rows, policy.detach(), kl.detach(), clipped.double(), l_theta.detach())
