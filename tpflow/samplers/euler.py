"""The deterministic flow-matching ODE step (docs/algorithm.md §1.3), used by the ODE parts of rollouts."""

from __future__ import annotations

from torch import Tensor

from tpflow.samplers._common import check_latents, per_row, sigma_vector


def euler_step(z: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float) -> Tensor:
    """One Euler step of dz/dσ = v from ``sigma`` to ``sigma_next``: ``z + (σ⁺ − σ)·v``.

    Computed in float32 and cast back to ``z.dtype``, like diffusers' ``FlowMatchEulerDiscreteScheduler.step``.
    Both samplers reproduce this bit for bit at ``noise_level = 0``.

    Args:
        z: [N, ...] latent at noise level ``sigma``.
        v: [N, ...] velocity prediction v_θ(z, σ).
        sigma: noise level of ``z``: float, 0-d or [N].
        sigma_next: noise level to step to (< sigma): float, 0-d or [N].

    Returns:
        [N, ...] the latent at ``sigma_next``, in ``z.dtype``.
    """
    check_latents(z, v)
    s = per_row(sigma_vector(sigma, z, "sigma"), z)  # [N, 1, ...]
    s_next = per_row(sigma_vector(sigma_next, z, "sigma_next"), z)
    return (z.float() + (s_next - s) * v.float()).to(z.dtype)
