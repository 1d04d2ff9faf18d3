"""Prompt datasets read from the user's files: ``text-file`` (one prompt per line) and ``jsonl``.

    [dataset]
    name = "jsonl"
    path = "data/geneval_train.jsonl"       # {"prompt": "...", <metadata>...} per line
    test_path = "data/geneval_test.jsonl"

Files are read when the component is built, not when the recipe is validated.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.types import PromptItem


class FileDatasetOptions(BaseModel):
    """Where the prompts are."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Training prompts file.")
    test_path: str | None = Field(None, description="Held-out prompts file for evaluation (default: `path`).")


def _lines(path: str) -> list[tuple[int, str]]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"Prompt file not found: {file}. Set [dataset] path to an existing file.")
    lines = [(n, line.strip()) for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line]
    if not lines:
        raise UserError(f"Prompt file {file} has no prompts.")
    return lines


@register("dataset", "text-file", options=FileDatasetOptions)
class TextFileDataset:
    """PromptDataset: one prompt per line, blank lines skipped, no metadata."""

    splits = ("train", "test")

    def __init__(self, options: FileDatasetOptions):
        self._items = {
            "train": [PromptItem(line, {}) for _, line in _lines(options.path)],
            "test": [PromptItem(line, {}) for _, line in _lines(options.test_path or options.path)],
        }

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


@register("dataset", "jsonl", options=FileDatasetOptions)
class JsonlDataset:
    """PromptDataset: one JSON object per line with a ``prompt`` string; the other keys are its metadata."""

    splits = ("train", "test")

    def __init__(self, options: FileDatasetOptions):
        self._items = {"train": _read_jsonl(options.path), "test": _read_jsonl(options.test_path or options.path)}

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


def _read_jsonl(path: str) -> list[PromptItem]:
    items = []
    for n, line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n} is not valid JSON: {exc}.") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'{path}:{n} must be an object with a "prompt" string, got {line[:80]!r}.')
        prompt = record.pop("prompt")
        items.append(PromptItem(prompt, record))
    return items


def _split(items: dict[str, list[PromptItem]], name: str) -> list[PromptItem]:
    if name not in items:
        raise UserError(f"Unknown split {name!r}; this dataset has: {', '.join(items)}.")
    return items[name]
