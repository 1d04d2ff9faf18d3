"""What a GenEval detector returns and how its labels are named: ``Detection``, the ``Detector`` interface and
GenEval's class names.

Class names are GenEval's (``COCO_CLASSES``): the 80 COCO classes in COCO order, with "computer mouse",
"tv remote" and "computer keyboard" where COCO says "mouse", "remote" and "keyboard". ``geneval_class_name``
maps a detector's label (a model config's id2label, Pascal-style spellings included) to that name.

Every detector module imports this one and nothing imports a detector back (``detectors.py`` names them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

from tpflow.rewards.geneval.scoring import DetectionLike

COCO_CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
_ALIASES = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "diningtable": "dining table",
    "pottedplant": "potted plant",
    "hair dryer": "hair drier",
}


def geneval_class_name(label: str) -> str:
    """GenEval's name of a detector label: lower case, ``_`` as space, COCO/Pascal spellings mapped."""
    name = " ".join(label.lower().replace("_", " ").split())
    return _ALIASES.get(name, name)


class Detection(NamedTuple):
    """One detected object: ``box`` = (x0, y0, x1, y1) in pixels; ``color`` None when not classified."""

    cls: str
    color: str | None
    box: tuple[float, float, float, float]
    score: float


@runtime_checkable
class Detector(Protocol):
    """Finds the objects of a batch of images, for the GenEval scorer."""

    def __call__(self, images: Tensor, metadata: Sequence[dict[str, Any]]) -> list[list[DetectionLike]]:
        """images [N, 3, H, W] in [0, 1] and their GenEval metadata -> one list of detections per image.

        Boxes are in pixels of the image as given; detections may come in any order and below the scorer's
        thresholds (the scorer filters them).
        """
        ...
