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
