"""DPM-Solver++(2M) for a flow model, data-prediction form: MixGRPO-Flash's solver after the SDE window.

With a rectified flow z_σ = (1 − σ)·x_0 + σ·ε, α_σ = 1 − σ, λ = log(α/σ) and the data prediction x̂_0 = z − σ·v,
one multistep step from σ_s to σ_t (h = λ_t − λ_s) with the previous node's prediction x̂_0' at σ_s' (h' = λ_s − λ_s')
is, in diffusers' ``DPMSolverMultistepScheduler`` (``algorithm_type="dpmsolver++"``, ``solver_order=2``,
``solver_type="midpoint"``):

    z_t = (σ_t/σ_s)·z − α_t·(e^{−h} − 1)·(D0 + ½·D1),   D0 = x̂_0,   D1 = (x̂_0 − x̂_0')·h / h'

and the first-order step (no previous prediction, or σ_t = 0, where the step lands on D0 exactly) drops D1. MixGRPO
(docs/algorithm.md §10.5, ``multistep_dpm_solver_second_order_update``) writes the same update and seeds the history
with the last window step's x̂_0. ``tests/test_samplers.py`` checks these steps against diffusers' scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def _lam(sigma: float) -> float:
    """λ = log((1 − σ)/σ) for 0 < σ < 1."""
    return math.log((1 - sigma) / sigma)


def dpm_solver_2m_step(
    z: Tensor,
    x0: Tensor,
    sigma: float,
    sigma_next: float,
    x0_prev: Tensor | None = None,
    sigma_prev: float | None = None,
) -> Tensor:
    """One DPM-Solver++(2M) step of z [N, ...] at σ = ``sigma`` to ``sigma_next`` (module docstring), float32 inside
    (float64 for float64 latents, so that a float64 check is one), returned in z's dtype. ``x0`` is x̂_0 at σ;
    ``x0_prev`` the one at ``sigma_prev`` (the node before), or None for the first-order step. σ⁺ = 0 returns x̂_0
    (the step's exact limit)."""
    if not 0 <= sigma_next < sigma < 1 or (sigma_prev is not None and not sigma < sigma_prev <= 1):
        raise ValueError(f"DPM-Solver steps need 0 <= σ⁺ < σ < σ_prev <= 1 and σ < 1; got {sigma_prev}, {sigma}, "
                         f"{sigma_next}.")  # fmt: skip
    if sigma_next == 0:
        return x0.to(z.dtype)
    h = _lam(sigma_next) - _lam(sigma)
    alpha_next = 1 - sigma_next
    factor = math.expm1(-h)  # e^{−h} − 1
    dtype = torch.promote_types(z.dtype, torch.float32)
    out = (sigma_next / sigma) * z.to(dtype) - alpha_next * factor * x0.to(dtype)
    if x0_prev is not None and sigma_prev is not None and sigma_prev < 1:
        ratio = (_lam(sigma) - _lam(sigma_prev)) / h  # r0 = h' / h
        out = out - 0.5 * alpha_next * factor * (x0.to(dtype) - x0_prev.to(dtype)) / ratio
    return out.to(z.dtype)


def data_prediction(z: Tensor, v: Tensor, sigma: float) -> Tensor:
    """x̂_0 = z − σ·v of a flow-matching velocity, in float32 (float64 for float64 latents)."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    return z.to(dtype) - sigma * v.to(dtype)


def dpm_solver_2m(x0_of: Callable[[Tensor, float], Tensor], z: Tensor, nodes: list[float]) -> Tensor:
    """DPM-Solver++(2M) of z [N, ...] from nodes[0] down to nodes[-1] = 0: ``x0_of(z, σ)`` (one velocity call, x̂_0 =
    z − σ·v) at every node but the last, the first step first order (the Euler step when σ_0 = 1, where λ = −∞),
    every later one second order on the previous node's x̂_0, the last returning x̂_0. The rollout's solver plan and
    the evaluation's ``solver = "dpm-solver++"`` both run it."""
    x0_prev, sigma_prev = None, None
    for sigma, sigma_next in zip(nodes, nodes[1:], strict=False):
        x0 = x0_of(z, sigma)
        if sigma == 1:  # λ = −∞: the first-order step's limit σ⁺·z + (1 − σ⁺)·x̂_0, the Euler step
            z = (sigma_next * z.to(x0.dtype) + (1 - sigma_next) * x0).to(z.dtype)
        else:
            z = dpm_solver_2m_step(z, x0, sigma, sigma_next, x0_prev, sigma_prev)
        x0_prev, sigma_prev = x0, sigma
    return z


def compressed_tail(sigmas_fine: Tensor, num_steps: int, after: int, nodes: int) -> list[float]:
    """MixGRPO-Flash's post-window schedule: ``nodes`` σ from σ_after down to 0, evenly spaced in the schedule's
    unshifted time and then mapped through the backbone's own schedule, read off its schedule at
    M = num_steps·(nodes − 1) steps (``sigmas_fine``, [M + 1]), where node j sits at grid index
    after·(nodes − 1) + j·(num_steps − after): exact for a static time shift."""
    fine = sigmas_fine.tolist()
    if len(fine) != num_steps * (nodes - 1) + 1:
        raise ValueError(f"sigmas_fine must have num_steps·(nodes − 1) + 1 = {num_steps * (nodes - 1) + 1} entries.")
    return [fine[after * (nodes - 1) + j * (num_steps - after)] for j in range(nodes)]


def post_window_nodes(num_steps: int, window_end: int, ratio: float) -> int:
    """n = int(max((K − e)·ρ, 1)) σ nodes after the window's last step e = ``window_end`` − 1 (MixGRPO-Flash), at
    least 2 (one step to σ = 0)."""
    return max(int(max((num_steps - (window_end - 1)) * ratio, 1)), 2)
