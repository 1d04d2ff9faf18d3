"""Reward ``shapes-geneval``: the GenEval scorer fed by the shapes world's rule-based detector.

    [reward]
    name = "shapes-geneval"
    score = "partial"    # or "strict"

The detector (``tpflow.shapes.detect``) finds coloured circles, squares and triangles; the scorer
(``tpflow.rewards.geneval.scoring``) judges them against each prompt's GenEval metadata exactly as it judges the
real detector's output. CPU only, a few thousand images per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.registry import register
from tpflow.rewards.geneval.scoring import score
from tpflow.shapes.detect import detect_batch
from tpflow.types import RewardOutput


class ShapesGenevalOptions(BaseModel):
    """Options of the shapes GenEval reward."""

    model_config = ConfigDict(extra="forbid")

    score: Literal["partial", "strict"] = Field(
        "partial",
        description="Training reward: the partial-credit GenEval score (the reference's reward) or strict "
        "correctness (0/1).",
    )


@register("reward", "shapes-geneval", options=ShapesGenevalOptions)
class ShapesGenevalReward:
    """RewardModel: GenEval on rule-based detections of the shapes world.

    Options: ``score`` ("partial" or "strict"), which verdict becomes ``scores``. ``details`` always holds
    ``strict`` and ``correct`` (0/1 each) and ``partial``. Stateless, so safe to call from several threads.
    """

    def __init__(self, options: ShapesGenevalOptions | None = None):
        self.options = options or ShapesGenevalOptions()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] against their GenEval metadata; ``scores`` [N] float32."""
        if len(images) != len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(metadata)} metadata entries.")
        size = (images.shape[-2], images.shape[-1])
        results = [score(found, meta, size) for found, meta in zip(detect_batch(images), metadata, strict=True)]
        partial = torch.tensor([r.score for r in results], dtype=torch.float32, device="cpu")  # [N]
        strict = torch.tensor([float(r.strict_correct) for r in results], dtype=torch.float32, device="cpu")  # [N]
        correct = torch.tensor([float(r.correct) for r in results], dtype=torch.float32, device="cpu")  # [N]
        scores = partial if self.options.score == "partial" else strict
        return RewardOutput(scores=scores, details={"strict": strict, "correct": correct, "partial": partial})
