"""Reward ``image-stat``: a pixel statistic of the image (brightness, saturation or contrast), no model at all.

    [reward]
    name = "image-stat"
    statistic = "brightness"

Not a task reward: it exists for smoke runs and debugging (``recipes/tiny_smoke.toml``), where images from a
randomly initialised model carry no objects or text but do differ in these statistics, so GRPO has a signal. It
is also the smallest example of the RewardModel interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.registry import register
from tpflow.types import RewardOutput


class ImageStatOptions(BaseModel):
    """Which statistic, and its sign."""

    model_config = ConfigDict(extra="forbid")

    statistic: Literal["brightness", "saturation", "contrast"] = Field(
        "brightness",
        description="brightness: mean of RGB; saturation: mean of max(RGB) - min(RGB); contrast: std of the grey "
        "image. All in [0, 1].",
    )
    maximize: bool = Field(True, description="Reward a high value (true) or a low one (false: score = 1 - value).")


@register("reward", "image-stat", options=ImageStatOptions)
class ImageStatReward:
    """RewardModel: ``scores`` [N] float32 in [0, 1]; ``details`` holds the raw statistic. Stateless, thread-safe."""

    def __init__(self, options: ImageStatOptions | None = None) -> None:
        self.options = options or ImageStatOptions()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        x = images.float().clamp(0, 1)  # [N, 3, H, W]
        if self.options.statistic == "brightness":
            value = x.mean(dim=(1, 2, 3))
        elif self.options.statistic == "saturation":
            value = (x.amax(dim=1) - x.amin(dim=1)).mean(dim=(1, 2))
        else:
            value = x.mean(dim=1).flatten(1).std(dim=1, unbiased=False)
        scores = value if self.options.maximize else 1 - value
        return RewardOutput(scores=scores.cpu(), details={self.options.statistic: value.cpu()})
