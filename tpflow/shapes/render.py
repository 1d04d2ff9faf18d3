"""Ground-truth renderings of GenEval-style metadata in the shapes world.

Every image is white with coloured circles, squares and triangles (``vocab.SHAPES`` in ``vocab.COLORS``), drawn with
PIL at 4× the final size and box-filtered down, so edges are anti-aliased. ``render`` turns one prompt's metadata
into an image that satisfies it under GenEval's rules (``tpflow.rewards.geneval.scoring``): exactly the requested
objects of each class (so every ``exclude`` clause holds), the requested colours (random palette colours where none
is given), the requested relative positions with a wide margin, and nothing else. Objects never overlap: their boxes
are at least one final pixel apart and one pixel inside the border.

At 32×32 an object's box side is 8..12 px, so four of them always fit and each stays recognisable by the detector
(``tpflow.shapes.detect``), which re-draws candidate shapes with ``shape_mask`` from this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw

from tpflow.boxes import relation_holds
from tpflow.shapes.vocab import BACKGROUND, COLORS, SHAPES

SCALE = 4  # drawing resolution / final resolution
MIN_SIDE, MAX_SIDE = 8 / 32, 12 / 32  # object box side as a fraction of the image side
GAP = 1.0  # minimal distance in final pixels between two boxes, and between a box and the border
_ATTEMPTS = 200  # scene attempts before the object sizes shrink
_TRIES = 20  # random spots tried per object within one attempt


class SceneObject(NamedTuple):
    """One drawn object: ``box`` = (x0, y0, x1, y1) in final pixels, the object covers [x0, x1) × [y0, y1)."""

    cls: str
    color: str
    box: tuple[float, float, float, float]


def _polygon(cls: str, box: tuple[float, float, float, float]) -> list[tuple[float, float]] | None:
    """Triangle vertices in the coordinates of ``box`` (None for shapes PIL draws natively)."""
    x0, y0, x1, y1 = box
    if cls == "triangle":  # isosceles, pointing up, base on the bottom edge
        return [(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)]
    return None


def _draw(draw: ImageDraw.ImageDraw, cls: str, box: tuple[float, float, float, float], fill: Any) -> None:
    """Draw one shape covering the half-open pixel box ``box`` of the canvas ``draw`` paints on."""
    x0, y0, x1, y1 = box
    if cls == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif cls == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
    elif cls == "triangle":
        draw.polygon(_polygon(cls, (x0, y0, x1 - 1, y1 - 1)), fill=fill)
    else:
        raise ValueError(f"Unknown shape {cls!r}; shapes are: {', '.join(SHAPES)}.")


def shape_mask(cls: str, width: float, height: float, size: tuple[int, int], offset: tuple[float, float] = (0, 0)):
    """Anti-aliased coverage [H, W] float32 in [0, 1] of one shape, drawn exactly as ``draw_scene`` draws it.

    Args:
        cls: shape name.
        width, height: box size of the shape in final pixels.
        size: (H, W) of the returned mask.
        offset: top-left corner (x, y) of the shape's box inside the mask, in final pixels.
    """
    h, w = size
    canvas = Image.new("L", (w * SCALE, h * SCALE), 0)
    x0, y0 = round(offset[0] * SCALE), round(offset[1] * SCALE)
    _draw(ImageDraw.Draw(canvas), cls, (x0, y0, x0 + round(width * SCALE), y0 + round(height * SCALE)), 255)
    small = canvas.resize((w, h), Image.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def draw_scene(objects: Sequence[SceneObject], size: int = 32) -> torch.Tensor:
    """Draw objects on a white image: [3, size, size] float32 in [0, 1]."""
    canvas = Image.new("RGB", (size * SCALE, size * SCALE), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        box = tuple(round(v * SCALE) for v in obj.box)
        _draw(draw, obj.cls, box, COLORS[obj.color])
    small = canvas.resize((size, size), Image.BOX)
    return torch.from_numpy(np.asarray(small, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()  # [3, S, S]


def _relation_holds(a: tuple, b: tuple, relation: str, margin: float = 0.2, threshold: float = 0.6) -> bool:
    """GenEval's relative-position test of box ``a`` against ``b`` (``tpflow.boxes``), with a wider margin and
    threshold: GenEval itself uses margin 0.1 and threshold 0.5; the stricter values here leave room for the
    detector's boxes to differ from the drawn ones by a pixel."""
    return relation_holds(a, b, relation, margin, threshold)


def _apart(a: tuple, b: tuple) -> bool:
    """Whether two boxes are at least ``GAP`` pixels apart along x or y."""
    return a[0] >= b[2] + GAP or b[0] >= a[2] + GAP or a[1] >= b[3] + GAP or b[1] >= a[3] + GAP


def _place(n: int, relations: list[tuple[int, int, str]], rng: np.random.Generator, size: int) -> list[tuple]:
    """Random boxes for n objects: inside the image, pairwise apart, satisfying (i, j, relation) constraints.

    Objects are placed one at a time, each with a few tries at a free spot; a scene that fails restarts, and after
    many restarts the largest allowed side shrinks.
    """
    q = 1 / SCALE  # box coordinates are multiples of a drawing pixel
    lo, hi = MIN_SIDE * size, MAX_SIDE * size
    for attempt in range(20 * _ATTEMPTS):
        if attempt and attempt % _ATTEMPTS == 0:  # unlucky (or very crowded): try smaller objects
            hi = max(lo, hi * 0.9)
        sides = np.round(rng.uniform(lo, hi, n) / q) * q
        corners = np.round(rng.uniform(GAP, size - GAP - sides[:, None], (_TRIES, n, 2)) / q) * q  # [T, n, 2]
        boxes: list[tuple] = []
        for i in range(n):
            for t in range(_TRIES):
                x0, y0 = corners[t, i]
                box = (float(x0), float(y0), float(x0 + sides[i]), float(y0 + sides[i]))
                if all(_apart(box, other) for other in boxes):
                    boxes.append(box)
                    break
            else:
                break
        if len(boxes) == n and all(_relation_holds(boxes[i], boxes[j], rel) for i, j, rel in relations):
            return boxes
    raise RuntimeError(f"Could not place {n} objects on a {size}×{size} image; the scene is too crowded.")


def scene(metadata: dict[str, Any], rng: np.random.Generator, size: int = 32) -> list[SceneObject]:
    """The objects of a random image satisfying GenEval metadata (``include`` clauses with class, count, colour and
    position; see ``tpflow.shapes.prompts``).

    Raises:
        ValueError: the metadata asks for an unknown shape or colour, or a position relative to a clause that does not
            exist.
    """
    palette = list(COLORS)
    kinds: list[tuple[str, str]] = []
    groups: list[list[int]] = []  # object indices of each include clause
    for clause in metadata.get("include", []):
        cls, color = clause["class"], clause.get("color")
        if cls not in SHAPES or (color is not None and color not in COLORS):
            raise ValueError(f"The shapes world has shapes {SHAPES} and colours {tuple(COLORS)}, got {clause}.")
        groups.append([])
        for _ in range(int(clause.get("count", 1))):
            groups[-1].append(len(kinds))
            kinds.append((cls, color if color is not None else palette[rng.integers(len(palette))]))
    relations = []
    for clause, members in zip(metadata.get("include", []), groups, strict=True):
        if clause.get("position"):
            relation, target = clause["position"]
            if not 0 <= target < len(groups):
                raise ValueError(f"Position {clause['position']} refers to a missing include clause.")
            relations += [(i, j, relation) for i in members for j in groups[target]]
    boxes = _place(len(kinds), relations, rng, size)
    return [SceneObject(cls, color, box) for (cls, color), box in zip(kinds, boxes, strict=True)]


def render(metadata: dict[str, Any], rng: np.random.Generator, size: int = 32) -> torch.Tensor:
    """A random image [3, size, size] float32 in [0, 1] that satisfies GenEval ``metadata``."""
    return draw_scene(scene(metadata, rng, size), size)


def render_batch(items: Sequence[dict[str, Any]], rng: np.random.Generator, size: int = 32) -> torch.Tensor:
    """Render a list of metadata dicts: [N, 3, size, size] float32 in [0, 1]."""
    if not items:
        return torch.empty(0, 3, size, size, device="cpu")
    return torch.stack([render(metadata, rng, size) for metadata in items])


__all__ = ["SceneObject", "draw_scene", "render", "render_batch", "scene", "shape_mask"]
