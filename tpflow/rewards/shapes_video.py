"""Reward ``shapes-video``: the video shapes world's detector verdict on a clip (colour, shape, count, motion).

    [reward]
    name = "shapes-video"

The shapes world's rule-based detector (``tpflow.shapes.detect``) runs on a clip's first and last frames. Four
checks, each 0 or 1: **shape** (every object on the first frame has the prompt's shape, and there is one),
**colour** (likewise its colour), **count** (the first and the last frames show exactly ``count`` objects of that
shape and colour) and **motion** (the objects' mean displacement from the first to the last frame goes the prompt's
way by at least half the travel a clip of the world makes, ``SPEED``·(F − 1), and at most half as far across it).
The score is their mean (GenEval's partial credit, with motion as a fourth clause); ``strict`` is 1 when all four
hold. ``details``: ``strict`` and each check. Takes clips [N, F, 3, H, W] in [0, 1] (``accepts_clips``).
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
from tpflow.shapes.video_world import DIRECTIONS, SPEED
from tpflow.types import RewardOutput

CHECKS = ("shape", "color", "count", "motion")


class ShapesVideoOptions(BaseModel):
    """No options: the checks are the world's."""

    model_config = ConfigDict(extra="forbid")


def judge(first: list[Detection], last: list[Detection], meta: dict[str, Any], frames: int) -> dict[str, float]:
    """The four checks (module docstring) of one clip from the detections of its first and last frames."""
    want = (meta["shape"], meta["color"])
    shape = float(bool(first) and all(d.cls == meta["shape"] for d in first))
    color = float(bool(first) and all(d.color == meta["color"] for d in first))
    matched = [[d for d in found if (d.cls, d.color) == want] for found in (first, last)]
    count = float(all(len(m) == len(f) == meta["count"] for m, f in zip(matched, (first, last), strict=True)))
    return {"shape": shape, "color": color, "count": count, "motion": _motion(first, last, meta, frames)}


def _motion(first: list[Detection], last: list[Detection], meta: dict[str, Any], frames: int) -> float:
    """1 when the mean centre of the objects moved the prompt's way by ≥ half the world's travel, and across it by
    at most half as much as along it."""
    if not first or not last:
        return 0.0
    dx, dy = DIRECTIONS[meta["direction"]]
    (x0, y0), (x1, y1) = _centre(first), _centre(last)
    along = (x1 - x0) * dx + (y1 - y0) * dy
    across = abs((x1 - x0) * dy) + abs((y1 - y0) * dx)
    return float(along >= 0.5 * SPEED * (frames - 1) and across <= 0.5 * along)


def _centre(found: list[Detection]) -> tuple[float, float]:
    xs = [(d.box[0] + d.box[2]) / 2 for d in found]
    ys = [(d.box[1] + d.box[3]) / 2 for d in found]
    return sum(xs) / len(xs), sum(ys) / len(ys)


def _judgeable(meta: Any) -> bool:
    return isinstance(meta, dict) and all(k in meta for k in ShapesVideoReward.needs_metadata)


@register("reward", "shapes-video", options=ShapesVideoOptions)
class ShapesVideoReward:
    """RewardModel of the video shapes world: clips [N, F, 3, H, W] in [0, 1]; ``scores`` [N] float32 (CPU)."""

    accepts_clips = True
    accepts_images = False  # motion compares the first frame with the last: an image has no motion to check
    needs_metadata = ("shape", "color", "count", "direction")  # the shapes-video dataset's (tpflow.rewards.needs)

    def __init__(self, options: ShapesVideoOptions | None = None) -> None:
        self.options = options or ShapesVideoOptions()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        missing = next(((p, m) for p, m in zip(prompts, metadata, strict=True) if not _judgeable(m)), None)
        if missing is not None:
            raise UserError(
                "Reward 'shapes-video' checks each clip against its prompt's metadata "
                f"({', '.join(self.needs_metadata)}), and the prompt {missing[0][:60]!r} has metadata "
                f"{str(missing[1])[:80]}: use the shapes-video dataset (docs/rewards.md, 'What a reward needs')."
            )
        clips = images[:, None] if images.ndim == 4 else images
        n, frames = clips.shape[:2]
        found = detect_batch(torch.cat([clips[:, 0], clips[:, -1]]))  # the first frames, then the last
        verdicts = [judge(found[i], found[n + i], metadata[i], frames) for i in range(n)]
        checks = {k: torch.tensor([v[k] for v in verdicts], dtype=torch.float32, device="cpu") for k in CHECKS}
        scores = torch.stack(list(checks.values())).mean(0)  # [N]
        strict = torch.stack(list(checks.values())).amin(0)
        return RewardOutput(scores=scores, details={"strict": strict, **checks})
