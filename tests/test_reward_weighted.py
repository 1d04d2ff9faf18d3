"""The ``weighted`` reward: a weighted sum of registered rewards, their details, and clear errors for bad parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow import registry
from tpflow.errors import UnknownComponentError, UserError
from tpflow.types import RewardOutput

BRIGHT, LENGTH = "tpflow-test-weighted-brightness", "tpflow-test-weighted-length"
built: list[str] = []  # names of the stub rewards constructed, to prove validation builds nothing


class BrightnessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gain: float = Field(1.0, description="Multiplies the mean brightness.")


class Brightness:
    """Stub RewardModel: gain · mean pixel value, with the red channel's mean as a detail."""

    def __init__(self, options: BrightnessOptions):
        built.append(BRIGHT)
        self.gain = options.gain

    def __call__(self, images, prompts, metadata):
        red = images[:, 0].mean(dim=(1, 2))  # [N]
        return RewardOutput(scores=self.gain * images.mean(dim=(1, 2, 3)), details={"red": red})


class Length:
    """Stub RewardModel: the prompt length in characters, no details."""

    def __init__(self, options):
        built.append(LENGTH)

    def __call__(self, images, prompts, metadata):
        return RewardOutput(scores=torch.tensor([float(len(p)) for p in prompts]))


@pytest.fixture(autouse=True)
def stubs():
    registry.register("reward", BRIGHT, options=BrightnessOptions)(Brightness)
    registry.register("reward", LENGTH)(Length)
    built.clear()
    yield
    for name in (BRIGHT, LENGTH):
        registry._entries["reward"].pop(name, None)


def batch(n: int = 3):
    images = torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = ["a", "two words", "three little words"][:n]
    return images, prompts, [{}] * n


def test_weighted_sum_and_details(device):
    """On CUDA the Brightness stub returns its scores and details on the images' device: the sum is on the CPU."""
    images, prompts, metadata = batch()
    reward = registry.build(
        "reward",
        "weighted",
        rewards=[{"name": BRIGHT, "weight": 0.5, "options": {"gain": 3.0}}, {"name": LENGTH, "weight": -2.0}],
    )
    out = reward(images.to(device), prompts, metadata)
    bright = 3.0 * images.mean(dim=(1, 2, 3))
    length = torch.tensor([1.0, 9.0, 18.0])
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    assert out.scores.device.type == "cpu" and all(v.device.type == "cpu" for v in out.details.values())
    torch.testing.assert_close(out.scores, 0.5 * bright - 2.0 * length)  # a sum, not a mean
    assert set(out.details) == {BRIGHT, f"{BRIGHT}/red", LENGTH}
    torch.testing.assert_close(out.details[BRIGHT], bright)
    torch.testing.assert_close(out.details[f"{BRIGHT}/red"], images[:, 0].mean(dim=(1, 2)))
    torch.testing.assert_close(out.details[LENGTH], length)


def test_nested_weighted_and_labels():
    images, prompts, metadata = batch()
    inner = {"name": "weighted", "label": "inner", "weight": 0.25, "options": {"rewards": [{"name": BRIGHT}]}}
    reward = registry.build(
        "reward",
        "weighted",
        rewards=[inner, {"name": BRIGHT, "label": "bright2", "weight": 2.0, "options": {"gain": 2.0}}],
    )
    out = reward(images, prompts, metadata)
    mean = images.mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.scores, 0.25 * mean + 2.0 * 2.0 * mean)
    assert set(out.details) == {"inner", f"inner/{BRIGHT}", f"inner/{BRIGHT}/red", "bright2", "bright2/red"}


def test_weighted_of_a_real_reward(device):
    """Twice shapes-geneval equals shapes-geneval doubled, on rendered scenes of the shapes world (on the device)."""
    from tpflow.shapes.prompts import prompts
    from tpflow.shapes.render import render

    items = prompts("train", n=4, seed=0)
    rng = np.random.default_rng(0)
    images = torch.stack([render(item.metadata, rng) for item in items])
    texts, metadata = [i.prompt for i in items], [i.metadata for i in items]
    single = registry.build("reward", "shapes-geneval")(images, texts, metadata)
    out = registry.build("reward", "weighted", rewards=[{"name": "shapes-geneval", "weight": 2.0}])(
        images.to(device), texts, metadata
    )
    assert out.scores.device.type == "cpu" and all(v.device.type == "cpu" for v in out.details.values())
    torch.testing.assert_close(out.scores, 2.0 * single.scores)
    torch.testing.assert_close(out.details["shapes-geneval/strict"], single.details["strict"])


def test_bad_parts_fail_at_validation_without_building_anything():
    with pytest.raises(UnknownComponentError, match=rf"rewards\[1\].*Did you mean '{LENGTH}'"):
        registry.validate_options("reward", "weighted", {"rewards": [{"name": BRIGHT}, {"name": LENGTH + "x"}]})
    with pytest.raises(UserError, match="unknown option 'gian'.*did you mean 'gain'"):
        registry.validate_options("reward", "weighted", {"rewards": [{"name": BRIGHT, "options": {"gian": 1}}]})
    nested = {"name": "weighted", "options": {"rewards": [{"name": "no-such-reward"}]}}
    with pytest.raises(UnknownComponentError, match="no-such-reward"):
        registry.validate_options("reward", "weighted", {"rewards": [nested]})
    assert built == []
    with pytest.raises(UserError, match="labels must be unique"):
        registry.build("reward", "weighted", rewards=[{"name": BRIGHT}, {"name": BRIGHT}])
    with pytest.raises(UserError, match="rewards"):
        registry.build("reward", "weighted", rewards=[])
    with pytest.raises(UserError, match=r"unknown option 'rewards\.0\.wieght'"):
        registry.build("reward", "weighted", rewards=[{"name": BRIGHT, "wieght": 1.0}])
    assert built == []
