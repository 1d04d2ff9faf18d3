"""The SD3.5 inference sigma schedule σ_0 = 1 > … > σ_K = 0 (docs/algorithm.md §1.2), for scheduler-less backbones.

It is taken from diffusers' ``FlowMatchEulerDiscreteScheduler`` rather than re-derived, so quirks such as SD3's
doubly shifted lower end are reproduced. diffusers is imported inside the function because it is slow to import.
The diffusers backbones (SD3.5, FLUX.1 with its resolution-dependent shift) read theirs from their pipeline's own
scheduler: ``tpflow.backbones.diffusers_common.scheduler_sigmas``.
"""

from __future__ import annotations

from torch import Tensor


def check_num_steps(num_steps: int) -> None:
    """Raise ValueError unless ``num_steps`` is an integer >= 1."""
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
    check_num_steps(num_steps)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float().clone()


def flow_sigmas(num_steps: int, shift: float = 3.0) -> Tensor:
    """diffusers' ``use_flow_sigmas`` grid (``DPMSolverMultistepScheduler``, ``SASolverScheduler``):
    σ_j = φ(0.999·(1 − j/K)) for j = 0..K − 1 with φ(u) = shift·u/(1 + (shift − 1)·u), then σ_K = 0, computed in
    float64 and stored in float32 as diffusers stores it. σ_0 = φ(0.999) < 1 (0.99967 at shift 3), so λ = log(α/σ)
    is finite at every node; the grid is not SD3's own (``sd3_sigmas``), which starts at 1.

    Returns:
        [K + 1] float32 sigmas, the terminal 0 included.
    """
    check_num_steps(num_steps)
    import numpy as np
    import torch

    u = 1.0 - np.linspace(1, 1 / 1000, num_steps + 1)  # diffusers' num_train_timesteps = 1000
    sigmas = np.flip(shift * u / (1 + (shift - 1) * u))[:-1]
    values = np.concatenate([sigmas, [0.0]]).astype(np.float32).tolist()
    return torch.tensor(values, dtype=torch.float32, device="cpu")  # a host schedule, as the backbones' own
