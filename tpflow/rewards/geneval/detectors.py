"""Detectors of the GenEval scorer by name: the ``shapes`` adapter and the table ``build_detector`` reads.

The scorer (``scoring.score``) judges any list of detections with ``cls``, ``color``, ``box`` and ``score``; a
detector (the interface and the class names are in ``detection.py``) turns images into such lists. Two are built in:

* ``shapes``: the rule-based detector of the embedded shapes world (``tpflow.shapes.detect``), CPU, no weights;
* ``mask2former``: COCO instance segmentation with Mask2Former and CLIP colours, as GenEval (``mask2former.py``).

A detector receives the metadata too: it may skip work the scorer will not look at (colours nobody asks for,
detections below the tag's confidence threshold), never change what the scorer would decide. The table is the
``[reward] detector`` option's namespace, not a component kind of tpflow's registry; a plugin adds to it with
``register_detector``. Imports run one way: this module imports a detector's module when its factory is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from tpflow.errors import UserError
from tpflow.rewards.geneval.detection import COCO_CLASSES, Detection, Detector, geneval_class_name
from tpflow.rewards.geneval.scoring import DetectionLike

__all__ = ["COCO_CLASSES", "DETECTORS", "Detection", "Detector", "ShapesDetector", "build_detector",
           "geneval_class_name", "register_detector"]  # fmt: skip


class ShapesDetector:
    """Detector ``shapes``: the embedded world's rule-based detector (coloured circles, squares, triangles)."""

    def __call__(self, images: Tensor, metadata: Sequence[dict[str, Any]]) -> list[list[DetectionLike]]:
        from tpflow.shapes.detect import detect_batch

        return list(detect_batch(images))


def _shapes(**_: Any) -> Detector:
    return ShapesDetector()


def _mask2former(**options: Any) -> Detector:
    from tpflow.rewards.geneval.mask2former import Mask2FormerDetector

    return Mask2FormerDetector(**options)


# name -> factory(**options). The factories import their module when called, so listing them costs nothing.
DETECTORS: dict[str, Callable[..., Detector]] = {"shapes": _shapes, "mask2former": _mask2former}


def register_detector(name: str, factory: Callable[..., Detector]) -> None:
    """Add a detector under ``name``; a name already taken raises."""
    if name in DETECTORS:
        raise ValueError(f"A GenEval detector named {name!r} is already registered.")
    DETECTORS[name] = factory


def build_detector(name: str, **options: Any) -> Detector:
    """The detector ``name`` built with its options (``shapes`` ignores them)."""
    if name not in DETECTORS:
        raise UserError(f"Unknown GenEval detector {name!r}; available: {', '.join(sorted(DETECTORS))}.")
    return DETECTORS[name](**options)
