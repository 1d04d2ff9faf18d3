"""GenEval: the scorer shared by every GenEval-style reward (the detector differs, the rules do not)."""

from tpflow.rewards.geneval.colors import COLORS
from tpflow.rewards.geneval.detectors import (
    COCO_CLASSES,
    Detection,
    Detector,
    ShapesDetector,
    build_detector,
    geneval_class_name,
    register_detector,
)
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
    "COCO_CLASSES",
    "COLORS",
    "COUNTING_THRESHOLD",
    "MAX_OBJECTS",
    "POSITION_MARGIN",
    "THRESHOLD",
    "Detection",
    "DetectionLike",
    "Detector",
    "GenevalResult",
    "ShapesDetector",
    "accuracy_by_tag",
    "build_detector",
    "geneval_class_name",
    "kept_detections",
    "register_detector",
    "relative_position",
    "score",
]
