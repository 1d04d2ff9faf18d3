"""The AWM loss and its parts, as pure functions of tensors (the ``awm`` optimizer: ``tpflow.optim.awm``).

Advantage Weighted Matching (Xue et al., arXiv 2509.25050; code scxue/advantage_weighted_matching) keeps the
pretraining flow-matching loss on the final sample x₀ and weights it by the sample's advantage. Each x₀ is noised
again, x_t = (1 − t)·x₀ + t·ε, the flow-matching target is u = ε − x₀ (tpflow's velocity), and per (sample, t) row:

    m  = mean_elems (v_θ(x_t, t) − u)²
    ℓ  = −t·((m + 1e-10)^p − (1e-10)^p) / p               ("ghuber", p = 1/4: the public code's default)
    r  = exp(ℓ − sg(ℓ_old))                                (ℓ_old = ℓ on policy: r ≡ 1, its gradient ∇ℓ)
    L  = max(−A'·r, −A'·clip(r, 1 ± ε))  +  β·mean_elems (v_θ − v_ref)²  +  γ·mean_elems (v_θ − v_ema)²

with A' = clip(A, ±c)/c ∈ [−1, 1] the group-normalised advantage rescaled, v_ref the base model (the adapter
disabled), v_ema a lagged copy of the adapter (the code's "KL-EMA", γ = ``ema_weight``). On policy the ratio is 1
and its clip inert, so the gradient is −A'·∇ℓ = A'·t·(m + 1e-10)^{p−1}·∇m plus the two KL gradients. The other
weightings of the code: "uniform" ℓ = −m, "t" ℓ = −t·m, "t2" ℓ = −t²·m, "huber" ℓ = −t·(√(m + 1e-10) − 1e-5).
Kept apart from the optimizer so that the float64 tests (tests/test_awm.py) check the formula alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

EPS = 1e-10
Weighting = Literal["ghuber", "huber", "uniform", "t", "t2"]


@dataclass(frozen=True)
class AWMLoss:
    """The AWM loss of one micro-batch at one draw of (t, ε), per row: the optimizer sums ``rows``."""

    rows: Tensor  # [N] differentiable: policy + β·KL_ref + γ·KL_ema
    policy_rows: Tensor  # [N] detached
    kl_rows: Tensor  # [N] detached mean (v_θ − v_ref)² (zeros without a reference)
    ema_rows: Tensor  # [N] detached mean (v_θ − v_ema)² (zeros without the lagged copy)
    mse: Tensor  # [N] detached m


def matching_value(m: Tensor, t: Tensor, weighting: Weighting, power: float) -> Tensor:
    """ℓ [N] of the per-row mean squared error m [N] at times t [N] (module docstring), in m's dtype."""
    t = t.to(m.dtype)
    if weighting == "ghuber":
        return -t * ((m + EPS) ** power - EPS**power) / power
    if weighting == "huber":
        return -t * (torch.sqrt(m + EPS) - 1e-5)
    if weighting == "uniform":
        return -m
    if weighting == "t":
        return -t * m
    if weighting == "t2":
        return -t * t * m
    raise ValueError(f"unknown weighting {weighting!r}")


def awm_loss(
    v: Tensor,
    target: Tensor,
    t: Tensor,
    advantage: Tensor,
    clip_range: float,
    weighting: Weighting = "ghuber",
    power: float = 0.25,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
    v_ema: Tensor | None = None,
    ema_weight: float = 0.0,
) -> AWMLoss:
    """The AWM loss (module docstring) of N rows: v, target u and the frozen velocities [N, ...], t and the
    rescaled advantage A' [N]. The matching value is computed in float64 (as the public code computes it)."""
    n = v.shape[0]
    if target.shape != v.shape:
        raise ValueError(f"target must have the shape of v {tuple(v.shape)}, got {tuple(target.shape)}.")
    if t.shape != (n,) or advantage.shape != (n,):
        raise ValueError(f"t and advantage must be [N] = [{n}], got {tuple(t.shape)} and {tuple(advantage.shape)}.")
    m = (v.double() - target.detach().double()).square().reshape(n, -1).mean(dim=1)  # [N] float64
    value = matching_value(m, t.detach().double(), weighting, power)
    ratio = torch.exp(value - value.detach())  # on policy: 1, with the gradient of ℓ
    a = advantage.detach().double()
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range))  # [N]
    rows = policy
    kl_rows = ema_rows = torch.zeros_like(policy)
    if v_ref is not None and kl_weight > 0:
        kl_rows = (v.double() - v_ref.detach().double()).square().reshape(n, -1).mean(dim=1)
        rows = rows + kl_weight * kl_rows
    if v_ema is not None and ema_weight > 0:
        ema_rows = (v.double() - v_ema.detach().double()).square().reshape(n, -1).mean(dim=1)
        rows = rows + ema_weight * ema_rows
    dtype = torch.promote_types(v.dtype, torch.float32)
    return AWMLoss(rows.to(dtype), policy.detach(), kl_rows.detach(), ema_rows.detach(), m.detach())


def stratified_indices(uniforms: Tensor, lower: int, upper: int, strata: int) -> Tensor:
    """[..., strata] long schedule indices, one per stratum: the code's bounds long(linspace(lower, upper,
    strata + 1)) and index = bound_k + ⌊u_k·(bound_{k+1} − bound_k)⌋ for uniforms u [..., strata] in [0, 1)."""
    bounds = torch.linspace(lower, upper, strata + 1, dtype=torch.float64, device=uniforms.device).long()  # [S + 1]
    low, width = bounds[:-1], (bounds[1:] - bounds[:-1])
    return low + (uniforms.double() * width).long()
