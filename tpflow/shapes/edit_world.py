"""The editing shapes world: scenes, the instructions that edit them, the ``shapes-scene`` sources and the dataset.

    [dataset]
    name = "shapes-edit"
    test_scenes = 2           # source scenes per instruction in the test split

A source is a scene of the shapes world (``render.draw_scene``): one to three objects of distinct shapes, random
palette colours, boxes of 8-12 px that never touch. An instruction changes one object (4 kinds, 39 instructions):

========= ====================================== =====================================================
kind      instruction                            target scene
========= ====================================== =====================================================
add       add a red circle                       the source plus a red circle (a shape it lacks) on a
                                                 free spot
remove    remove the square                      the source without its square
recolor   make the triangle blue                 the triangle blue (it was another colour), in place
move      move the circle to the left            the circle ``MOVE`` px to the left (or right, up, down)
========= ====================================== =====================================================

Shapes are distinct within a scene, so "the square" always names one object. Sources travel as references
``shapes-scene:<spec>`` (``scene_ref``), the spec listing each object as ``colour-shape@x0,y0,x1,y1``
(``;``-separated, box in pixels of the 32×32 image); ``tpflow.sources.load`` renders them (the scheme is registered
when this module is imported), so a dataset holds no image files.

Held out: ``HELD_OUT`` holds two (shape, colour) pairs of ``add``, two of ``recolor`` and two (shape, direction)
pairs of ``move``, fixed by a constant seed; an instruction naming one is in the test split only (its words and
its pieces all appear in training). Metadata of an item: ``sources`` (one reference), ``edit`` (``kind``, ``shape``,
``color``: the added or new colour, ``direction``: the move's; what the ``shapes-edit`` reward checks), ``tag``
(the kind: the eval reports it apart), ``held_out`` and ``prompt``.

Reserved (option ``reserved_per_kind``, 0 by default): that many further instructions of each kind, fixed by another
constant seed among those the shipped model was pretrained on, kept out of the train split too and asked alone in the
``reserved`` split. A held-out instruction measures the model's compositional gap (a pairing it never saw); a reserved
one measures whether what RL learns on its instructions carries over to instructions the model can already follow
but RL never trained on.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.shapes import vocab
from tpflow.shapes.prompts import SEED_HELP
from tpflow.shapes.render import GAP, SceneObject, draw_scene, scene
from tpflow.sources import register_scheme
from tpflow.types import PromptItem

SCHEME = "shapes-scene"
SIZE = 32  # pixels per side
MOVE = 8.0  # pixels a "move" instruction moves its object
KINDS: tuple[str, ...] = ("add", "remove", "recolor", "move")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
_DIRECTION_WORDS = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
WORDS: tuple[str, ...] = (*vocab.WORDS, "add", "remove", "make", "move", "the", "to", "up", "down")  # image ids first
WORD_IDS: dict[str, int] = {w: i for i, w in enumerate(WORDS)}
MAX_TOKENS = 8  # "move the triangle to the left" is 6 words
TRAIN_SIZE = 960  # items of the train split
_HELD_OUT_SEED = 20261206


def tokenize(prompts: list[str], max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Word ids [N, max_tokens] (long, PAD-padded) and a bool mask [N, max_tokens] over the editing vocabulary."""
    ids = torch.full((len(prompts), max_tokens), vocab.PAD, dtype=torch.long, device="cpu")  # the backbone moves them
    for row, prompt in enumerate(prompts):
        tokens = [WORD_IDS.get(w, vocab.UNK) for w in vocab.words(prompt)][:max_tokens]
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device="cpu")
    return ids, ids != vocab.PAD


# ---- scenes as references ----------------------------------------------------------------------------------------


def scene_spec(objects: list[SceneObject]) -> str:
    """The compact text of a scene: ``colour-shape@x0,y0,x1,y1`` per object, ``;``-separated."""
    return ";".join(f"{o.color}-{o.cls}@" + ",".join(f"{v:g}" for v in o.box) for o in objects)


def scene_ref(objects: list[SceneObject]) -> str:
    """The source reference of a scene: ``shapes-scene:<spec>``."""
    return f"{SCHEME}:{scene_spec(objects)}"


def parse_spec(spec: str) -> list[SceneObject]:
    """The objects of a ``scene_spec`` (UserError naming the bad part)."""
    objects = []
    for part in filter(None, spec.split(";")):
        try:
            name, box_text = part.split("@")
            color, cls = name.split("-")
            box = tuple(float(v) for v in box_text.split(","))
            if color not in vocab.COLORS or cls not in vocab.SHAPES or len(box) != 4:
                raise ValueError
        except ValueError:
            raise UserError(
                f"The shapes scene {spec!r} has a bad object {part!r}: each is colour-shape@x0,y0,x1,y1 with a "
                f"colour of {', '.join(vocab.COLORS)} and a shape of {', '.join(vocab.SHAPES)}."
            ) from None
        objects.append(SceneObject(cls, color, box))  # type: ignore[arg-type]
    return objects


def render_spec(spec: str) -> torch.Tensor:
    """A scene reference's image: [3, 32, 32] float32 in [0, 1] (the ``shapes-scene`` scheme)."""
    return draw_scene(parse_spec(spec), SIZE)


register_scheme(SCHEME, render_spec)


# ---- instructions ------------------------------------------------------------------------------------------------


def instruction(kind: str, shape: str, color: str | None = None, direction: str | None = None) -> str:
    """The wording of an edit: "add a red circle", "remove the square", "make the triangle blue", "move ..."."""
    if kind == "add":
        return f"add a {color} {shape}"
    if kind == "remove":
        return f"remove the {shape}"
    if kind == "recolor":
        return f"make the {shape} {color}"
    return f"move the {shape} {_DIRECTION_WORDS[str(direction)]}"


def _edits() -> list[dict[str, Any]]:
    """Every edit of the world once: add, remove, recolor, move (kind, shape, color, direction)."""
    out: list[dict[str, Any]] = []
    for kind in KINDS:
        for shape in vocab.SHAPES:
            if kind in ("add", "recolor"):
                out += [{"kind": kind, "shape": shape, "color": c, "direction": None} for c in vocab.COLORS]
            elif kind == "move":
                out += [{"kind": kind, "shape": shape, "color": None, "direction": d} for d in DIRECTIONS]
            else:
                out.append({"kind": kind, "shape": shape, "color": None, "direction": None})
    return out


def _key(edit: dict[str, Any]) -> tuple[str, str, str | None]:
    return edit["kind"], edit["shape"], edit["color"] or edit["direction"]


def _held_out() -> frozenset[tuple[str, str, str | None]]:
    """Two (shape, colour) pairs of add, two of recolor (other pairs) and two (shape, direction) pairs of move."""
    rng = random.Random(_HELD_OUT_SEED)
    pairs = rng.sample(list(itertools.product(vocab.SHAPES, vocab.COLORS)), 4)
    moves = rng.sample(list(itertools.product(vocab.SHAPES, DIRECTIONS)), 2)
    return frozenset(
        [("add", *p) for p in pairs[:2]] + [("recolor", *p) for p in pairs[2:]] + [("move", *m) for m in moves]
    )


HELD_OUT: frozenset[tuple[str, str, str | None]] = _held_out()
EDITS: list[dict[str, Any]] = _edits()


def reserved(per_kind: int) -> frozenset[tuple[str, str, str | None]]:
    """``per_kind`` instructions of each kind, none held out, drawn with a constant seed: the same ones in every run
    (the first of two per kind is the one reserved with one per kind)."""
    rng, out = random.Random(_HELD_OUT_SEED + 1), []
    for kind in KINDS:
        keys = [_key(e) for e in EDITS if e["kind"] == kind and not is_held_out(e)]
        out += rng.sample(keys, len(keys))[:per_kind]
    return frozenset(out)


def is_held_out(edit: dict[str, Any]) -> bool:
    """Whether an edit names a held-out combination (test split only)."""
    return _key(edit) in HELD_OUT


# ---- scenes for an edit ------------------------------------------------------------------------------------------


def _apart(a: tuple, b: tuple) -> bool:
    return a[0] >= b[2] + GAP or b[0] >= a[2] + GAP or a[1] >= b[3] + GAP or b[1] >= a[3] + GAP


def _inside(box: tuple) -> bool:
    return box[0] >= GAP and box[1] >= GAP and box[2] <= SIZE - GAP and box[3] <= SIZE - GAP


def _free_box(others: list[SceneObject], rng: np.random.Generator) -> tuple | None:
    """A random box of side 8-12 px inside the image and apart from ``others`` (None after 100 tries)."""
    for _ in range(100):
        side = round(float(rng.uniform(8, 12)) * 4) / 4
        x0, y0 = (round(float(v) * 4) / 4 for v in rng.uniform(GAP, SIZE - GAP - side, 2))
        box = (x0, y0, x0 + side, y0 + side)
        if all(_apart(box, o.box) for o in others):
            return box
    return None


def make_pair(edit: dict[str, Any], rng: np.random.Generator) -> tuple[list[SceneObject], list[SceneObject]]:
    """A random source scene the edit applies to and its target scene (the source with that one change)."""
    shape = edit["shape"]
    for _ in range(200):
        others = [s for s in vocab.SHAPES if s != shape]
        add = edit["kind"] == "add"
        count = int(rng.integers(1, 3) if add else rng.integers(0, 3))  # objects besides the edited one
        shapes = list(rng.permutation(others)[:count])
        if not add:
            shapes.insert(int(rng.integers(0, len(shapes) + 1)), shape)
        colors = list(vocab.COLORS)
        include = [{"class": s, "count": 1, "color": colors[int(rng.integers(len(colors)))]} for s in shapes]
        if edit["kind"] == "recolor":  # the object's colour before is another one
            include[shapes.index(shape)]["color"] = str(rng.choice([c for c in colors if c != edit["color"]]))
        source = scene({"include": include}, rng, SIZE)
        target = _apply(edit, source, rng)
        if target is not None:
            return source, target
    raise RuntimeError(f"could not build a scene for {edit}")  # cannot happen at these sizes


def _apply(edit: dict[str, Any], source: list[SceneObject], rng: np.random.Generator) -> list[SceneObject] | None:
    """The target scene of ``edit`` on ``source`` (None when it does not fit: no free spot, a move off the image)."""
    kind, shape = edit["kind"], edit["shape"]
    if kind == "add":
        box = _free_box(source, rng)
        return None if box is None else [*source, SceneObject(shape, edit["color"], box)]
    target = []
    for obj in source:
        if obj.cls != shape:
            target.append(obj)
        elif kind == "recolor":
            target.append(obj._replace(color=edit["color"]))
        elif kind == "move":
            dx, dy = DIRECTIONS[edit["direction"]]
            box = (obj.box[0] + dx * MOVE, obj.box[1] + dy * MOVE, obj.box[2] + dx * MOVE, obj.box[3] + dy * MOVE)
            if not _inside(box) or not all(_apart(box, o.box) for o in source if o is not obj):
                return None
            target.append(obj._replace(box=box))
    return target


def target_scene(item: PromptItem, rng: np.random.Generator) -> list[SceneObject]:
    """A target scene of a dataset item: its source with the edit made (an added object on a random free spot)."""
    source = parse_spec(item.metadata["sources"][0].partition(":")[2])
    for _ in range(100):
        target = _apply(item.metadata["edit"], source, rng)
        if target is not None:
            return target
    raise ValueError(f"The edit {item.prompt!r} does not fit its source scene.")


def item_of(edit: dict[str, Any], source: list[SceneObject]) -> PromptItem:
    """The dataset item of an edit on a source scene."""
    prompt = instruction(edit["kind"], edit["shape"], edit["color"], edit["direction"])
    meta = {"sources": [scene_ref(source)], "edit": dict(edit), "tag": edit["kind"], "held_out": is_held_out(edit),
            "prompt": prompt}  # fmt: skip
    return PromptItem(prompt, meta)


def random_pair(rng: np.random.Generator, split: str = "train") -> tuple[PromptItem, list[SceneObject]]:
    """A random item of ``split`` ("train": never a held-out edit) with its target scene."""
    pool = EDITS if split == "test" else [e for e in EDITS if not is_held_out(e)]
    edit = pool[int(rng.integers(len(pool)))]
    source, target = make_pair(edit, rng)
    return item_of(edit, source), target


class ShapesEditDatasetOptions(BaseModel):
    """Options of the editing shapes dataset."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description=SEED_HELP)
    test_scenes: int = Field(
        2, ge=1, le=100, description="Source scenes per instruction in the test split (39 instructions, 6 held out)."
    )
    held_out_scenes: int = Field(
        20,
        ge=1,
        le=1000,
        description="Source scenes per held-out instruction in the held-out split (6 instructions: 120 items at 20), "
        "drawn apart from the test split's, so that a change on instructions never trained on can be measured "
        "(tpflow eval RUN --prompts held-out).",
    )
    reserved_per_kind: int = Field(
        0,
        ge=0,
        le=2,
        description="Instructions of each kind the shipped model was pretrained on that the train split leaves out "
        "as well (at 2: 8 instructions); the reserved split asks them alone on held_out_scenes scenes each, so that "
        "whether RL's gain carries over to instructions it never trained on can be measured apart from the held-out "
        "split's compositional gap (tpflow eval RUN --prompts reserved).",
    )


@register("dataset", "shapes-edit", options=ShapesEditDatasetOptions)
class ShapesEditDataset:
    """PromptDataset of the editing shapes world (module docstring): train without the held-out edits, test all,
    each instruction on ``test_scenes`` scenes (pass after pass, so a prefix covers every instruction), held-out the
    held-out instructions alone on ``held_out_scenes`` other scenes, reserved the ``reserved_per_kind`` reserved
    instructions alone on as many scenes of another draw (a split only when ``reserved_per_kind`` > 0: every split
    a dataset names holds prompts)."""

    splits: tuple[str, ...] = ("train", "test", "held-out")
    metadata_keys = ("sources", "edit", "tag", "held_out", "prompt")  # tpflow.rewards.needs

    def __init__(self, options: ShapesEditDatasetOptions | None = None) -> None:
        options = options or ShapesEditDatasetOptions()
        rng = np.random.default_rng(options.seed)
        kept_out = reserved(options.reserved_per_kind)
        seen = [e for e in EDITS if not is_held_out(e) and _key(e) not in kept_out]
        order = random.Random(options.seed)
        train = [seen[i % len(seen)] for i in range(TRAIN_SIZE)]
        order.shuffle(train)
        test_rng = np.random.default_rng(options.seed + 1)
        self._items = {
            "train": [item_of(e, make_pair(e, rng)[0]) for e in train],
            "test": [item_of(e, make_pair(e, test_rng)[0]) for _ in range(options.test_scenes) for e in EDITS],
        }
        held_rng, held = np.random.default_rng(options.seed + 2), [e for e in EDITS if is_held_out(e)]
        scenes = range(options.held_out_scenes)
        self._items["held-out"] = [item_of(e, make_pair(e, held_rng)[0]) for _ in scenes for e in held]
        kept_rng, kept = np.random.default_rng(options.seed + 3), [e for e in EDITS if _key(e) in kept_out]
        if kept:
            self._items["reserved"] = [item_of(e, make_pair(e, kept_rng)[0]) for _ in scenes for e in kept]
        self.splits = tuple(self._items)

    def split(self, name: str) -> list[PromptItem]:
        if name == "reserved" and name not in self._items:
            raise UserError(
                "The shapes-edit dataset has a reserved split only with dataset.reserved_per_kind set (1 or 2): that "
                "many instructions of each kind are then kept out of training and asked there."
            )
        if name not in self._items:
            raise UserError(f"The shapes-edit dataset has splits {', '.join(map(repr, self.splits))}, not {name!r}.")
        return self._items[name]
