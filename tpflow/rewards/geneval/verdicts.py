"""One image batch's GenEval verdicts as a ``RewardOutput``: shared by ``geneval`` and ``shapes-geneval``, which
differ only in their detector.

``details`` always holds ``strict`` and ``correct`` (0/1 each), ``partial`` (GenEval's partial credit) and ``soft``
(the continuous partial credit of ``soft.py``); ``scores`` is the one the recipe's ``score`` option names. An item
whose metadata has no ``include`` clause (a prompt without GenEval metadata: ``tpflow eval --prompts FILE``) asks
nothing of its image: its ``strict`` and ``correct`` are NaN, not a vacuous 1 (an accuracy over no check is not a
number), and its partial credits 0. A recipe check refuses such prompts for training before anything loads
(``tpflow.rewards.needs``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from tpflow.rewards.geneval.scoring import DetectionLike, score
from tpflow.rewards.geneval.soft import soft_score
from tpflow.types import RewardOutput

ScoreName = Literal["partial", "strict", "soft"]
GENEVAL_METADATA = ("tag", "include")  # what both rewards read of each prompt (needs_metadata: tpflow.rewards.needs)
SCORE_DESCRIPTION = (
    "Training reward: the partial-credit GenEval score (the reference's reward), strict correctness (0/1), or "
    "'soft': a continuous partial credit (soft counts from the detection confidences, colour and position terms; "
    "tpflow/rewards/geneval/soft.py) that ties less often within a group."
)


def verdicts(
    detections: Sequence[Sequence[DetectionLike]],
    metadata: Sequence[dict[str, Any]],
    size: tuple[int, int],
    which: ScoreName,
    strict_count: bool = False,
) -> RewardOutput:
    """Score each image's detections against its metadata; ``size`` = (H, W) of the images. ``strict_count``: on
    counting prompts, detections of the asked class above 0.3 count against the asked number (``scoring.score``)."""
    results = [score(found, meta, size, strict_count) for found, meta in zip(detections, metadata, strict=True)]
    checked = [bool(meta.get("include")) for meta in metadata]  # an item without include clauses checks nothing
    details = {
        "strict": [float(r.strict_correct) if c else math.nan for r, c in zip(results, checked, strict=True)],
        "correct": [float(r.correct) if c else math.nan for r, c in zip(results, checked, strict=True)],
        "partial": [r.score for r in results],
        "soft": [soft_score(found, meta, size) for found, meta in zip(detections, metadata, strict=True)],
    }
    tensors = {k: torch.tensor(v, dtype=torch.float32, device="cpu") for k, v in details.items()}  # [N] each
    return RewardOutput(scores=tensors[which], details=tensors)
