"""Reward ``shapes-edit``: the editing shapes world's detector verdict on an edit (the instruction, and nothing else).

    [reward]
    name = "shapes-edit"

The shapes world's rule-based detector (``tpflow.shapes.detect``) runs on the edited image and on its source
(``metadata["sources"][0]``, loaded by ``tpflow.sources.load``). Two parts, each in [0, 1]:

- **instruction**: the edit was made. ``add``: a new object (one matching no source object) of the asked shape and
  colour, half for either; ``remove``: no object of that shape is left; ``recolor``: the object of that shape
  has the new colour, in place (half when it also moved); ``move``: the object (same shape and colour) moved the
  asked way, ``min(1, along / (0.75·MOVE))``, 0 when it moved across more than half as far plus 2 px.
- **preserve**: every other object is unchanged: the source objects besides the edited one found again (same shape
  and colour, centre within ``NEAR`` px, size within a third) over those objects plus the edit's extra objects
  (found in the edit, matching nothing, neither the edited object nor its unedited original); 1 when there are
  none of either.

``score = instruction · (1 + preserve) / 2``: an unedited copy of the source scores 0, the target scene 1, a right
edit that breaks the rest of the scene about one half, a half-right edit (a blue circle added for a red one) on an
intact scene one half. ``details``: ``instruction``, ``preserve`` and ``strict`` (1 when both are 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.shapes.detect import Detection, detect_batch
from tpflow.shapes.edit_world import DIRECTIONS, MOVE
from tpflow.sources import load, references
from tpflow.types import RewardOutput

NEAR = 2.5  # pixels between the centres of "the same object" in the source and the edit
MIN_SCORE = 0.3  # detections below this confidence are not objects (GenEval's general threshold)


class ShapesEditOptions(BaseModel):
    """No options: the checks are the world's."""

    model_config = ConfigDict(extra="forbid")


def _centre(d: Detection) -> tuple[float, float]:
    return (d.box[0] + d.box[2]) / 2, (d.box[1] + d.box[3]) / 2


def _side(d: Detection) -> float:
    return max(d.box[2] - d.box[0], d.box[3] - d.box[1], 1e-6)


def _near(a: Detection, b: Detection) -> bool:
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    return (ax - bx) ** 2 + (ay - by) ** 2 <= NEAR**2 and 0.75 <= _side(a) / _side(b) <= 4 / 3


def _same(a: Detection, b: Detection) -> bool:
    return a.cls == b.cls and a.color == b.color and _near(a, b)


def judge(source: list[Detection], edited: list[Detection], edit: dict[str, Any]) -> dict[str, float]:
    """The two parts (module docstring) of one edit from the detections of its source and of the edited image."""
    kind, shape = edit["kind"], edit["shape"]
    target = None if kind == "add" else next((d for d in source if d.cls == shape), None)
    others = [d for d in source if d is not target]
    left = list(edited)
    kept = 0
    for obj in others:  # each source object found again, once
        match = next((d for d in left if _same(obj, d)), None)
        if match is not None:
            kept += 1
            left.remove(match)
    instruction, used = _instruction(kind, edit, target, left)
    extras = [d for d in left if d is not used and not (target is not None and _same(d, target))]
    total = len(others) + len(extras)
    return {"instruction": instruction, "preserve": kept / total if total else 1.0}


def _instruction(kind: str, edit: dict[str, Any], target: Detection | None, left: list[Detection]):
    """(instruction part, the detection that carries the edit or None) among the edit's unmatched detections."""
    shape = edit["shape"]
    if kind == "add":
        scored = [(0.5 * (d.cls == shape) + 0.5 * (d.color == edit["color"]), d) for d in left]
        return max(scored, key=lambda s: s[0], default=(0.0, None))
    if target is None:  # the source lacks the object (not the dataset's scenes): nothing to edit
        return 0.0, None
    if kind == "remove":
        return float(not any(d.cls == shape for d in left)), None
    if kind == "recolor":
        scored = [((1.0 if _near(d, target) else 0.5) * (d.color == edit["color"]), d) for d in left if d.cls == shape]
        return max(scored, key=lambda s: s[0], default=(0.0, None))
    dx, dy = DIRECTIONS[edit["direction"]]
    (x0, y0), best = _centre(target), (0.0, None)
    for d in left:
        if (d.cls, d.color) != (target.cls, target.color):
            continue
        x1, y1 = _centre(d)
        along = (x1 - x0) * dx + (y1 - y0) * dy
        across = abs((x1 - x0) * dy) + abs((y1 - y0) * dx)
        value = min(1.0, max(0.0, along) / (0.75 * MOVE)) if across <= 0.5 * abs(along) + 2 else 0.0
        best = max(best, (value, d), key=lambda s: s[0])
    return best


def _judgeable(meta: Any) -> bool:
    return isinstance(meta, dict) and isinstance(meta.get("edit"), dict) and len(references(meta)) >= 1


@register("reward", "shapes-edit", options=ShapesEditOptions)
class ShapesEditReward:
    """RewardModel of the editing shapes world: images [N, 3, H, W] in [0, 1]; ``scores`` [N] float32 (CPU)."""

    needs_metadata = ("sources", "edit")  # the shapes-edit dataset's (tpflow.rewards.needs)

    def __init__(self, options: ShapesEditOptions | None = None) -> None:
        self.options = options or ShapesEditOptions()

    @staticmethod
    def detail_keys(options: ShapesEditOptions) -> list[str]:
        """Its details' keys (``tpflow.interfaces.CAPABILITIES``)."""
        return ["instruction", "preserve", "strict"]

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        missing = next(((p, m) for p, m in zip(prompts, metadata, strict=True) if not _judgeable(m)), None)
        if missing is not None:
            raise UserError(
                "Reward 'shapes-edit' checks each edit against its source image and instruction (metadata 'sources' "
                f"and 'edit'), and the prompt {missing[0][:60]!r} has metadata {str(missing[1])[:80]}: use the "
                "shapes-edit dataset (docs/shapes.md, 'Editing')."
            )
        n, size = len(images), images.shape[-2:]
        sources = [load(references(m)[0]) for m in metadata]
        sources = [s if s.shape[-2:] == size else _resize(s, size) for s in sources]
        found = detect_batch(torch.cat([images.float().cpu(), torch.stack(sources)]))  # edits, then sources
        keep = [[d for d in f if d.score >= MIN_SCORE] for f in found]
        verdicts = [judge(keep[n + i], keep[i], metadata[i]["edit"]) for i in range(n)]
        instruction = torch.tensor([v["instruction"] for v in verdicts], dtype=torch.float32, device="cpu")
        preserve = torch.tensor([v["preserve"] for v in verdicts], dtype=torch.float32, device="cpu")
        scores = instruction * (1 + preserve) / 2
        strict = ((instruction == 1) & (preserve == 1)).float()
        return RewardOutput(
            scores=scores, details={"instruction": instruction, "preserve": preserve, "strict": strict}
        )


def _resize(image: Tensor, size: torch.Size) -> Tensor:
    """A source [3, h, w] resized to the edit's [3, H, W] (bilinear, antialiased)."""
    out = torch.nn.functional.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True)
    return out[0].clamp(0, 1)
