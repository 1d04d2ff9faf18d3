"""SA-Solver's steps for a flow model: the stochastic Adams predictor and corrector in data-prediction form.

SA-Solver (Xue et al., arXiv 2309.05019) integrates the reverse SDE whose noise is scaled by τ in the half-log-SNR
λ = log(α/σ). For a rectified flow z_σ = (1 − σ)·x_0 + σ·ε (α = 1 − σ) with the data prediction x̂_0 = z − σ·v, one
step from σ_s to σ_t (h = λ_t − λ_s > 0, c = 1 + τ²) on the predictions D_i at the nodes μ_i (λ values) is

    z_t = e^{−τ²h}·(σ_t/σ_s)·z + Σ_i B_i·D_i + σ_t·sqrt(1 − e^{−2τ²h})·ξ,
    B_i = c·α_t·∫_{−h}^{0} e^{c·u}·ℓ_i(λ_t + u) du,

ℓ_i the Lagrange basis polynomial of node i. The predictor (Adams–Bashforth) interpolates the predictions already
made at σ_s and the node before it; the corrector (Adams–Moulton) those at σ_t (made at the predicted point) and σ_s,
and reuses the predictor's ξ. At order 2 both add SA-Solver's few-step term (an O(h³) change its code makes "similar
to UniPC"): +δ to the newest prediction's weight and −δ to the other's, with

    predictor: δ = c·α_t·(h²/2 − (c·h − 1 + e^{−c·h})/c²)/h',   h' = λ_s − λ_{s'} (the step before),
    corrector: δ = c·α_t·(h/2 − (c·h − 1 + e^{−c·h})/(c²·h)).

This is the integral SA-Solver's code writes with raw powers of λ (∫ e^{cλ}·λ^k dλ between λ_s and λ_t); here it is
taken in u = λ − λ_t, which is the same number without the cancellation between large terms.
``tests/test_solver_rollouts.py`` checks both steps against diffusers' ``SASolverScheduler`` update functions in
float64. At τ = 0 and order 1 the step is DPM-Solver++'s first-order step (DDIM), i.e. the Euler step of v.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def flow_lambda(sigma: float) -> float:
    """λ = log((1 − σ)/σ), the half-log-SNR of a rectified flow, for 0 < σ < 1."""
    if not 0 < sigma < 1:
        raise ValueError(f"λ = log((1 − σ)/σ) needs 0 < σ < 1, got σ = {sigma}.")
    return math.log((1 - sigma) / sigma)


def _basis_integrals(nodes: Sequence[float], lam_t: float, h: float, c: float) -> list[float]:
    """∫_{−h}^{0} e^{c·u}·ℓ_i(λ_t + u) du for the Lagrange basis ℓ_i of ``nodes`` (one or two λ values)."""
    g0 = -math.expm1(-c * h) / c  # ∫ e^{cu} du
    if len(nodes) == 1:
        return [g0]
    g1 = (math.exp(-c * h) * (1 + c * h) - 1) / c**2  # ∫ u·e^{cu} du
    a, b = nodes
    # ℓ_0(λ_t + u) = (λ_t − b + u)/(a − b), ℓ_1(λ_t + u) = (λ_t − a + u)/(b − a)
    return [((lam_t - b) * g0 + g1) / (a - b), ((lam_t - a) * g0 + g1) / (b - a)]


def sa_weights(
    sigma: float, sigma_next: float, nodes: Sequence[float], tau: float, corrector: bool, h_prev: float | None = None
) -> tuple[float, list[float], float]:
    """(the weight of z, the weights B_i of the predictions at ``nodes`` [newest first], the noise's std) of one
    SA-Solver step from ``sigma`` to ``sigma_next`` (module docstring). ``nodes`` are λ values: the predictor's are
    λ_s (and λ_{s'}, with ``h_prev`` = λ_s − λ_{s'}), the corrector's λ_t and λ_s. Float64 arithmetic throughout."""
    if len(nodes) not in (1, 2) or (not corrector and len(nodes) == 2 and h_prev is None):
        raise ValueError(f"SA-Solver steps here are of order 1 or 2 (a second-order predictor needs h_prev): {nodes}.")
    lam_s, lam_t = flow_lambda(sigma), flow_lambda(sigma_next)
    h, c = lam_t - lam_s, 1 + tau**2
    if h <= 0:
        raise ValueError(f"An SA-Solver step runs to less noise: σ⁺ = {sigma_next} must be below σ = {sigma}.")
    alpha_t = 1 - sigma_next
    weights = [c * alpha_t * w for w in _basis_integrals(nodes, lam_t, h, c)]
    if len(nodes) == 2:  # the few-step term of SA-Solver's code
        rest = (c * h - 1 + math.exp(-c * h)) / c**2
        delta = c * alpha_t * ((h / 2 - rest / h) if corrector else (h**2 / 2 - rest) / h_prev)
        weights = [weights[0] + delta, weights[1] - delta]
    keep = math.exp(-(tau**2) * h) * sigma_next / sigma
    std = sigma_next * math.sqrt(-math.expm1(-2 * tau**2 * h))
    return keep, weights, std


def sa_step(
    z: Tensor,
    predictions: Sequence[Tensor],
    sigma: float,
    sigma_next: float,
    nodes: Sequence[float],
    tau: float,
    noise: Tensor | None,
    corrector: bool,
    h_prev: float | None = None,
) -> Tensor:
    """One SA-Solver predictor (``corrector`` False) or corrector step of z [N, ...] from ``sigma`` to
    ``sigma_next`` with the data predictions [N, ...] at ``nodes`` (newest first; :func:`sa_weights`), computed in
    float32 (float64 for float64 latents) and returned in z's dtype. ``noise`` ξ [N, ...] on z's device is needed
    only where τ > 0."""
    keep, weights, std = sa_weights(sigma, sigma_next, nodes, tau, corrector, h_prev)
    dtype = torch.promote_types(z.dtype, torch.float32)
    out = keep * z.to(dtype)
    for weight, prediction in zip(weights, predictions, strict=True):
        out = out + weight * prediction.to(dtype)
    if std > 0:
        if noise is None:
            raise ValueError("An SA-Solver step with τ > 0 needs its noise ξ.")
        out = out + std * noise.to(dtype)
    return out.to(z.dtype)
