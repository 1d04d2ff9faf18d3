"""GenEval: the scorer shared by every GenEval-style reward (the detector differs, the rules do not)."""

from tpflow.rewards.geneval.scoring import (
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    POSITION_MARGIN,
    THRESHOLD,
    DetectionLike,
    GenevalResult,
    accuracy_by_tag,
    kept_detections,
    relative_position,
    score,
)

__all__ = [
    "COUNTING_THRESHOLD",
    "MAX_OBJECTS",
    "POSITION_MARGIN",
    "THRESHOLD",
    "DetectionLike",
    "GenevalResult",
    "accuracy_by_tag",
    "kept_detections",
    "relative_position",
    "score",
]
