"""Reward ``shapes-geneval``: the GenEval scorer fed by the shapes world's rule-based detector.

    [reward]
    name = "shapes-geneval"
    score = "partial"    # or "strict", or "soft"

The detector (``tpflow.shapes.detect``) finds coloured circles, squares and triangles; the scorer
(``tpflow.rewards.geneval.scoring``) judges them against each prompt's GenEval metadata exactly as it judges the
real detector's output. ``score = "soft"`` is the continuous variant of the partial credit
(``tpflow.rewards.geneval.soft``: soft counts from the detection confidences, colour and position terms). CPU only,
a few thousand images per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.registry import register
from tpflow.rewards.geneval.verdicts import SCORE_DESCRIPTION, ScoreName, verdicts
from tpflow.shapes.detect import detect_batch
from tpflow.types import RewardOutput


class ShapesGenevalOptions(BaseModel):
    """Options of the shapes GenEval reward."""

    model_config = ConfigDict(extra="forbid")

    score: ScoreName = Field("partial", description=SCORE_DESCRIPTION)


@register("reward", "shapes-geneval", options=ShapesGenevalOptions)
class ShapesGenevalReward:
    """RewardModel: GenEval on rule-based detections of the shapes world.

    Options: ``score`` ("partial", "strict" or "soft"), which verdict becomes ``scores``. ``details`` always holds
    ``strict`` and ``correct`` (0/1 each), ``partial`` and ``soft``. Stateless, so safe to call from several threads.
    """

    def __init__(self, options: ShapesGenevalOptions | None = None):
        self.options = options or ShapesGenevalOptions()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] against their GenEval metadata; ``scores`` [N] float32."""
        if len(images) != len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(metadata)} metadata entries.")
        size = (images.shape[-2], images.shape[-1])
        return verdicts(detect_batch(images), metadata, size, self.options.score)
