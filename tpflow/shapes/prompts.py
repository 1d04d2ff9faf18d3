"""GenEval-style prompts of the shapes world, with GenEval-format metadata, and the registered dataset ``shapes``.

    [dataset]
    name = "shapes"
    seed = 0                  # order of the train items and draw of the test items
    test_size = 400           # test items, balanced over the six tags ("sampled" only)
    test_prompts = "sampled"  # or "distinct": every distinct prompt of the world once (126 items)

GenEval's six task templates over ``vocab.SHAPES``, ``vocab.COLORS`` and ``vocab.NUMBERS`` (GenEval's wording):

============== ============================================ ==================================================
tag            prompt                                       include (and exclude)
============== ============================================ ==================================================
single_object  a photo of a circle                          [{circle, 1}]
two_object     a photo of a circle and a square             [{circle, 1}, {square, 1}] (distinct classes)
counting       a photo of three circles (2-4)               [{circle, 3}], exclude [{circle, 4}]
colors         a photo of a red circle                      [{circle, 1, red}]
color_attr     a photo of a red circle and a blue square    [{circle, 1, red}, {square, 1, blue}] (distinct
                                                            classes and colours)
position       a photo of a circle left of a square         [{square, 1}, {circle, 1, position: [left of, 0]}]
============== ============================================ ==================================================

Each metadata dict also holds ``tag``, ``prompt`` and ``held_out`` (whether the prompt names a held-out pair,
below; the GenEval scorer ignores it); a ``position`` names the relation and the index of the include clause it is
relative to, as in GenEval.

Held-out attribute combinations: ``HELD_OUT`` is a fixed set of three (colour, shape) pairs (a quarter of the twelve,
chosen with a fixed seed so that they cover three different shapes and three different colours). A ``colors`` or
``color_attr`` prompt that names one of them belongs to the test split only; the train split never asks for them.
The test split holds every prompt, so it measures both seen and unseen combinations. Renderings whose colours are
not specified (single_object, two_object, counting, position) may show these pairs: the model must see the
pair's pixels, only never hear it asked for.

Splits of the dataset (docs/shapes.md, "Splits", has the counts). ``train``: ``TRAIN_SIZE`` items balanced over the
six tags, drawn from the 93 prompts that name no held-out pair (each tag's prompts cycled in a seeded order).
``test`` with ``test_prompts = "sampled"`` (the default): ``test_size`` items balanced the same way but drawn from
all 126 prompts, so most test texts are train texts too. With ``test_prompts = "distinct"``: each of the 126
distinct prompts exactly once, tag by tag in ``TAGS`` order (``test_size`` is ignored), 33 of them held-out; an
evaluation of it with several images per prompt and fixed noise is the honest report (per tag, held-out apart).
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.shapes.vocab import COLORS, NUMBERS, PLURALS, RELATIONS, SHAPES
from tpflow.types import PromptItem

# The descriptions of the dataset options the shapes worlds share with tpflow/data's datasets, written once. They live
# on this side because tpflow.data imports the shapes world (through the rewards): the shapes-video world and
# tpflow/data import them from here.
SEED_HELP = (
    "Seed of the dataset's random draws: for geneval and ocr, the generated prompts (which ones and their order; "
    "both splits); for shapes and shapes-video, the order of the train items and the sampled test draw."
)
TEST_SIZE_HELP = (
    "Test items: geneval and ocr generate this many distinct prompts (geneval balanced over its six tags, a tag "
    "giving at most half of its distinct prompts, single_object: 40, so its split may be smaller); shapes and "
    "shapes-video draw this many (test_prompts = 'sampled' only; shapes balanced over the six GenEval tags)."
)
TEST_PROMPTS_HELP = (
    "The test split: 'sampled' draws test_size items from every prompt (with repetition, so most are train texts "
    "too; shapes draws them balanced over the tags); 'distinct' is every distinct prompt of the world once (shapes: "
    "126, tag by tag; shapes-video: 96; test_size is ignored), the set for an honest per-tag and held-out report."
)

TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "color_attr", "position")
SPLITS: tuple[str, ...] = ("train", "test")
TRAIN_SIZE = 1200  # items of the dataset's train split (200 per tag)
_HELD_OUT_SEED = 20240607


def _held_out() -> frozenset[tuple[str, str]]:
    """Three (colour, shape) pairs with distinct shapes and distinct colours, fixed by a constant seed."""
    rng = random.Random(_HELD_OUT_SEED)
    colors = rng.sample(list(COLORS), len(SHAPES))
    return frozenset(zip(colors, SHAPES, strict=True))


HELD_OUT: frozenset[tuple[str, str]] = _held_out()


def _names_held_out_pair(include: list[dict[str, Any]]) -> bool:
    """Whether include clauses ask for a held-out (colour, shape) pair."""
    return any((c.get("color"), c["class"]) in HELD_OUT for c in include)


def _item(tag: str, prompt: str, include: list[dict[str, Any]], exclude: list[dict[str, Any]] | None = None):
    """A prompt with its GenEval metadata and ``held_out`` (so evaluations can report the held-out pairs apart)."""
    held_out = _names_held_out_pair(include)
    return PromptItem(
        prompt, {"tag": tag, "include": include, "exclude": exclude or [], "prompt": prompt, "held_out": held_out}
    )


def _all_items() -> dict[str, list[PromptItem]]:
    """Every distinct prompt of each tag, in a fixed order."""
    pairs = list(itertools.permutations(SHAPES, 2))
    color_pairs = list(itertools.permutations(COLORS, 2))
    items: dict[str, list[PromptItem]] = {
        "single_object": [_item("single_object", f"a photo of a {s}", [{"class": s, "count": 1}]) for s in SHAPES],
        "two_object": [
            _item("two_object", f"a photo of a {a} and a {b}", [{"class": a, "count": 1}, {"class": b, "count": 1}])
            for a, b in pairs
        ],
        "counting": [
            _item(
                "counting",
                f"a photo of {NUMBERS[n]} {PLURALS[s]}",
                [{"class": s, "count": n}],
                [{"class": s, "count": n + 1}],
            )
            for s in SHAPES
            for n in range(2, 5)
        ],
        "colors": [
            _item("colors", f"a photo of a {c} {s}", [{"class": s, "count": 1, "color": c}])
            for s in SHAPES
            for c in COLORS
        ],
        "color_attr": [
            _item(
                "color_attr",
                f"a photo of a {ca} {a} and a {cb} {b}",
                [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
            )
            for a, b in pairs
            for ca, cb in color_pairs
        ],
        "position": [
            _item(
                "position",
                f"a photo of a {a} {rel} a {b}",
                [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}],
            )
            for a, b in pairs
            for rel in RELATIONS
        ],
    }
    return items


def _held_out_item(item: PromptItem) -> bool:
    """Whether a prompt asks for a held-out (colour, shape) pair (from its clauses, not its ``held_out`` flag)."""
    return _names_held_out_pair(item.metadata["include"])


_ALL = _all_items()
_BY_SPLIT: dict[str, dict[str, list[PromptItem]]] = {
    "train": {tag: [it for it in items if not _held_out_item(it)] for tag, items in _ALL.items()},
    "test": _ALL,
}


def _check_split(split: str) -> None:
    if split not in _BY_SPLIT:
        raise UserError(f"Unknown split {split!r}; the shapes dataset has: {', '.join(SPLITS)}.")


def _copy(item: PromptItem) -> PromptItem:
    return PromptItem(item.prompt, copy.deepcopy(item.metadata))


def random_item(rng: random.Random, split: str = "train") -> PromptItem:
    """A uniformly random tag, then a uniformly random prompt of that tag from ``split`` (a fresh copy)."""
    _check_split(split)
    by_tag = _BY_SPLIT[split]
    return _copy(rng.choice(by_tag[rng.choice(TAGS)]))


def prompts(split: str, n: int | None = None, seed: int = 0) -> list[PromptItem]:
    """Prompts of a split, deterministic for a seed.

    Args:
        split: "train" or "test".
        n: None for the split's distinct prompts (tag by tag, fixed order); otherwise n items with repetition,
            balanced over the six tags (tag counts differ by at most one), each tag's prompts cycled in a seeded
            random order, the whole list shuffled.
        seed: seed of the draw (unused when ``n`` is None).
    """
    _check_split(split)
    by_tag = _BY_SPLIT[split]
    if n is None:
        return [_copy(item) for tag in TAGS for item in by_tag[tag]]
    rng = random.Random(seed)
    out: list[PromptItem] = []
    for k, tag in enumerate(TAGS):
        want = n // len(TAGS) + (k < n % len(TAGS))
        pool: list[PromptItem] = []
        while len(pool) < want:  # every prompt of the tag once per pass, in a new random order each pass
            pool += rng.sample(by_tag[tag], len(by_tag[tag]))
        out += [_copy(item) for item in pool[:want]]
    rng.shuffle(out)
    return out


def distinct_items(min_per_tag: int = 0) -> list[PromptItem]:
    """Every distinct prompt of the world, tag by tag; a tag with fewer than ``min_per_tag`` prompts repeats its
    whole list (in order) ceil(min_per_tag / prompts) times, so small tags get as many images as the others."""
    out: list[PromptItem] = []
    for tag in TAGS:
        items = _BY_SPLIT["test"][tag]
        passes = max(1, -(-min_per_tag // len(items)))
        out += [_copy(item) for _ in range(passes) for item in items]
    return out


class ShapesDatasetOptions(BaseModel):
    """Options of the shapes prompt dataset."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description=SEED_HELP)
    test_size: int = Field(400, ge=1, le=1_000_000, description=TEST_SIZE_HELP)
    test_prompts: Literal["sampled", "distinct"] = Field("sampled", description=TEST_PROMPTS_HELP)
    test_min_per_tag: int = Field(
        0,
        ge=0,
        le=10_000,
        description="test_prompts 'distinct' only: repeat each tag's distinct prompts (whole passes, in order) until "
        "the tag has at least this many items, so that a tag of 3 prompts is not judged on a dozen images (each "
        "repeat is sampled from its own noise). 0: every prompt once.",
    )


@register("dataset", "shapes", options=ShapesDatasetOptions)
class ShapesDataset:
    """PromptDataset: GenEval-style shapes prompts (module docstring); held-out colour-shape pairs only in test.

    Options: ``seed`` (order and draw), ``test_size`` (number of balanced test items), ``test_prompts`` ("sampled"
    draws ``test_size`` items; "distinct" is each distinct prompt once, or more for small tags with
    ``test_min_per_tag``).
    """

    splits = SPLITS
    metadata_keys = ("tag", "include", "exclude", "prompt", "held_out")  # GenEval's format (tpflow.rewards.needs)

    def __init__(self, options: ShapesDatasetOptions | None = None):
        options = options or ShapesDatasetOptions()
        self._items = {
            "train": prompts("train", TRAIN_SIZE, seed=options.seed),
            "test": (
                prompts("test", options.test_size, seed=options.seed + 1)
                if options.test_prompts == "sampled"
                else distinct_items(options.test_min_per_tag)  # [>= 126] every distinct prompt, tag by tag
            ),
        }

    def split(self, name: str) -> list[PromptItem]:
        _check_split(name)
        return self._items[name]
