"""The example reward on images whose saturation is known by construction."""

from __future__ import annotations

import pytest
import torch
from tpflow_example_reward import SaturationReward

import tpflow
from tpflow.errors import UserError


def _images() -> torch.Tensor:
    """[4, 3, 8, 8]: white, mid grey, pure red, left half red / right half white."""
    images = torch.ones(4, 3, 8, 8)
    images[1] = 0.5
    images[2, 1:] = 0.0
    images[3, 1:, :, :4] = 0.0
    return images


def test_saturation_of_known_images():
    out = SaturationReward()(_images(), [""] * 4, [{}] * 4)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (4,)
    assert torch.allclose(out.scores, torch.tensor([0.0, 0.0, 1.0, 0.5]))
    assert torch.equal(out.details["saturation"], out.scores)
    assert SaturationReward()(torch.zeros(1, 3, 4, 4), [""], [{}]).scores.item() == 0.0  # black: no NaN


def test_built_by_name_with_a_target():
    reward = tpflow.build("reward", "example-saturation", target=0.5)
    out = reward(_images(), [""] * 4, [{}] * 4)
    assert torch.allclose(out.scores, torch.tensor([-0.5, -0.5, -0.5, 0.0]))  # the half-red image is on target
    assert torch.allclose(out.details["saturation"], torch.tensor([0.0, 0.0, 1.0, 0.5]))
    with pytest.raises(UserError, match="target"):
        tpflow.build("reward", "example-saturation", target=2.0)
