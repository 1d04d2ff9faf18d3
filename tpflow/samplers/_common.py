"""Argument handling shared by the sampler steps: plain functions, no base class (STYLE.md rule 1).

Every sampler works in float32 on the latent's device. Sigmas arrive as python floats, 0-d tensors or [N] tensors
and leave these helpers as [N] float32 vectors; ``per_row`` views such a vector as [N, 1, ..., 1] to broadcast it
against a latent [N, ...].
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.devices import randn, to_device


def check_latents(z: Tensor, v: Tensor, z_next: Tensor | None = None) -> None:
    """Raise ValueError unless z, v (and z_next) are batched latents [N, ...] of one shape."""
    if z.ndim < 2:
        raise ValueError(
            f"Latents must be batched with at least one latent dim, [N, ...]; got shape {tuple(z.shape)}. "
            "Add a trailing dim for a scalar latent (z[:, None])."
        )
    if v.shape != z.shape:
        raise ValueError(
            f"The velocity v has shape {tuple(v.shape)} but the latent z has shape {tuple(z.shape)}; "
            "they must match (chunk a CFG-doubled prediction before the step)."
        )
    if z_next is not None and z_next.shape != z.shape:
        raise ValueError(f"z_next has shape {tuple(z_next.shape)} but z has shape {tuple(z.shape)}; they must match.")


def working_dtype(z: Tensor) -> torch.dtype:
    """float32, or float64 for float64 latents: a sampler that honours it can be checked against a float64
    transcription of its reference to rounding (flow-sde, dance-sde); bf16 / fp16 latents are stepped in float32."""
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def sigma_vector(sigma: Tensor | float, z: Tensor, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """A noise level as an [N] vector of ``dtype`` on z's device (a scalar is repeated over the batch)."""
    n = z.shape[0]
    if isinstance(sigma, Tensor):
        s = to_device(sigma.to(dtype=dtype), z.device)  # a host σ: no wait for the GPU (tpflow.devices)
    else:
        s = torch.full((), sigma, dtype=dtype, device=z.device)
    if s.ndim == 0 or s.shape == (1,):
        return s.reshape(1).expand(n)
    if s.shape != (n,):
        raise ValueError(f"{name} must be a float, a 0-d tensor or a [N] = [{n}] tensor; got shape {tuple(s.shape)}.")
    return s


def checked_sigmas(
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    z: Tensor,
    leave_one: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Both noise levels as [N] vectors of ``dtype`` (float32 by default) on z's device, checked by
    ``check_sigmas``. Values that arrive on the host (floats, CPU tensors: what the rollout engine and the GRPO update
    pass) are checked there, before the copy, so a step on a GPU waits for nothing; values already on the device are
    checked there (one read)."""
    exact = torch.float64 if dtype == torch.float64 else None  # a python float keeps its digits in float64
    host = [x if isinstance(x, Tensor) else torch.tensor(x, device="cpu", dtype=exact) for x in (sigma, sigma_next)]
    if all(x.device.type == "cpu" for x in host):
        s, s_next = sigma_vector(host[0], z, "sigma", dtype), sigma_vector(host[1], z, "sigma_next", dtype)
        check_sigmas(host[0].float().reshape(-1), host[1].float().reshape(-1), leave_one)  # a scalar broadcasts
        return s, s_next
    s, s_next = sigma_vector(sigma, z, "sigma", dtype), sigma_vector(sigma_next, z, "sigma_next", dtype)
    check_sigmas(s, s_next, leave_one)
    return s, s_next


def check_sigmas(sigma: Tensor, sigma_next: Tensor, leave_one: bool = False) -> None:
    """Raise ValueError unless 0 <= sigma_next <= sigma <= 1 elementwise ([N] float32 each) and, with
    ``leave_one``, no step goes from σ = 1 to σ⁺ = 1 (flow-sde's σ = 1 guard needs σ⁺ < 1). One host read."""
    out_of_range = ((sigma < 0) | (sigma > 1) | (sigma_next < 0)).any()
    reversed_pair = (sigma_next > sigma).any()
    stuck = ((sigma == 1) & (sigma_next == 1)).any() if leave_one else torch.zeros_like(out_of_range)
    out_of_range, reversed_pair, stuck = torch.stack([out_of_range, reversed_pair, stuck]).tolist()
    if out_of_range:
        raise ValueError(
            f"Noise levels must lie in [0, 1]; got sigma={sigma.tolist()}, sigma_next={sigma_next.tolist()}."
        )
    if reversed_pair:
        raise ValueError(
            f"sigma_next must not exceed sigma (the reverse process goes from noise, σ=1, to data, σ=0); got "
            f"sigma={sigma.tolist()}, sigma_next={sigma_next.tolist()}. Pass the pair in generation order."
        )
    if stuck:
        raise ValueError(
            "flow-sde: a step starting at sigma = 1 must end below 1, because the σ = 1 guard of "
            "docs/algorithm.md §1.4 takes σ̄ from sigma_next to avoid dividing by 1 − σ = 0."
        )


def per_row(x: Tensor, z: Tensor) -> Tensor:
    """View an [N] vector as [N, 1, ..., 1] to broadcast against z [N, ...]."""
    return x.view(-1, *([1] * (z.ndim - 1)))


def mean_over_latent(x: Tensor) -> Tensor:
    """[N, ...] -> [N], the mean over every non-batch dim (the reference averages, it does not sum)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def draw_noise(z: Tensor, generator: torch.Generator | None, noise: Tensor | None) -> Tensor:
    """ξ ~ N(0, I) of z's shape, float32 on z's device: ``noise`` when given, else a draw from ``generator`` on the
    generator's own device, moved to z's (``tpflow.devices.randn``: a CPU generator gives the same ξ on every
    device; the CPU's global RNG when None)."""
    if noise is not None:
        if noise.shape != z.shape:
            raise ValueError(
                f"noise has shape {tuple(noise.shape)} but z has shape {tuple(z.shape)}; they must match."
            )
        return noise.to(device=z.device, dtype=torch.float32)
    return randn(z.shape, generator, z.device)
