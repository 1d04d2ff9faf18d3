"""Reward ``frames``: an image reward applied to clips frame by frame, then aggregated per clip.

    [reward]
    name = "frames"
    reward = "pickscore"        # any registered image reward, with its options
    options = {}
    frames = "every"            # all | every (every k-th, from the first) | first | middle | last | ends
    every = 4
    aggregate = "mean"          # or "min": a clip is as good as its worst frame

A video backbone (Wan) decodes clips [N, F, 3, H, W]; an image reward scores [M, 3, H, W]. This reward picks the
frames, scores them all in one call of the image reward (M = N·f rows, each with its clip's prompt and metadata),
and aggregates the f scores of each clip: the mean (flow_grpo's and DanceGRPO's video rewards average over frames)
or the minimum. ``details`` are aggregated alike. Images [N, 3, H, W] are clips of one frame, so a recipe can use
it on either kind of backbone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow import registry
from tpflow.registry import register
from tpflow.rewards.inner import checked_inner
from tpflow.scoring.call import check_output
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource


class FramesOptions(BaseModel):
    """Options of the frame-wise clip reward."""

    model_config = ConfigDict(extra="forbid")

    reward: str = Field(..., description="The image reward applied to each frame (a registered reward name).")
    options: dict[str, Any] = Field(default_factory=dict, description="That reward's own options.")
    frames: Literal["all", "every", "first", "middle", "last", "ends"] = Field(
        "all",
        description="Which frames are scored: all, every k-th from the first ('every'), the first, the middle, the "
        "last, or the first and last ('ends').",
    )
    every: int = Field(4, ge=1, description="k of frames = 'every'.")
    aggregate: Literal["mean", "min"] = Field("mean", description="How a clip's frame scores combine.")

    @model_validator(mode="after")
    def _check_inner(self) -> FramesOptions:
        if self.reward == "frames":
            raise ValueError("a 'frames' reward cannot wrap another 'frames' reward")
        checked_inner(self.reward, self.options, f"reward 'frames' (its reward {self.reward!r})")
        return self


def frame_indices(frames: int, which: str, every: int = 1) -> list[int]:
    """The frames of a clip of ``frames`` that ``which`` scores, in order."""
    picks = {
        "all": range(frames),
        "every": range(0, frames, every),
        "first": [0],
        "middle": [frames // 2],
        "last": [frames - 1],
        "ends": sorted({0, frames - 1}),
    }
    return list(picks[which])


@register("reward", "frames", options=FramesOptions)
class FramesReward:
    """RewardModel over clips: the wrapped image reward on the chosen frames, aggregated per clip.

    ``scores`` [N] float32 on the CPU; ``details`` the image reward's details aggregated alike."""

    accepts_clips = True  # a video backbone's recipe needs a reward that does (tpflow.recipe)

    @staticmethod
    def reward_parts(options: FramesOptions) -> list[tuple[str, str, dict[str, Any], bool]]:
        """Its image reward, given single frames (``tpflow.interfaces.CAPABILITIES``)."""
        return [("reward", options.reward, options.options, True)]

    def __init__(self, options: FramesOptions):
        self.options = options
        self.inner = registry.build("reward", options.reward, **options.options)

    @staticmethod
    def weight_sources(options: FramesOptions, settings: dict) -> list[WeightSource]:
        """The wrapped reward's weights (``tpflow.weights``)."""
        from tpflow.weights import component_weights

        factory = registry.get("reward", options.reward).factory
        validated = registry.validate_options("reward", options.reward, options.options)
        return list(component_weights(factory, validated, settings))

    @staticmethod
    def preflight(options: FramesOptions) -> None:
        """The wrapped reward's preflight (a remote reward checks its server)."""
        registry.preflight(
            "reward", options.reward, registry.validate_options("reward", options.reward, options.options)
        )

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score clips [N, F, 3, H, W] (or images [N, 3, H, W]: clips of one frame) in [0, 1]."""
        clips = images[:, None] if images.ndim == 4 else images
        n, count = clips.shape[:2]
        picked = frame_indices(count, self.options.frames, self.options.every)
        f = len(picked)
        flat = clips[:, picked].flatten(0, 1)  # [N·f, 3, H, W], clip-major
        rows_prompts = [p for p in prompts for _ in range(f)]
        rows_meta = [m for m in metadata for _ in range(f)]
        scores, details = check_output(self.inner(flat, rows_prompts, rows_meta), n * f, self.options.reward)
        combine = self._aggregate
        return RewardOutput(scores=combine(scores, n, f), details={k: combine(v, n, f) for k, v in details.items()})

    def _aggregate(self, values: Tensor, n: int, f: int) -> Tensor:
        per_clip = values.view(n, f)  # [N, f]
        return per_clip.mean(dim=1) if self.options.aggregate == "mean" else per_clip.min(dim=1).values
