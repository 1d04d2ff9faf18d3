"""The GenEval scorer: correctness, strict correctness and the partial-credit score of one image's detections.

Written once and fed by any detector (the shapes world's rule-based one, the real-image one): a detection only needs
``cls``, ``color``, ``box`` = (x0, y0, x1, y1) in pixels and ``score``. GenEval metadata is
``{"tag", "include": [{"class", "count", "color"?, "position": [relation, clause index]?}], "exclude": [...]}``.

Detections are kept as GenEval keeps them: score above 0.3 (0.9 when the tag is ``counting``), at most 16 per
class, highest score first, no NMS. Then (docs/algorithm.md §7):

* ``correct`` is GenEval's official rule. Each include clause looks at its class's ``count`` best detections: there
  must be that many, all of the asked colour, and each in the asked relation to every object of the clause it
  refers to (which must itself have matched). Every exclude clause ``{class, count}`` needs fewer than ``count``
  detections of its class.
* ``strict_correct`` (Flow-GRPO's rule) asks for exactly ``count`` detections per include clause, all of the asked
  colour and in the asked relation to all objects of the referred clause. Exclude clauses apply too, so a strictly
  correct image is always correct (with GenEval's own metadata they are implied by the exact counts anyway).
* ``score`` is the mean of a list of credits, one or two per include clause: ``1 − |count − found| / count`` (it can
  be negative); then, if the count is wrong and the clause asks a colour or position, a 0; if the count is right, for
  a colour ``1 − |count − of that colour| / count``, and for a position (checked only when the colour matched)
  0 if the referred clause did not match or a pair is in the wrong relation, else 1. The reference code appends
  the 1 even after a failed position check; tpflow does not. Exclude clauses do not enter the score.

``strict_count`` (off by default, so GenEval's rule stands; the shapes world's reward turns it on) closes a gap of
the counting threshold: a detection of the asked class at confidence 0.3 to 0.9 is dropped, so an image with one
object too many passes when the extra one is malformed. With it, on a ``counting`` prompt the include clauses still
need ``count`` detections above 0.9, but every detection of the class above 0.3 counts against the asked number:
the exclude clauses, the strict rule's exact count and the count credit (once ``count`` are found above 0.9) read
the detections above 0.3. Other tags keep one threshold (0.3), so nothing changes for them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from tpflow.boxes import POSITION_MARGIN, direction

THRESHOLD = 0.3  # detection confidence kept by GenEval
COUNTING_THRESHOLD = 0.9  # ... for prompts tagged "counting"
MAX_OBJECTS = 16  # detections kept per class


class DetectionLike(Protocol):
    """What the scorer reads of a detection."""

    cls: str
    color: str | None
    box: tuple[float, float, float, float]  # (x0, y0, x1, y1) in pixels
    score: float


@dataclass(frozen=True)
class GenevalResult:
    """The verdicts on one image."""

    correct: bool  # GenEval's official correctness (at least the counts, exclude clauses applied)
    strict_correct: bool  # exact counts, colours and positions
    score: float  # partial credit, the training reward (docs/algorithm.md §7, without the upstream position bug)
    reason: str  # why it is not strictly correct ("" when it is)


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN) -> set[str]:
    """The relations ("left of", "right of", "above", "below") of box a to box b, as GenEval computes them: a
    relation holds when ``direction`` is beyond ±0.5 along its axis ("above" is a negative y). Boxes too close to
    tell give no relation."""
    dx, dy = direction(box_a, box_b, margin)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def kept_detections(detections: Sequence[DetectionLike], tag: str | None) -> dict[str, list[DetectionLike]]:
    """Detections GenEval keeps, by class: score above the tag's threshold, at most 16, highest score first."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    by_class: dict[str, list[DetectionLike]] = defaultdict(list)
    for det in sorted(detections, key=lambda d: -float(d.score)):  # stable: equal scores keep their order
        if float(det.score) > threshold and len(by_class[det.cls]) < MAX_OBJECTS:
            by_class[det.cls].append(det)
    return dict(by_class)


def score(
    detections: Sequence[DetectionLike],
    metadata: dict[str, Any],
    image_size: tuple[int, int],
    strict_count: bool = False,
) -> GenevalResult:
    """Score one image's detections against its GenEval metadata.

    Args:
        detections: everything the detector found, in any order.
        metadata: GenEval metadata (``tag``, ``include``, ``exclude``); without an include clause it asks nothing
            (vacuously correct, partial credit 0): the rewards report such an item's verdicts as NaN (``verdicts``).
        image_size: (H, W) of the image; boxes are clipped to it.
        strict_count: on a ``counting`` prompt, count every detection of the asked class above 0.3 (not only those
            above 0.9) against the asked number (module docstring). False is GenEval's rule.
    """
    h, w = image_size
    clipped = [clip_to_image(d, w, h) for d in detections]
    tag = metadata.get("tag")
    objects = kept_detections(clipped, tag)
    counted = None  # class -> detections counted against the asked number, when that differs from ``objects``
    if strict_count and tag == "counting":
        counted = {cls: len(found) for cls, found in kept_detections(clipped, None).items()}
    include, exclude = metadata.get("include", []), metadata.get("exclude", [])
    correct = _official(objects, include)
    strict, credits, reasons = _strict(objects, include, counted)
    for clause in exclude:
        found = len(objects.get(clause["class"], [])) if counted is None else counted.get(clause["class"], 0)
        if found >= int(clause["count"]):
            correct = strict = False
            reasons.append(f"expected fewer than {clause['count']} {clause['class']}, found {found}")
    partial = float(np.mean(credits)) if credits else 0.0
    return GenevalResult(correct, strict, partial, "; ".join(reasons))


def accuracy_by_tag(results: Sequence[GenevalResult], tags: Sequence[str], strict: bool = True) -> dict[str, float]:
    """Fraction of (strictly, by default) correct images per tag, plus ``overall``: the mean over tags, as GenEval;
    NaN over no image (an accuracy of no check is not a number, never 0 or 1)."""
    if len(results) != len(tags):
        raise ValueError(f"Got {len(results)} results for {len(tags)} tags.")
    hits: dict[str, list[bool]] = defaultdict(list)
    for result, tag in zip(results, tags, strict=True):
        hits[tag].append(result.strict_correct if strict else result.correct)
    accuracy = {tag: float(np.mean(v)) for tag, v in sorted(hits.items())}
    accuracy["overall"] = float(np.mean(list(accuracy.values()))) if accuracy else math.nan
    return accuracy


class ClippedDetection(NamedTuple):
    """A detection with its box clipped to the image."""

    cls: str
    color: str | None
    box: tuple[float, float, float, float]
    score: float


def clip_to_image(det: DetectionLike, width: int, height: int) -> ClippedDetection:
    """``det`` with its box clipped to a ``width`` x ``height`` image: a box reaching past the border must not count
    area or position outside the image. Public because both scorers clip alike (``score`` here, ``soft.soft_score``),
    so the strict and the soft score judge the same boxes."""
    x0, y0, x1, y1 = (float(v) for v in det.box[:4])
    box = (min(max(x0, 0.0), width), min(max(y0, 0.0), height), min(max(x1, 0.0), width), min(max(y1, 0.0), height))
    return ClippedDetection(det.cls, det.color, box, float(det.score))


def _pairs_hold(found: list[DetectionLike], targets: list[DetectionLike], relation: str) -> str | None:
    """None when every found object is in ``relation`` to every target, else the first failure, described."""
    for obj in found:
        for target in targets:
            actual = relative_position(obj.box, target.box)
            if relation not in actual:
                return f"expected {obj.cls} {relation} {target.cls}, found {' and '.join(sorted(actual)) or 'none'}"
    return None


def _official(objects: dict[str, list[DetectionLike]], include: list[dict[str, Any]]) -> bool:
    """GenEval's correctness of the include clauses: at least ``count`` best detections, colour, position."""
    correct = True
    matched: list[list[DetectionLike] | None] = []
    for clause in include:
        count = int(clause["count"])
        found = objects.get(clause["class"], [])[:count]
        ok = len(found) >= count
        if ok and clause.get("color"):
            ok = sum(d.color == clause["color"] for d in found) >= count
        if ok and clause.get("position"):
            relation, target = clause["position"]
            ok = matched[int(target)] is not None and _pairs_hold(found, matched[int(target)], relation) is None
        correct &= ok
        matched.append(found if ok else None)
    return correct


def _strict(
    objects: dict[str, list[DetectionLike]], include: list[dict[str, Any]], counted: dict[str, int] | None = None
) -> tuple[bool, list[float], list]:
    """Strict correctness of the include clauses, the partial-credit list and the reasons of failure.

    ``counted`` (``strict_count``): per class, the detections above the lower threshold; once a clause has its
    ``count`` in ``objects``, that number is its count."""
    strict, credits, reasons = True, [], []
    matched: list[list[DetectionLike] | None] = []
    for clause in include:
        cls, count = clause["class"], int(clause["count"])
        found = objects.get(cls, [])
        n, faint = len(found), 0
        if counted is not None and n >= count:
            n, faint = max(n, counted.get(cls, 0)), max(counted.get(cls, 0) - n, 0)
        ok = n == count
        credits.append(1 - abs(count - n) / count)
        if not ok:
            more = f" ({faint} of them at confidence {THRESHOLD} to {COUNTING_THRESHOLD})" if faint else ""
            reasons.append(f"expected exactly {count} {cls}, found {n}{more}")
            if clause.get("color") or clause.get("position"):
                credits.append(0.0)
        else:
            if clause.get("color"):
                right = sum(d.color == clause["color"] for d in found)
                credits.append(1 - abs(count - right) / count)
                if right != count:
                    ok = False
                    reasons.append(f"expected {count} {clause['color']} {cls}, found {right} of that colour")
            if ok and clause.get("position"):
                relation, target = clause["position"]
                targets = matched[int(target)]
                failure = f"no matched target for {cls} to be {relation}" if targets is None else None
                failure = failure or _pairs_hold(found, targets, relation)
                ok = failure is None
                credits.append(1.0 if ok else 0.0)  # the reference also appends 1.0 after a failure; we do not
                if failure:
                    reasons.append(failure)
        strict &= ok
        matched.append(found if ok else None)
    return strict, credits, reasons
