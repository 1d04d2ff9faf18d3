"""Prompt datasets read from the user's files: ``text-file`` (one prompt per line) and ``jsonl``.

    [dataset]
    name = "jsonl"
    path = "data/geneval_train.jsonl"       # {"prompt": "...", <metadata>...} per line
    test_path = "data/geneval_test.jsonl"

Files are read when the component is built: by ``tpflow validate`` and at the start of ``tpflow train``
(``tpflow.preflight``), before any weights load. A file must be a regular UTF-8 text file of at most 1 GiB.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.types import PromptItem

# the descriptions of the dataset options the file-reading datasets share (text-file, jsonl, geneval, ocr), written
# once; seed and test_size, which the shapes worlds take too, are tpflow.shapes.prompts's
PATH_HELP = (
    'The train split\'s prompts file: one prompt per line (text-file, ocr), one {"prompt": ..., <metadata>...} JSON '
    "object per line (jsonl), or GenEval metadata, one {tag, include, exclude?, prompt} per line (geneval). Unset, "
    "geneval and ocr generate the train prompts. edit-jsonl: an instruction and its source image(s) per JSON line "
    "(docs/rewards.md, 'Editing datasets')."
)
TEST_PATH_HELP = (
    "The test split's prompts file, in path's format (geneval: e.g. GenEval's evaluation_metadata.jsonl). Unset: "
    "geneval generates the test prompts, ocr takes path's (or generates them without path; test_path needs path), "
    "and text-file and jsonl have no test split: evaluations sample the training prompts, and say so (a warning, "
    "eval_on_train_split in the metrics)."
)
TRAIN_SIZE_HELP = "Generated train prompts, distinct (geneval: balanced over the six GenEval tags)."


class FileDatasetOptions(BaseModel):
    """Where the prompts are."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description=PATH_HELP)
    test_path: str | None = Field(None, description=TEST_PATH_HELP)


MAX_PROMPT_FILE_BYTES = 1 << 30  # 1 GiB: millions of prompts; a bigger "prompt file" is the wrong file


def _lines(path: str) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 prompt file, numbered from 1; UserError for anything else."""
    from tpflow.files import regular_file_problem

    file = Path(path).expanduser()
    problem = regular_file_problem(file, "The prompt file")
    if problem and not file.exists() and not file.is_absolute():
        raise UserError(
            f"{problem[:-1]}: a relative path is read from the working directory, so it looked for "
            f"{Path.cwd() / file}. Run from the folder that holds it, set [dataset] path (and test_path) to where the "
            "prompts are, or make the file (the recipe's header comment says where its prompts come from; for the "
            "paper recipes' PickScore prompts see docs/rewards.md, 'Prompt files of the paper recipes')."
        )
    if problem:
        raise UserError(f"{problem} Set [dataset] path (and test_path) to a text file of prompts.")
    size = file.stat().st_size
    if size > MAX_PROMPT_FILE_BYTES:
        raise UserError(f"The prompt file {file} is {size / 2**30:.1f} GiB, more than a prompt file's 1 GiB limit.")
    data = file.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(
            f"The prompt file {file} is not UTF-8 text: line {line} has the byte {data[exc.start : exc.start + 1]!r} "
            f"at offset {exc.start}. Save it as UTF-8."
        ) from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line]
    if not lines:
        raise UserError(f"The prompt file {file} has no prompts (it is empty or blank).")
    return lines


@register("dataset", "text-file", options=FileDatasetOptions)
class TextFileDataset:
    """PromptDataset: one prompt per line, blank lines skipped, no metadata; a test split with ``test_path``."""

    metadata_keys = ()  # no metadata: a reward that reads some is refused with it (tpflow.rewards.needs)

    def __init__(self, options: FileDatasetOptions):
        self._items = {"train": [PromptItem(line, {}) for _, line in _lines(options.path)]}
        if options.test_path:
            self._items["test"] = [PromptItem(line, {}) for _, line in _lines(options.test_path)]
        self.splits = tuple(self._items)

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


@register("dataset", "jsonl", options=FileDatasetOptions)
class JsonlDataset:
    """PromptDataset: one JSON object per line with a ``prompt`` string, the other keys its metadata; a test split
    with ``test_path``."""

    metadata_keys = None  # whatever its lines hold: checked item by item when it is built (tpflow.rewards.needs)

    def __init__(self, options: FileDatasetOptions):
        self._items = {"train": _read_jsonl(options.path)}
        if options.test_path:
            self._items["test"] = _read_jsonl(options.test_path)
        self.splits = tuple(self._items)

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


def _read_jsonl(path: str) -> list[PromptItem]:
    items = []
    for n, line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n} is not valid JSON: {exc}.") from None
        except RecursionError:
            raise UserError(
                f"{path}:{n} nests JSON arrays or objects too deeply to read; a prompt line is flat."
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'{path}:{n} must be an object with a "prompt" string, got {line[:80]!r}.')
        prompt = record.pop("prompt")
        if not prompt.strip():
            raise UserError(f'{path}:{n} has an empty "prompt".')
        items.append(PromptItem(prompt, record))
    return items


def _split(items: dict[str, list[PromptItem]], name: str) -> list[PromptItem]:
    if name not in items:
        raise UserError(f"Unknown split {name!r}; this dataset has: {', '.join(items)}.")
    return items[name]
