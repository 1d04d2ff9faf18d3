"""The video shapes world: clips of the shapes world's objects moving, their prompts, and the dataset ``shapes-video``.

    [dataset]
    name = "shapes-video"
    test_size = 96

A prompt names a colour, a shape, a count (one or two) and a direction: "a red circle moving left", "two blue
squares moving up" (4 colours × 3 shapes × 2 counts × 4 directions = 96 prompts). Its clip (``render_clip``) has
``FRAMES`` frames of 32×32 pixels: the objects (7-9 px, apart) enter at random places from which their whole path
stays inside the frame and move ``SPEED`` pixels a frame in the direction, the same for every object of the clip.

Held out: ``HELD_OUT`` holds 8 of the 48 (colour, shape, direction) triples, fixed by a constant seed; a prompt that
names one belongs to the test split only (the train split never asks for it, though its pieces all appear). The test
split holds every prompt (``test_prompts = "distinct"``, the default: each of the 96 once) or ``test_size`` draws.
Metadata: ``tag`` ("moving" or "moving_two"), ``color``, ``shape``, ``count``, ``direction``, ``held_out``, ``prompt``.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.shapes import vocab
from tpflow.shapes.prompts import SEED_HELP, TEST_PROMPTS_HELP, TEST_SIZE_HELP
from tpflow.shapes.render import SceneObject, draw_scene
from tpflow.types import PromptItem

FRAMES = 8  # frames per clip
SIZE = 32  # pixels per side
SPEED = 2.0  # pixels per frame
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
WORDS: tuple[str, ...] = (*vocab.WORDS, "moving", "up", "down")  # the image world's words first: same ids
WORD_IDS: dict[str, int] = {w: i for i, w in enumerate(WORDS)}
MAX_TOKENS = 8  # "two yellow triangles moving left" is 5 words
TRAIN_SIZE = 960  # items of the train split (10 per train prompt)
_HELD_OUT_SEED = 20261205


def tokenize(prompts: list[str], max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Word ids [N, max_tokens] (long, PAD-padded) and a bool mask [N, max_tokens] over the video vocabulary."""
    ids = torch.full((len(prompts), max_tokens), vocab.PAD, dtype=torch.long, device="cpu")  # the backbone moves them
    for row, prompt in enumerate(prompts):
        tokens = [WORD_IDS.get(w, vocab.UNK) for w in vocab.words(prompt)][:max_tokens]
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device="cpu")
    return ids, ids != vocab.PAD


def _held_out() -> frozenset[tuple[str, str, str]]:
    """8 (colour, shape, direction) triples, two per direction, with a constant seed."""
    rng = random.Random(_HELD_OUT_SEED)
    triples = list(itertools.product(vocab.COLORS, vocab.SHAPES, DIRECTIONS))
    return frozenset(rng.sample(triples, 8))


HELD_OUT: frozenset[tuple[str, str, str]] = _held_out()


def prompt_of(color: str, shape: str, count: int, direction: str) -> str:
    """The prompt's wording: "a red circle moving left" / "two red circles moving left"."""
    if count == 1:
        return f"a {color} {shape} moving {direction}"
    return f"{vocab.NUMBERS[count]} {color} {vocab.PLURALS[shape]} moving {direction}"


def all_items() -> list[PromptItem]:
    """Every prompt of the world once, in a fixed order."""
    items = []
    for count, color, shape, direction in itertools.product((1, 2), vocab.COLORS, vocab.SHAPES, DIRECTIONS):
        prompt = prompt_of(color, shape, count, direction)
        held_out = (color, shape, direction) in HELD_OUT
        meta = {"tag": "moving" if count == 1 else "moving_two", "color": color, "shape": shape, "count": count,
                "direction": direction, "held_out": held_out, "prompt": prompt}  # fmt: skip
        items.append(PromptItem(prompt, meta))
    return items


def render_clip(metadata: dict[str, Any], rng: np.random.Generator, frames: int = FRAMES, size: int = SIZE):
    """The clip a prompt describes: [frames, 3, size, size] float32 in [0, 1], white background."""
    dx, dy = DIRECTIONS[metadata["direction"]]
    travel = SPEED * (frames - 1)
    objects = _start(metadata, rng, dx, dy, travel, size)
    clip = []
    for f in range(frames):
        step = SPEED * f
        shown = [SceneObject(o.cls, o.color, (o.box[0] + dx * step, o.box[1] + dy * step, o.box[2] + dx * step,
                                               o.box[3] + dy * step)) for o in objects]  # fmt: skip
        clip.append(draw_scene(shown, size))
    return torch.stack(clip)


def _start(metadata: dict[str, Any], rng: np.random.Generator, dx: int, dy: int, travel: float, size: int):
    """The objects at frame 0: sizes 7-9 px, placed so that the whole path stays 1 px inside the frame and two
    objects stay apart across the motion (side by side perpendicular to it)."""
    count = int(metadata["count"])
    for _ in range(200):
        objects = []
        for _k in range(count):
            side = float(rng.uniform(7, 9))
            lo_x, hi_x = 1 + max(0.0, -dx * travel), size - 1 - side - max(0.0, dx * travel)
            lo_y, hi_y = 1 + max(0.0, -dy * travel), size - 1 - side - max(0.0, dy * travel)
            x, y = float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y))
            objects.append(SceneObject(metadata["shape"], metadata["color"], (x, y, x + side, y + side)))
        if count == 1 or _apart(objects[0].box, objects[1].box, dx, dy):
            return objects
    raise RuntimeError("could not place the clip's objects apart")  # cannot happen at these sizes


def _apart(a: tuple, b: tuple, dx: int, dy: int) -> bool:
    """Boxes that never touch while both move by the same vector: apart by ≥ 2 px perpendicular to the motion."""
    if dx:  # horizontal motion: separated vertically
        return a[3] + 2 <= b[1] or b[3] + 2 <= a[1]
    return a[2] + 2 <= b[0] or b[2] + 2 <= a[0]


class ShapesVideoDatasetOptions(BaseModel):
    """Options of the video shapes prompt dataset."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description=SEED_HELP)
    test_prompts: Literal["distinct", "sampled"] = Field("distinct", description=TEST_PROMPTS_HELP)
    test_size: int = Field(96, ge=1, le=100_000, description=TEST_SIZE_HELP)


@register("dataset", "shapes-video", options=ShapesVideoDatasetOptions)
class ShapesVideoDataset:
    """PromptDataset of the video shapes world (module docstring): train without the held-out triples, test all."""

    splits = ("train", "test")
    metadata_keys = ("tag", "color", "shape", "count", "direction", "held_out", "prompt")  # tpflow.rewards.needs

    def __init__(self, options: ShapesVideoDatasetOptions | None = None) -> None:
        options = options or ShapesVideoDatasetOptions()
        everything = all_items()
        seen = [it for it in everything if not it.metadata["held_out"]]
        rng = random.Random(options.seed)
        train = [seen[i % len(seen)] for i in range(TRAIN_SIZE)]
        rng.shuffle(train)
        test = everything if options.test_prompts == "distinct" else rng.choices(everything, k=options.test_size)
        self._items = {"train": train, "test": list(test)}

    def split(self, name: str) -> list[PromptItem]:
        if name not in self._items:
            raise UserError(f"The shapes-video dataset has splits 'train' and 'test', not {name!r}.")
        return self._items[name]


def random_item(rng: random.Random, split: str = "train") -> PromptItem:
    """One prompt of ``split`` ("train": never a held-out triple), uniformly."""
    everything = all_items()
    pool = everything if split == "test" else [it for it in everything if not it.metadata["held_out"]]
    return rng.choice(pool)
