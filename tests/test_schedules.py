"""Sigma schedules against the tables of docs/algorithm.md §1.2 (from diffusers' FlowMatchEulerDiscreteScheduler).

FLUX's schedule is the one ``FluxBackbone.sigmas`` computes (``scheduler_sigmas`` of its pipeline's scheduler); that
it equals what ``FluxPipeline`` itself sets is checked against a pipeline run in test_backbones_diffusers.py.
"""

from __future__ import annotations

import pytest
import torch

from tpflow.backbones.diffusers_common import scheduler_sigmas
from tpflow.samplers import sd3_sigmas

# The tables are rounded to 5 decimals (error <= 5e-6) and the schedules are float32; atol 1e-5 covers both.
ATOL = 1e-5
# FLUX.1-dev's scheduler/scheduler_config.json (tiny-flux builds the same scheduler)
FLUX1_DEV_SCHEDULER = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def flux_sigmas(num_steps: int, image_seq_len: int = 1024) -> torch.Tensor:
    """FLUX.1-dev's schedule for ``image_seq_len`` packed latent tokens (1024 at 512²), as its backbone computes it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX1_DEV_SCHEDULER)
    return scheduler_sigmas(scheduler, num_steps, image_seq_len, flux_style=True)


def test_sd3_k10_table():
    expected = [1.0, 0.96013, 0.91335, 0.85769, 0.79037, 0.70728, 0.60215, 0.46488, 0.27805, 0.00893, 0.0]
    sigmas = sd3_sigmas(10)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    torch.testing.assert_close(sigmas, torch.tensor(expected), atol=ATOL, rtol=0)
    torch.testing.assert_close(1000 * sigmas[:10][[1, 9]], torch.tensor([960.129, 8.929]), atol=1e-3, rtol=0)


def test_sd3_k40_ends():
    sigmas = sd3_sigmas(40)
    assert sigmas.shape == (41,) and sigmas[0] == 1 and sigmas[40] == 0
    torch.testing.assert_close(sigmas[[1, 39]], torch.tensor([0.99133, 0.00893]), atol=ATOL, rtol=0)
    assert (sigmas[1:] < sigmas[:-1]).all()


def test_flux_k6_table():
    sigmas = flux_sigmas(6)
    expected = [1.0, 0.90374, 0.78970, 0.65249, 0.48422, 0.27300, 0.0]
    assert sigmas.dtype == torch.float32 and sigmas.shape == (7,)
    torch.testing.assert_close(sigmas, torch.tensor(expected), atol=ATOL, rtol=0)


def test_flux_shift_grows_with_resolution():
    assert (flux_sigmas(6, image_seq_len=4096)[1:-1] > flux_sigmas(6)[1:-1]).all()


@pytest.mark.parametrize("fn", [sd3_sigmas, flux_sigmas])
@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_num_steps_must_be_a_positive_integer(fn, bad):
    with pytest.raises(ValueError, match="num_steps"):
        fn(bad)
