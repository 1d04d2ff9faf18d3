"""Dataset ``edit-jsonl``: editing prompts, an instruction and its source image(s) per JSON line.

    [dataset]
    name = "edit-jsonl"
    path = "data/edits/train.jsonl"     # {"prompt": "make the cup red", "source": "images/0001.png", ...} per line
    test_path = "data/edits/test.jsonl"
    min_side = 64                       # px: a smaller source (the short side) is refused

    # flow_grpo's FLUX.1 Kontext data (scripts/train_flux_kontext.py, github.com/yifan123/flow_grpo at 74db691):
    # a folder with train_metadata.jsonl and test_metadata.jsonl, {"prompt": ..., "image": <path>, ...} per line
    # layout = "flow_grpo-kontext"
    # path = "dataset/counting_edit"

A line of the plain layout holds the instruction (``prompt``, or ``instruction``), its source image as ``source`` (a
path) or its sources as ``sources`` (a list of paths, for a backbone that takes several), and any other keys, kept as
the item's metadata for the reward. A path is relative to the JSONL file's folder (or absolute, or ``scheme:spec`` of
a registered source scheme). Each line becomes ``PromptItem(instruction, {..., "sources": [absolute paths]})``: the
source keys are replaced by ``sources`` (``tpflow.sources.SOURCES``), so both layouts read to the same items.

The images are checked when the dataset is built (``tpflow validate`` and the start of ``tpflow train``, before any
weights load), each distinct file once, by its header alone (PIL's ``Image.open(...).size`` and ``verify()``, no
pixels decoded, so tens of thousands of lines check in seconds): a missing file, one that is not an image, a corrupt
or unreadable one, one smaller than ``min_side`` on its short side, and a line without a source are each refused in
one paragraph naming the file and the line. Whether the backbone takes that many sources per prompt is the recipe's
check (``tpflow.data.source_counts``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tpflow.data.files import PATH_HELP, TEST_PATH_HELP, _lines, _split
from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.sources import SOURCES, scheme_of
from tpflow.types import PromptItem

LAYOUTS = ("plain", "flow_grpo-kontext")
KONTEXT_FILES = {"train": "train_metadata.jsonl", "test": "test_metadata.jsonl"}  # flow_grpo's {split}_metadata.jsonl
# the keys a line's instruction and sources may be given under, per layout (the first present is read)
PROMPT_KEYS = {"plain": ("prompt", "instruction"), "flow_grpo-kontext": ("prompt",)}
SOURCE_KEYS = {"plain": ("source", "sources"), "flow_grpo-kontext": ("image",)}
SOURCE_HELP = {
    "plain": '"source" (the path of the image to edit) or "sources" (a list of paths)',
    "flow_grpo-kontext": '"image" (the path of the image to edit)',
}


class EditJsonlOptions(BaseModel):
    """Where the editing prompts are, how their lines are laid out, and the smallest source image accepted."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description=PATH_HELP)
    test_path: str | None = Field(None, description=TEST_PATH_HELP)
    layout: Literal["plain", "flow_grpo-kontext"] = Field(
        "plain",
        description='How a line is written: "plain" ({"prompt" or "instruction", "source" or "sources", '
        '<metadata>...}) or "flow_grpo-kontext" (flow_grpo\'s FLUX.1 Kontext data: {"prompt", "image", '
        "<metadata>...}; path may be its folder, holding train_metadata.jsonl and test_metadata.jsonl).",
    )
    min_side: int = Field(
        64,
        ge=1,
        description="The smallest short side, in pixels, of a source image: a smaller one is refused before "
        "anything loads (a thumbnail or an icon is the wrong file for an editing model).",
    )


@register("dataset", "edit-jsonl", options=EditJsonlOptions)
class EditJsonlDataset:
    """PromptDataset: an instruction and its source image(s) per JSON line, the other keys its metadata; a test split
    with ``test_path`` (or flow_grpo's test_metadata.jsonl beside its train file)."""

    metadata_keys = (
        None  # the lines' own keys beside "sources": checked item by item when built (tpflow.rewards.needs)
    )

    def __init__(self, options: EditJsonlOptions):
        files = split_files(options)
        checked: dict[str, None] = {}  # the image files checked already (one look per file, whatever the lines)
        self._items = {split: read_edits(file, options, checked) for split, file in files.items()}
        self.splits = tuple(self._items)
        self.lines = sum(len(items) for items in self._items.values())
        self.summary = f"{self.lines} lines read, {len(checked)} source image(s) checked (headers only)"

    def split(self, name: str) -> list[PromptItem]:
        return _split(self._items, name)


def split_files(options: EditJsonlOptions) -> dict[str, Path]:
    """The JSONL file of each split: ``path`` and ``test_path``; with the flow_grpo layout ``path`` may be the folder
    of ``train_metadata.jsonl`` (and its ``test_metadata.jsonl``, the test split unless ``test_path`` says): a
    folder, or a path not ending in .jsonl (a missing folder is then named with the file looked for in it)."""
    path = Path(options.path).expanduser()
    files = {"train": path}
    if options.layout == "flow_grpo-kontext" and (path.is_dir() or path.suffix != ".jsonl"):
        files["train"] = path / KONTEXT_FILES["train"]
        if options.test_path is None and (path / KONTEXT_FILES["test"]).is_file():
            files["test"] = path / KONTEXT_FILES["test"]
    if options.test_path is not None:
        files["test"] = Path(options.test_path).expanduser()
    return files


def read_edits(file: Path, options: EditJsonlOptions, checked: dict[str, None]) -> list[PromptItem]:
    """The items of one JSONL file, every source image checked (``checked``: files already found good)."""
    lines = _lines(str(file))
    folder = file.absolute().parent
    items = []
    for n, line in lines:
        where = f"{file}:{n}"
        record = _record(line, where)
        prompt = _take_prompt(record, options.layout, where)
        refs = [_resolve(ref, folder) for ref in _take_sources(record, options.layout, where)]
        for ref in refs:
            if ref not in checked and scheme_of(ref) is None:
                problem = image_problem(Path(ref), options.min_side)
                if problem:
                    raise UserError(f"{where}: {problem} ({_lines_before(n, lines)}).")
                checked[ref] = None
        items.append(PromptItem(prompt, {**record, SOURCES: refs}))
    return items


def _lines_before(n: int, lines: list[tuple[int, str]]) -> str:
    """How far the check got: 'line 7 of 120 lines; the 6 before it are fine'."""
    before = sum(1 for m, _ in lines if m < n)
    return f"line {n} of the file's {len(lines)} prompt lines; the {before} before it passed"


def _record(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where} is not valid JSON: {exc}.") from None
    except RecursionError:
        raise UserError(f"{where} nests JSON arrays or objects too deeply to read; an editing line is flat.") from None
    if not isinstance(record, dict):
        raise UserError(
            f"{where} must be a JSON object with an instruction and its source image(s), got {line[:80]!r}."
        )
    return record


def _take_prompt(record: dict[str, Any], layout: str, where: str) -> str:
    """The instruction, removed from the record (the first of the layout's prompt keys present)."""
    keys = PROMPT_KEYS[layout]
    key = next((k for k in keys if k in record), None)
    value = record.pop(key) if key else None
    for other in keys:  # "prompt" and "instruction" both given: which one is meant is not ours to guess
        if other in record:
            raise UserError(f'{where} gives both "{key}" and "{other}"; an editing line has one instruction.')
    if not isinstance(value, str) or not value.strip():
        named = " or ".join(f'"{k}"' for k in keys)
        raise UserError(f"{where} has no instruction: it needs a non-empty {named} string.")
    return value


def _take_sources(record: dict[str, Any], layout: str, where: str) -> list[str]:
    """The source references, removed from the record; a line without one is refused."""
    keys = [k for k in SOURCE_KEYS[layout] if k in record]
    if len(keys) > 1:
        raise UserError(f'{where} gives both "{keys[0]}" and "{keys[1]}"; give the source images under one of them.')
    value = record.pop(keys[0]) if keys else None
    refs = [value] if isinstance(value, str) else value
    if not refs or not isinstance(refs, list) or not all(isinstance(r, str) and r.strip() for r in refs):
        raise UserError(
            f"{where} has no source image: an editing line needs {SOURCE_HELP[layout]}, relative to the JSONL file's "
            f"folder; got {value!r:.80}."
        )
    return refs


def _resolve(ref: str, folder: Path) -> str:
    """A reference as the item carries it: a registered ``scheme:spec`` as written, a path made absolute against
    the JSONL file's folder."""
    if scheme_of(ref) is not None:
        return ref
    return str(folder / Path(ref).expanduser())


def _ends_with_eoi(path: Path) -> bool:
    """Whether a JPEG file ends with its end-of-image marker FF D9, as a whole one does (a download cut short not)."""
    with open(path, "rb") as file:
        file.seek(-2, 2)
        return file.read(2) == b"\xff\xd9"


def image_problem(path: Path, min_side: int) -> str | None:
    """Why ``path`` is no usable source image (a sentence), read from its header alone; None when it is one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:  # reads the header: format and size, no pixels
            width, height, fmt = *image.size, image.format
            image.verify()  # the file's structure (PNG chunks and their checksums), still no pixels decoded
        if fmt == "JPEG" and not _ends_with_eoi(path):  # verify() checks nothing of a JPEG's body
            with Image.open(path) as image:
                image.load()  # only such a file is decoded: a cut one raises, one with a trailer (motion photos) reads
    except FileNotFoundError:
        return f"the source image {path} does not exist"
    except IsADirectoryError:
        return f"the source image {path} is a folder, not an image file"
    except PermissionError:
        return f"the source image {path} cannot be read (permission denied)"
    except UnidentifiedImageError:
        return f"the source image {path} is not an image (its first bytes are no image format PIL reads)"
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # what PIL's decoders raise for a damaged file
        return f"the source image {path} is corrupt or truncated ({type(exc).__name__}: {exc})"
    if min(width, height) < min_side:
        return (
            f"the source image {path} is {width}x{height} px, smaller than [dataset] min_side = {min_side} px on its "
            "short side"
        )
    return None
