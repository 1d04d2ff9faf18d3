"""Inference sigma schedules σ_0 = 1 > … > σ_K = 0 of SD3.5 and FLUX.1 (docs/algorithm.md §1.2).

Both are taken from diffusers' ``FlowMatchEulerDiscreteScheduler`` rather than re-derived, so quirks such as SD3's
doubly shifted lower end are reproduced. diffusers is imported inside the functions because it is slow to import.
"""

from __future__ import annotations

from torch import Tensor


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1 (e.g. 10 for SD3 rollouts); got {num_steps!r}.")


def sd3_sigmas(num_steps: int, shift: float = 3.0) -> Tensor:
    """SD3.5's schedule: ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)``.

    Args:
        num_steps: K, the number of denoising steps.
        shift: the static time shift φ(u) = shift·u / (1 + (shift − 1)·u); 3.0 for SD3.5-M.

    Returns:
        [K + 1] float32 sigmas, the terminal 0 included (K = 10: 1.0, 0.96013, …, 0.00893, 0).
    """
    _check_num_steps(num_steps)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float().clone()


def flux_sigmas(
    num_steps: int,
    image_seq_len: int = 1024,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> Tensor:
    """FLUX.1's resolution-dependent schedule, as ``FluxPipeline`` sets it.

    ``u = linspace(1, 1/K, K)`` is passed as sigmas with the exponential time shift
    ``σ = e^μ / (e^μ + 1/u − 1)``, where μ is linear in the packed image sequence length
    (``calculate_shift`` of the FLUX pipeline, computed here to avoid importing the pipeline and transformers).

    Args:
        num_steps: K, the number of denoising steps.
        image_seq_len: packed latent tokens, (H/16)·(W/16); 1024 at 512², giving μ = 0.63.
        base_seq_len: sequence length at which μ = ``base_shift``.
        max_seq_len: sequence length at which μ = ``max_shift``.
        base_shift: μ at ``base_seq_len``.
        max_shift: μ at ``max_seq_len``.

    Returns:
        [K + 1] float32 sigmas, the terminal 0 included (K = 6: 1.0, 0.90374, …, 0.27300, 0).
    """
    _check_num_steps(num_steps)
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    mu = image_seq_len * slope + (base_shift - slope * base_seq_len)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=base_shift,
        max_shift=max_shift,
        base_image_seq_len=base_seq_len,
        max_image_seq_len=max_seq_len,
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.float().clone()
