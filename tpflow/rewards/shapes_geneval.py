"""Reward ``shapes-geneval``: the GenEval scorer fed by the shapes world's rule-based detector.

    [reward]
    name = "shapes-geneval"
    score = "partial"    # or "strict", or "soft"
    strict_count = true  # on counting prompts, an asked-class detection above 0.3 counts against the number

The detector (``tpflow.shapes.detect``) finds coloured circles, squares and triangles; the scorer
(``tpflow.rewards.geneval.scoring``) judges them against each prompt's GenEval metadata exactly as it judges the
real detector's output. ``score = "soft"`` is the continuous variant of the partial credit
(``tpflow.rewards.geneval.soft``: soft counts from the detection confidences, colour and position terms). CPU only,
a few thousand images per second.

``strict_count`` (on by default here, off in the generic scorer and the ``geneval`` reward): GenEval keeps a
detection on a counting prompt only above confidence 0.9, and this detector finds a malformed extra object of the
asked class at 0.3 to 0.9, so "three triangles" with four drawn passed. With it, such a detection counts against
the asked number (``scoring.score``). On the renderer's own scenes it agrees with the truth wherever GenEval's rule
does, and more often under heavy blur and noise; on model samples it fails exactly the images that passed through
the gap (docs/shapes.md, "The counting threshold").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.registry import register
from tpflow.rewards.geneval.verdicts import GENEVAL_METADATA, SCORE_DESCRIPTION, ScoreName, verdicts
from tpflow.shapes.detect import detect_batch
from tpflow.types import RewardOutput


class ShapesGenevalOptions(BaseModel):
    """Options of the shapes GenEval reward."""

    model_config = ConfigDict(extra="forbid")

    score: ScoreName = Field("partial", description=SCORE_DESCRIPTION)
    strict_count: bool = Field(
        True,
        description="On counting prompts, count every detection of the asked class above confidence 0.3 against the "
        "asked number (the prompt still needs that many above 0.9): a malformed extra object, which this detector "
        "finds at 0.3-0.9, then fails the count. False: GenEval's rule, which drops it (docs/shapes.md, 'The counting "
        "threshold').",
    )


@register("reward", "shapes-geneval", options=ShapesGenevalOptions)
class ShapesGenevalReward:
    """RewardModel: GenEval on rule-based detections of the shapes world.

    Options: ``score`` ("partial", "strict" or "soft"), which verdict becomes ``scores``; ``strict_count``, whether
    a counting prompt's low-confidence detections of the asked class count against its number. ``details`` always
    holds ``strict`` and ``correct`` (0/1 each), ``partial`` and ``soft``. Stateless, so safe to call from several
    threads.
    """

    needs_metadata = GENEVAL_METADATA  # each prompt's GenEval tag and include clauses (tpflow.rewards.needs)

    def __init__(self, options: ShapesGenevalOptions | None = None):
        self.options = options or ShapesGenevalOptions()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] against their GenEval metadata; ``scores`` [N] float32."""
        if len(images) != len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(metadata)} metadata entries.")
        size = (images.shape[-2], images.shape[-1])
        return verdicts(detect_batch(images), metadata, size, self.options.score, self.options.strict_count)
