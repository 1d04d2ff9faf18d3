"""Hard negatives of the shapes world: the same scene with one attribute changed, and which prompts a scene satisfies.

A contrastive model trained on random batches learns "is there a circle" long before "is the RED one the circle";
the hard negatives force the second. ``hard_negatives`` makes them per tag (the kinds of ``KINDS``):

============== ===========================================================================================
tag            negatives (each keeps every other object, box and colour)
============== ===========================================================================================
single_object  ``shape``: the object as another shape
two_object     ``shape``: one object as another shape (possibly the other object's)
counting       ``count``: one object fewer (n − 1) and one more (n + 1, at a free spot)
colors         ``color``: another colour; ``shape``: another shape
color_attr     ``color``: one object in another colour; ``swap_colors``: the two colours exchanged
position       ``swap``: the two objects exchanged; ``mirror``: the boxes mirrored along the relation's axis
============== ===========================================================================================

Training (``clip_pretrain``) uses them as extra images; the accuracy test and benchmark score the correct rendering
against each. ``satisfies`` tells which prompts a scene matches (GenEval's rules on the drawn objects), so a negative
that happens to satisfy another prompt of the batch counts as that prompt's positive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpflow.shapes.render import GAP, SceneObject, _apart, _relation_holds
from tpflow.shapes.vocab import COLORS, SHAPES

KINDS: tuple[str, ...] = ("shape", "count", "color", "swap_colors", "swap", "mirror")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@dataclass(frozen=True)
class HardNegative:
    """A changed scene: ``include`` is the GenEval include list it satisfies, when a prompt template can say it."""

    kind: str  # one of KINDS
    objects: list[SceneObject]
    include: list[dict[str, Any]] | None


def hard_negatives(
    metadata: dict[str, Any], objects: list[SceneObject], rng: np.random.Generator, size: int = 32
) -> list[HardNegative]:
    """Hard negatives of a scene drawn by ``render.scene(metadata)`` (objects in include-clause order), by tag."""
    tag, include = metadata["tag"], metadata["include"]
    out: list[HardNegative] = []
    if tag in ("single_object", "two_object", "colors"):
        i = int(rng.integers(len(objects)))
        cls = _other(SHAPES, objects[i].cls, rng)
        changed = [dict(c, **{"class": cls}) if k == i else c for k, c in enumerate(include)]
        out.append(HardNegative("shape", _replace(objects, i, cls=cls), _distinct(changed)))
    if tag in ("colors", "color_attr"):
        i = int(rng.integers(len(objects)))
        color = _other(tuple(COLORS), objects[i].color, rng)
        changed = [dict(c, color=color) if k == i else c for k, c in enumerate(include)]
        out.append(HardNegative("color", _replace(objects, i, color=color), _distinct(changed)))
    if tag == "color_attr":
        a, b = objects
        swapped = [dict(include[0], color=b.color), dict(include[1], color=a.color)]
        out.append(HardNegative("swap_colors", [a._replace(color=b.color), b._replace(color=a.color)], swapped))
    if tag == "counting":
        out += _count_negatives(include[0], objects, rng, size)
    if tag == "position":
        out += _position_negatives(include, objects, size)
    return out


def _other(options: tuple[str, ...], current: str, rng: np.random.Generator) -> str:
    choices = [o for o in options if o != current]
    return choices[int(rng.integers(len(choices)))]


def _replace(objects: list[SceneObject], i: int, **change: str) -> list[SceneObject]:
    return [o._replace(**change) if k == i else o for k, o in enumerate(objects)]


def _distinct(include: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The include list if its classes are distinct (every prompt template's are), else None."""
    classes = [c["class"] for c in include]
    return include if len(set(classes)) == len(classes) else None


def _count_negatives(
    clause: dict[str, Any], objects: list[SceneObject], rng: np.random.Generator, size: int
) -> list[HardNegative]:
    """n − 1 objects (a random one dropped) and n + 1 (one more of the class, random colour, at a free spot)."""
    n = len(objects)
    drop = int(rng.integers(n))
    fewer = [o for k, o in enumerate(objects) if k != drop]
    out = [HardNegative("count", fewer, [dict(clause, count=n - 1)])]
    side = min(o.box[2] - o.box[0] for o in objects)
    for _ in range(200):
        x0, y0 = rng.uniform(GAP, size - GAP - side, 2)
        box = (float(x0), float(y0), float(x0 + side), float(y0 + side))
        if all(_apart(box, o.box) for o in objects):
            color = list(COLORS)[int(rng.integers(len(COLORS)))]
            more = [*objects, SceneObject(clause["class"], color, box)]
            out.append(HardNegative("count", more, [dict(clause, count=n + 1)]))
            break
    return out


def _position_negatives(include: list[dict[str, Any]], objects: list[SceneObject], size: int) -> list[HardNegative]:
    """The two objects exchanged (boxes kept) and the boxes mirrored across the relation's axis (both reverse it)."""
    (ref, mover), (b, a) = include, objects  # "a photo of a {a} {rel} a {b}": clause 0 is b, clause 1 is a
    relation = mover["position"][0]
    swapped = [b._replace(cls=a.cls, color=a.color), a._replace(cls=b.cls, color=b.color)]
    swapped_include = [dict(ref, **{"class": mover["class"]}), dict(mover, **{"class": ref["class"]})]
    horizontal = relation in ("left of", "right of")

    def flip(box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        x0, y0, x1, y1 = box
        return (size - x1, y0, size - x0, y1) if horizontal else (x0, size - y1, x1, size - y0)

    mirrored = [o._replace(box=flip(o.box)) for o in objects]
    mirrored_include = [ref, dict(mover, position=[OPPOSITE[relation], mover["position"][1]])]
    return [HardNegative("swap", swapped, swapped_include), HardNegative("mirror", mirrored, mirrored_include)]


def satisfies(include: list[dict[str, Any]], objects: list[SceneObject]) -> bool:
    """Whether drawn objects satisfy a prompt's include clauses under GenEval's rules (distinct clause classes).

    Exactly the asked objects (counts, colours; nothing else), and every position relation with GenEval's margin.
    """
    if sum(int(c.get("count", 1)) for c in include) != len(objects):
        return False
    groups: list[list[SceneObject]] = []
    for clause in include:
        color = clause.get("color")
        members = [o for o in objects if o.cls == clause["class"] and (color is None or o.color == color)]
        if len(members) != int(clause.get("count", 1)):
            return False
        groups.append(members)
    for clause, members in zip(include, groups, strict=True):
        if clause.get("position"):
            relation, target = clause["position"]
            if not all(
                _relation_holds(o.box, t.box, relation, margin=0.1, threshold=0.5)
                for o in members
                for t in groups[target]
            ):
                return False
    return True
