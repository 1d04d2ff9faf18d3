"""Dataset ``geneval``: GenEval-style prompts over the 80 COCO classes, with GenEval's metadata, or GenEval's files.

    [dataset]
    name = "geneval"
    seed = 0
    train_size = 12000    # generated train items, balanced over the six tags
    test_size = 600       # generated test items (at most), balanced over the six tags
    # test_path = "geneval/evaluation_metadata.jsonl"   # GenEval's own metadata instead of a generated split
    # path = "flow_grpo/dataset/geneval/train_metadata.jsonl"

The generator follows GenEval's ``prompts/create_prompts.py`` (Ghosh et al., 2023) word for word: classes
``COCO_CLASSES`` (GenEval's names), colours ``COLORS``, counts two to four, its article rule ("an" before a vowel)
and its plural rule (``+es`` after an s, else ``+s``: "wine glasses", but also "skises"). No colour is asked of a
person. Metadata is GenEval's ``evaluation_metadata.jsonl`` format: ``tag``, ``include``, ``exclude`` (counting
only) and ``prompt``:

============== ================================== =======================================================
tag            prompt                             include (and exclude)
============== ================================== =======================================================
single_object  a photo of an apple                [{apple, 1}]
two_object     a photo of a cat and a dog         [{cat, 1}, {dog, 1}] (distinct classes)
counting       a photo of three clocks            [{clock, 3}], exclude [{clock, 4}]
colors         a photo of an orange car           [{car, 1, orange}]
position       a photo of a cat left of a dog     [{dog, 1}, {cat, 1, position: [left of, 0]}]
color_attr     a photo of a red car and a blue    [{car, 1, red}, {cup, 1, blue}] (distinct classes, colours)
               cup
============== ================================== =======================================================

Splits are disjoint in prompts. The test split is drawn first: per tag ``test_size / 6`` distinct prompts, but at most
half of the tag's distinct prompts (single_object has only 80, so the test split holds 40 of them and the train split
the other 40). The train split draws per tag ``train_size / 6`` items from the remaining prompts, without repetition
until they run out, then cycling through them again in a new order. ``test_path`` (or ``path``) replaces a generated
split by a GenEval metadata file, one JSON object per line; a generated split then avoids the file's prompts (with
GenEval's own test file, which holds all 80 single objects, a generated train split has no single_object items and
is balanced over the other five tags).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tpflow.data.files import PATH_HELP, TEST_PATH_HELP, TRAIN_SIZE_HELP, _read_jsonl, _split
from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.rewards.geneval.colors import COLORS
from tpflow.rewards.geneval.detection import COCO_CLASSES
from tpflow.shapes.prompts import SEED_HELP, TEST_SIZE_HELP
from tpflow.types import PromptItem

TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBERS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
COUNTS: tuple[int, ...] = (2, 3, 4)
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
_COLORABLE = tuple(c for c in COCO_CLASSES if c != "person")  # GenEval asks no colour of a person


def with_article(word: str) -> str:
    """GenEval's article rule: "an" before a vowel letter, else "a"."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def plural(name: str) -> str:
    """GenEval's plural rule: ``+es`` after a final s, else ``+s``."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


# ----------------------------------------------------------------------------------- the six GenEval templates


def single_object(obj: str) -> PromptItem:
    return _item("single_object", f"a photo of {with_article(obj)}", [{"class": obj, "count": 1}])


def two_object(a: str, b: str) -> PromptItem:
    include = [{"class": a, "count": 1}, {"class": b, "count": 1}]
    return _item("two_object", f"a photo of {with_article(a)} and {with_article(b)}", include)


def counting(obj: str, count: int) -> PromptItem:
    prompt = f"a photo of {NUMBERS[count]} {plural(obj)}"
    return _item("counting", prompt, [{"class": obj, "count": count}], [{"class": obj, "count": count + 1}])


def colors(obj: str, color: str) -> PromptItem:
    return _item("colors", f"a photo of {with_article(color)} {obj}", [{"class": obj, "count": 1, "color": color}])


def position(a: str, relation: str, b: str) -> PromptItem:
    """``a`` is ``relation`` ``b``: the reference object b is clause 0, as in GenEval."""
    include = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}]
    return _item("position", f"a photo of {with_article(a)} {relation} {with_article(b)}", include)


def color_attr(a: str, color_a: str, b: str, color_b: str) -> PromptItem:
    include = [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1, "color": color_b}]
    prompt = f"a photo of {with_article(color_a)} {a} and {with_article(color_b)} {b}"
    return _item("color_attr", prompt, include)


def _item(tag: str, prompt: str, include: list[dict[str, Any]], exclude: list[dict[str, Any]] | None = None):
    metadata: dict[str, Any] = {"tag": tag, "include": include}
    if exclude is not None:
        metadata["exclude"] = exclude
    metadata["prompt"] = prompt
    return PromptItem(prompt, metadata)


# ---------------------------------------------------------------- every distinct prompt of a tag, by index


def _pair(index: int, names: tuple[str, ...]) -> tuple[str, str]:
    """The index-th ordered pair of distinct names."""
    a, b = divmod(index, len(names) - 1)
    return names[a], names[b + (b >= a)]


def _decoders() -> dict[str, tuple[int, Callable[[int], PromptItem]]]:
    """tag -> (number of distinct prompts, index -> prompt): the tags' prompt spaces without listing them."""
    n, nc, k, r = len(COCO_CLASSES), len(_COLORABLE), len(COLORS), len(RELATIONS)
    return {
        "single_object": (n, lambda i: single_object(COCO_CLASSES[i])),
        "two_object": (n * (n - 1), lambda i: two_object(*_pair(i, COCO_CLASSES))),
        "counting": (n * len(COUNTS), lambda i: counting(COCO_CLASSES[i // 3], COUNTS[i % 3])),
        "colors": (nc * k, lambda i: colors(_COLORABLE[i // k], COLORS[i % k])),
        "position": (n * (n - 1) * r, _position),
        "color_attr": (nc * (nc - 1) * k * (k - 1), _color_attr),
    }


def _position(index: int) -> PromptItem:
    (a, b), relation = _pair(index // len(RELATIONS), COCO_CLASSES), RELATIONS[index % len(RELATIONS)]
    return position(a, relation, b)


def _color_attr(index: int) -> PromptItem:
    pairs = len(_COLORABLE) * (len(_COLORABLE) - 1)
    (a, b), (ca, cb) = _pair(index % pairs, _COLORABLE), _pair(index // pairs, COLORS)
    return color_attr(a, ca, b, cb)


_DECODERS = _decoders()


def _distinct(tag: str, want: int, rng: random.Random, avoid: AbstractSet[str]) -> list[PromptItem]:
    """Up to ``want`` distinct prompts of ``tag`` whose text is not in ``avoid``, in random order."""
    size, decode = _DECODERS[tag]
    if 2 * want >= size - len(avoid):  # a small space (or a large request): list it
        pool = [it for it in map(decode, range(size)) if it.prompt not in avoid]
        return rng.sample(pool, min(want, len(pool)))
    out, seen = [], set()
    while len(out) < want:  # a large space: rejection sampling, far fewer than size draws
        i = rng.randrange(size)
        if i not in seen:
            seen.add(i)
            item = decode(i)
            if item.prompt not in avoid:
                out.append(item)
    return out


def _quotas(n: int, tags: Iterable[str]) -> dict[str, int]:
    """n split over tags, balanced: counts differ by at most one, the earlier tags get the remainder."""
    tags = list(tags)
    return {tag: n // len(tags) + (k < n % len(tags)) for k, tag in enumerate(tags)} if tags else {}


def generate_test(size: int, seed: int, avoid: AbstractSet[str] = frozenset()) -> list[PromptItem]:
    """A test split: per tag ``size / 6`` distinct prompts, at most half of the tag's, shuffled; deterministic."""
    out: list[PromptItem] = []
    for tag, want in _quotas(size, TAGS).items():
        rng = random.Random(f"geneval-test:{seed}:{tag}")
        out += _distinct(tag, min(want, _DECODERS[tag][0] // 2), rng, avoid)
    random.Random(f"geneval-test:{seed}").shuffle(out)
    return out


def generate_train(size: int, seed: int, avoid: AbstractSet[str] = frozenset()) -> list[PromptItem]:
    """A train split of ``size`` items balanced over the tags that have prompts outside ``avoid``; deterministic.

    Each tag's prompts are distinct until they run out, then cycled again in a new random order.
    """
    tags, pools = list(TAGS), {}
    while size and tags:  # a tag with no prompt left outside ``avoid`` gives its share to the others
        quotas = _quotas(size, tags)
        pools = {tag: _distinct(tag, quotas[tag], random.Random(f"geneval-train:{seed}:{tag}"), avoid) for tag in tags}
        if all(pools.values()):
            break
        tags = [tag for tag in tags if pools[tag]]
    if size and not tags:
        raise UserError("Every GenEval prompt is in the test split; no train prompt is left to generate.")
    rng = random.Random(f"geneval-train:{seed}")
    out: list[PromptItem] = []
    for tag, want in _quotas(size, pools).items():
        items = pools[tag][:want]
        while len(items) < want:  # repeats get their own metadata dicts
            items += [
                PromptItem(it.prompt, copy.deepcopy(it.metadata)) for it in rng.sample(pools[tag], len(pools[tag]))
            ]
        out += items[:want]
    rng.shuffle(out)
    return out


# -------------------------------------------------------------------------------------------------- dataset


class GenevalDatasetOptions(BaseModel):
    """Options of the GenEval prompt dataset."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description=SEED_HELP)
    train_size: int = Field(12000, ge=1, le=1_000_000, description=TRAIN_SIZE_HELP)
    test_size: int = Field(600, ge=1, le=1_000_000, description=TEST_SIZE_HELP)
    path: str | None = Field(None, description=PATH_HELP)
    test_path: str | None = Field(None, description=TEST_PATH_HELP)


@register("dataset", "geneval", options=GenevalDatasetOptions)
class GenevalDataset:
    """PromptDataset: GenEval prompts with GenEval metadata (module docstring); disjoint generated splits.

    Options: ``seed``, ``train_size``, ``test_size``, ``path`` and ``test_path`` (GenEval metadata files replacing
    a generated split). Files are read when the dataset is built.
    """

    splits = ("train", "test")
    # GenEval's metadata (exclude on counting items only); a metadata file is checked for tag and include when read
    metadata_keys = ("tag", "include", "prompt")

    def __init__(self, options: GenevalDatasetOptions | None = None):
        o = options or GenevalDatasetOptions()
        train = _read_metadata(o.path) if o.path else None
        test = _read_metadata(o.test_path) if o.test_path else None
        if test is None:
            test = generate_test(o.test_size, o.seed, {it.prompt for it in train or []})
        if train is None:
            train = generate_train(o.train_size, o.seed, {it.prompt for it in test})
        self._items = {"train": train, "test": test}

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


def _read_metadata(path: str) -> list[PromptItem]:
    """GenEval metadata lines as items; the metadata keeps its ``prompt``, as in GenEval's files."""
    items = []
    for n, item in enumerate(_read_jsonl(path), 1):
        meta = item.metadata
        if not isinstance(meta.get("tag"), str) or not isinstance(meta.get("include"), list):
            raise UserError(
                f'{path}: item {n} ("{item.prompt[:60]}") is not GenEval metadata: it needs a "tag" string and an '
                f'"include" list of {{"class", "count", ...}} clauses.'
            )
        items.append(PromptItem(item.prompt, {**meta, "prompt": item.prompt}))
    return items
