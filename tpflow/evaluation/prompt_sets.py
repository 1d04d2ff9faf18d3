"""The prompts ``tpflow eval`` samples: the recipe's own splits, a named benchmark set, or a file.

test, train      the recipe's dataset splits (test: what training evaluates on; its train split, said so, for a
                 dataset that has no test split); any other split the dataset has by its name (shapes-edit's
                 held-out: the instructions never trained on, on many scenes; reserved: pretrained
                 instructions RL left out)
geneval          GenEval-style prompts with GenEval metadata, generated (tpflow.data.geneval's test split);
                 for GenEval's official 553 prompts pass its evaluation_metadata.jsonl as a file
ocr              the OCR test prompts (tpflow.data.ocr's test split: texts never seen in training)
PATH.jsonl       {"prompt": ..., <metadata>} per line; GenEval metadata lines (tag, include) are read as such;
                 for an editing backbone, an edit-jsonl file ({"prompt", "source" or "sources", <metadata>} per line)
PATH (other)     one prompt per line
"""

from __future__ import annotations

import json
from pathlib import Path

from tpflow import registry
from tpflow.errors import UserError
from tpflow.interfaces import capability
from tpflow.recipe import Recipe
from tpflow.train.evaluation import eval_split
from tpflow.types import PromptItem

NAMED = ("test", "train", "geneval", "ocr")


def check_prompt_set(name: str, recipe: Recipe) -> None:
    """A UserError before any weights load unless ``name`` is one of ``NAMED``, an existing file, or a split of the
    recipe's dataset."""
    if name in NAMED or Path(name).expanduser().is_file():
        return
    splits = recipe.build("dataset").splits
    if name not in splits:
        raise UserError(
            f"--prompts {name!r} is neither {', '.join(NAMED)}, a split of the recipe's dataset "
            f"({', '.join(splits)}), nor an existing prompt file."
        )


def prompt_set(name: str, recipe: Recipe) -> tuple[list[PromptItem], str | None]:
    """The items of the prompt set ``name`` (one of ``NAMED`` or a file path), and the dataset split they are (None
    for a file): "train" for ``test`` of a dataset without a test split, as the trainer. See the module docstring."""
    if name in ("test", "train"):
        dataset = recipe.build("dataset")
        split = eval_split(dataset) if name == "test" else name
        if split not in dataset.splits:
            raise UserError(f"The recipe's dataset {recipe.dataset.name!r} has no {name!r} split.")
        return list(dataset.split(split)), split
    if name == "geneval":
        return list(registry.build("dataset", "geneval", train_size=1).split("test")), "test"
    if name == "ocr":
        return list(registry.build("dataset", "ocr").split("test")), "test"
    path = Path(name).expanduser()
    if not path.exists():
        dataset = recipe.build("dataset")  # a further split of the recipe's dataset (shapes-edit's held-out)
        if name in dataset.splits:
            return list(dataset.split(name)), name
        raise UserError(
            f"Prompt set {name!r} is neither one of {', '.join(NAMED)}, a split of the recipe's dataset "
            f"({', '.join(dataset.splits)}), nor an existing file (no such path: {path})."
        )
    if not path.is_file():
        raise UserError(f"Prompt set {path} is not a regular file; give a .jsonl or a text file of prompts.")
    if path.suffix == ".jsonl":
        if _edits_images(recipe):  # each line's instruction with its source(s), checked as training checks them
            min_side = getattr(recipe.dataset.options, "min_side", 1)  # the recipe's own limit for an edit-jsonl
            return list(
                registry.build("dataset", "edit-jsonl", path=str(path), min_side=min_side).split("train")
            ), None
        if _is_geneval_metadata(path):
            return list(registry.build("dataset", "geneval", train_size=1, test_path=str(path)).split("test")), None
        return list(registry.build("dataset", "jsonl", path=str(path)).split("train")), None
    return list(registry.build("dataset", "text-file", path=str(path)).split("train")), None


def _edits_images(recipe: Recipe) -> bool:
    """Whether the recipe's backbone takes source images (capability ``source_images``): its prompt file is then an
    edit-jsonl file (tpflow.data.edit_jsonl, plain layout: a "source" or "sources" per line, relative to the file)."""
    return tuple(capability(registry.get("backbone", recipe.backbone.name).factory, "source_images"))[1] > 0


def _is_geneval_metadata(path: Path) -> bool:
    """True when the file's first record carries GenEval's ``tag`` and ``include`` fields."""
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        record = json.loads(first) if first else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False  # the jsonl reader gives the one-paragraph error
    return isinstance(record, dict) and "tag" in record and "include" in record
