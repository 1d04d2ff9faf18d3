"""Dataset ``ocr``: prompts asking for an image that shows a quoted text, with ``{"target": text}`` metadata.

    [dataset]
    name = "ocr"
    seed = 0             # which prompts are drawn, and their order
    train_size = 4000
    test_size = 1000

    # or your own prompts, one per line, the text to render in double quotes (e.g. Flow-GRPO's dataset/ocr):
    # path = "data/ocr/train.txt"
    # test_path = "data/ocr/test.txt"

Generated prompts put one to three words of ``WORDS``, in upper or title case, into one of ``TEMPLATES``, e.g.
``A storefront sign that says "OPEN LATE"``. Train and test never share a target text: a text belongs to the test
split when the CRC-32 of its normalised form (spaces removed, lower-cased, what the reward compares) is divisible
by ``_TEST_MODULUS``, so the split of a text never depends on the seed or the sizes. Within a split the prompts
are distinct. The test split does not depend on ``train_size``.

With ``path``, the prompts are read from the file (blank lines skipped) and the target is what the ``ocr`` reward
would take: the text between the first pair of double quotes, or the whole prompt.
"""

from __future__ import annotations

import random
import zlib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpflow.data.files import PATH_HELP, TEST_PATH_HELP, TRAIN_SIZE_HELP, _lines, _split
from tpflow.registry import register
from tpflow.rewards.ocr import normalize, target_text
from tpflow.shapes.prompts import SEED_HELP, TEST_SIZE_HELP
from tpflow.types import PromptItem

TEMPLATES: tuple[str, ...] = (
    'A storefront sign that says "{}"',
    'A neon sign reading "{}" on a brick wall at night',
    'A coffee mug with the words "{}" printed on it',
    'A chalkboard menu with "{}" written in chalk',
    'A white T-shirt with "{}" printed across the chest',
    'A green road sign that reads "{}"',
    'A book cover titled "{}"',
    'A birthday cake with "{}" written in icing',
    'A concert poster with the headline "{}"',
    'A banner saying "{}" hanging over a street festival',
    'A handwritten note on a desk that says "{}"',
    'Graffiti on a subway train reading "{}"',
    'A vintage postcard with "{}" in bold letters',
    'A cereal box labeled "{}"',
    'A doormat with the text "{}"',
    'Sky writing that spells "{}" above a beach',
    'A wooden sign carved with "{}" in a forest',
    'A laptop screen displaying "{}"',
    'A street mural with the words "{}"',
    'A movie theater marquee announcing "{}"',
)

WORDS: tuple[str, ...] = tuple(
    """
    open late fresh coffee hello world welcome home sale today only free wifi good morning night city river
    garden bakery books music dream big stay calm keep going love peace happy birthday thank you best friends
    sunny day rain snow winter summer spring autumn ocean mountain forest desert island bridge street market
    pizza burger tacos sushi noodles bread cake cookies juice tea milk honey apple lemon orange cherry mango
    exit stop slow danger caution parking station airport hotel museum library school office studio gallery
    cinema theater arena stadium park zoo farm harbor beach lake valley canyon north south east west left right
    gold silver blue green red yellow purple black white bright dark quiet loud wild gentle brave lucky magic
    robot rocket planet star moon sun cloud storm thunder light shadow fire water stone paper glass metal wood
    tiger lion panda eagle shark whale dolphin fox wolf bear owl cat dog rabbit horse dragon unicorn phoenix
    """.split()
)

_TEST_MODULUS = 8  # one text in eight is a test text


class OcrDatasetOptions(BaseModel):
    """Options of the OCR prompt dataset."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description=SEED_HELP)
    train_size: int = Field(4000, ge=1, le=100_000, description=TRAIN_SIZE_HELP)
    test_size: int = Field(1000, ge=1, le=100_000, description=TEST_SIZE_HELP)
    path: str | None = Field(None, description=PATH_HELP)
    test_path: str | None = Field(None, description=TEST_PATH_HELP)

    @model_validator(mode="after")
    def _test_path_needs_path(self) -> OcrDatasetOptions:
        if self.test_path is not None and self.path is None:
            raise ValueError("test_path is set without path: set [dataset] path to your train prompts file too.")
        return self


def is_test_text(text: str) -> bool:
    """Whether a target text belongs to the test split (a fixed hash, independent of seed and sizes)."""
    return zlib.crc32(normalize(text).encode("utf-8")) % _TEST_MODULUS == 0


def generate(split: str, n: int, seed: int = 0) -> list[PromptItem]:
    """``n`` distinct generated prompts of a split ("train" or "test"), deterministic for a seed."""
    rng = random.Random(f"tpflow-ocr-{split}-{seed}")  # str seeds are hashed stably (sha512)
    want_test = split == "test"
    seen: set[str] = set()
    items: list[PromptItem] = []
    while len(items) < n:
        words = rng.sample(WORDS, rng.randint(1, 3))
        text = " ".join(words).upper() if rng.random() < 0.5 else " ".join(w.capitalize() for w in words)
        if is_test_text(text) != want_test:
            continue
        prompt = rng.choice(TEMPLATES).format(text)
        if prompt in seen:
            continue
        seen.add(prompt)
        items.append(PromptItem(prompt, {"target": text}))
    return items


def _from_file(path: str) -> list[PromptItem]:
    return [PromptItem(line, {"target": target_text(line)}) for _, line in _lines(path)]


@register("dataset", "ocr", options=OcrDatasetOptions)
class OcrDataset:
    """PromptDataset: quoted-text prompts for the ``ocr`` reward (module docstring), generated or read from files.

    Options: ``seed``, ``train_size``, ``test_size`` (generated prompts), ``path`` / ``test_path`` (your files).
    """

    splits = ("train", "test")
    metadata_keys = ("target",)  # the text to render, generated or read from the prompt's quotes

    def __init__(self, options: OcrDatasetOptions | None = None):
        options = options or OcrDatasetOptions()
        if options.path is not None:
            self._items = {"train": _from_file(options.path), "test": _from_file(options.test_path or options.path)}
        else:
            self._items = {
                "train": generate("train", options.train_size, options.seed),
                "test": generate("test", options.test_size, options.seed),
            }

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)
