"""A continuous GenEval-style score: the partial credit of ``scoring.py`` with soft counts, colours and positions.

Why: GenEval's partial credit is a step function of the detections. Within a group of images of one prompt it takes
a handful of values, so many groups tie (zero advantage, no gradient) and the incremental rewards d_i of TP-GRPO are
mostly exactly 0. This score moves with the detector's confidences and the objects' positions, and equals 1 exactly
when every asked object is detected with full confidence in the asked colour and, with a margin, in the asked
relation (which GenEval's strict rule then also accepts).

Per include clause ``{class c, count n, color?, position?}``, with ``s_j`` the detection scores in [0, 1] (every
detection, no threshold: a weak detection counts weakly):

* count term ``max(0, 1 − |n̂ − n| / n)`` with the soft count ``n̂ = Σ_{j: cls_j = c} s_j``;
* colour term (when asked) ``max(0, 1 − |n̂_col − n| / n)`` with ``n̂_col`` the soft count of class c in that colour;
* position term (when asked, relative to clause k): for the most confident detection a of class c and b of clause
  k's class, ``min(s_a, s_b) · ramp(ρ)``, where ρ is GenEval's direction ratio of ``scoring.relative_position``
  along the asked axis (the reduced centre offset over its length, signed so that the asked relation is positive)
  and ramp rises linearly from 0 at ρ = 0.3 to 1 at ρ = 0.6 (GenEval accepts ρ > 0.5; the renderer draws ρ ≥ 0.6).

The score is the mean of all terms of all clauses, as GenEval's partial credit is the mean of its credits. Exclude
clauses are not scored (the count term already penalises an extra object, as in GenEval's partial credit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tpflow.boxes import direction
from tpflow.rewards.geneval.scoring import DetectionLike, clip_to_image

RAMP = (0.3, 0.6)  # direction ratio at which the position term starts to rise, and where it reaches 1
_AXES = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}  # axis, sign (y down)


def soft_score(detections: Sequence[DetectionLike], metadata: dict[str, Any], image_size: tuple[int, int]) -> float:
    """The continuous score in [0, 1] of one image's detections against its GenEval metadata (module docstring);
    boxes are clipped to ``image_size`` = (H, W) as ``scoring.score`` clips them."""
    detections = [clip_to_image(d, image_size[1], image_size[0]) for d in detections]
    terms: list[float] = []
    for clause in metadata.get("include", []):
        cls, n = clause["class"], int(clause["count"])
        mine = [d for d in detections if d.cls == cls]
        terms.append(_count_term(sum(float(d.score) for d in mine), n))
        if clause.get("color"):
            terms.append(_count_term(sum(float(d.score) for d in mine if d.color == clause["color"]), n))
        if clause.get("position"):
            relation, target = clause["position"]
            others = [d for d in detections if d.cls == metadata["include"][int(target)]["class"]]
            terms.append(_position_term(mine, others, relation))
    return float(np.mean(terms)) if terms else 0.0


def _count_term(soft_count: float, n: int) -> float:
    return max(0.0, 1.0 - abs(soft_count - n) / n)


def _position_term(found: list[DetectionLike], targets: list[DetectionLike], relation: str) -> float:
    """Confidence of the best pair times the ramp of its direction ratio along the asked axis (0 if either is
    missing)."""
    if not found or not targets:
        return 0.0
    a = max(found, key=lambda d: float(d.score))
    b = max(targets, key=lambda d: float(d.score))
    ratio = direction_ratio(a.box, b.box, relation)
    low, high = RAMP
    return min(float(a.score), float(b.score)) * float(np.clip((ratio - low) / (high - low), 0.0, 1.0))


def direction_ratio(box_a: Sequence[float], box_b: Sequence[float], relation: str) -> float:
    """GenEval's direction of box a from box b (``scoring.direction``) along ``relation``'s axis, positive when a
    is in that relation to b (``relative_position`` accepts it above 0.5); 0 for boxes too close to tell."""
    axis, sign = _AXES[relation]
    return float(sign * direction(box_a, box_b)[axis])
