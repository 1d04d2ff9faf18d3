"""Reward ``example-saturation``: how colourful an image is (HSV saturation), or how close to a target.

    [reward]
    name = "example-saturation"
    target = 0.3        # optional: reward closeness to a mean saturation of 0.3 instead of "more is better"

A small, self-contained example of a third-party reward; the entry point in pyproject.toml is all tpflow needs.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow import register
from tpflow.types import RewardOutput


class SaturationOptions(BaseModel):
    """Options of the saturation reward."""

    model_config = ConfigDict(extra="forbid")

    target: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Mean saturation to aim for: the score is -|saturation - target|. None: the score is the "
        "saturation itself (more colour is better).",
    )


@register("reward", "example-saturation", options=SaturationOptions)
class SaturationReward:
    """RewardModel: mean HSV saturation (max - min) / max over the pixels of each image.

    Options: ``target`` (module docstring). ``details["saturation"]`` always holds the measured saturation.
    Stateless and cheap, so safe to call from any thread.
    """

    def __init__(self, options: SaturationOptions | None = None):
        self.options = options or SaturationOptions()

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1]; ``scores`` [N] float32 (prompts and metadata are not needed)."""
        pixels = (images.detach().float().clamp(0, 1) * 255).round() / 255  # the 8-bit image a user would see
        high, low = pixels.amax(dim=1), pixels.amin(dim=1)  # [N, H, W] each
        saturation = torch.where(high > 0, (high - low) / high.clamp_min(1e-12), 0.0).mean(dim=(1, 2))  # [N]
        target = self.options.target
        scores = saturation if target is None else -(saturation - target).abs()
        return RewardOutput(scores=scores, details={"saturation": saturation})
