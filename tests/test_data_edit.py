"""The editing dataset ``edit-jsonl``: an instruction and its source image(s) per JSON line, read from the plain
layout and from flow_grpo's Kontext layout to the same items, every source checked by its header before anything
loads (a missing, corrupt, non-image or too small file, a line without a source: one paragraph naming the file and
the line)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tpflow import registry
from tpflow.errors import UserError
from tpflow.sources import SOURCES
from tpflow.types import PromptItem


def png(path: Path, size: tuple[int, int] = (16, 12), value: int = 128) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 0, 255 - value)).save(path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(**options) -> object:
    entry = registry.get("dataset", "edit-jsonl")
    return entry.factory(entry.options(**{"min_side": 8, **options}))


def test_the_plain_layout_and_flow_grpos_kontext_layout_read_to_the_same_items(tmp_path) -> None:
    plain, kontext = tmp_path / "plain", tmp_path / "kontext"
    for folder in (plain, kontext):
        png(folder / "images" / "a.png", value=10)
        png(folder / "images" / "b.png", value=200)
    write_jsonl(
        plain / "edits.jsonl",
        [
            {"prompt": "make it red", "source": "images/a.png", "tag": "color"},
            {"instruction": "add a cat", "sources": ["images/b.png"], "tag": "counting", "include": [1]},
        ],
    )
    write_jsonl(plain / "test.jsonl", [{"prompt": "remove it", "source": "images/b.png"}])
    # flow_grpo's GenevalPromptImageDataset (scripts/train_flux_kontext.py): <folder>/{split}_metadata.jsonl, the
    # source under "image", relative to the folder
    write_jsonl(
        kontext / "train_metadata.jsonl",
        [
            {"prompt": "make it red", "image": "images/a.png", "tag": "color"},
            {"prompt": "add a cat", "image": "images/b.png", "tag": "counting", "include": [1]},
        ],
    )
    write_jsonl(kontext / "test_metadata.jsonl", [{"prompt": "remove it", "image": "images/b.png"}])

    a = build(path=str(plain / "edits.jsonl"), test_path=str(plain / "test.jsonl"))
    b = build(path=str(kontext), layout="flow_grpo-kontext")
    assert a.splits == b.splits == ("train", "test")
    for split in a.splits:
        relocated = [
            PromptItem(it.prompt, {**it.metadata, SOURCES: [s.replace(str(kontext), str(plain)) for s in refs]})
            for it in b.split(split)
            for refs in [it.metadata[SOURCES]]
        ]
        assert a.split(split) == relocated
    assert a.split("train") == [
        PromptItem("make it red", {"tag": "color", SOURCES: [str(plain / "images" / "a.png")]}),
        PromptItem("add a cat", {"tag": "counting", "include": [1], SOURCES: [str(plain / "images" / "b.png")]}),
    ]
    assert all(Path(s).is_absolute() for it in b.split("test") for s in it.metadata[SOURCES])
    assert a.summary == "3 lines read, 2 source image(s) checked (headers only)"


def _jpeg() -> bytes:
    """A 64x48 JPEG of noise (about 2.5 kB, most of it the scan)."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def _hostile(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A one-line edit file whose source is wrong in the way ``case`` names, and what the refusal must say."""
    source = tmp_path / "src.png"
    png(tmp_path / "good.png")
    if case == "missing":
        expected = "does not exist"
    elif case == "corrupt":
        data = png(source).read_bytes()
        source.write_bytes(data[: len(data) - 10])  # cut short, as by a download that stopped: the header still reads
        expected = "is corrupt or truncated"
    elif case == "truncated jpeg":  # a JPEG's header and verify() read no body: the cut is found by decoding it
        source.write_bytes(_jpeg()[:-600])  # its header (tables included) whole, its scan cut short
        expected = "is corrupt or truncated"
    elif case == "not an image":
        source.write_text("just some text\n")
        expected = "is not an image"
    else:  # too small
        png(source, size=(300, 4))
        expected = "300x4 px, smaller than [dataset] min_side = 8"
    lines = [{"prompt": "keep it", "source": "good.png"}, {"prompt": "edit it", "source": "src.png"}]
    return write_jsonl(tmp_path / "edits.jsonl", lines), expected


@pytest.mark.parametrize("case", ["missing", "corrupt", "truncated jpeg", "not an image", "too small"])
def test_a_bad_source_is_refused_naming_the_file_and_the_line(tmp_path, case) -> None:
    file, expected = _hostile(tmp_path, case)
    with pytest.raises(UserError) as err:
        build(path=str(file))
    text = str(err.value)
    assert text.startswith(f"{file}:2: the source image {tmp_path / 'src.png'}"), text
    assert expected in text and "line 2 of the file's 2 prompt lines; the 1 before it passed" in text, text
    assert "\n" not in text


@pytest.mark.parametrize(
    "line, expected",
    [
        ({"prompt": "edit it"}, 'no source image: an editing line needs "source"'),
        ({"prompt": "edit it", "sources": []}, "no source image"),
        ({"prompt": "edit it", "source": "a.png", "sources": ["a.png"]}, 'both "source" and "sources"'),
        ({"source": "a.png"}, 'no instruction: it needs a non-empty "prompt" or "instruction"'),
    ],
)
def test_a_line_without_a_source_or_an_instruction_is_refused(tmp_path, line, expected) -> None:
    png(tmp_path / "a.png")
    file = write_jsonl(tmp_path / "edits.jsonl", [line])
    with pytest.raises(UserError) as err:
        build(path=str(file))
    assert str(err.value).startswith(f"{file}:1 ") and expected in str(err.value), str(err.value)


def test_a_missing_kontext_folder_is_named_with_the_file_looked_for_in_it(tmp_path) -> None:
    with pytest.raises(UserError) as err:
        build(path=str(tmp_path / "counting_edit"), layout="flow_grpo-kontext")
    assert f"{tmp_path / 'counting_edit' / 'train_metadata.jsonl'} was not found" in str(err.value), str(err.value)


def test_a_whole_jpeg_passes_with_or_without_a_trailer(tmp_path) -> None:
    """A JPEG whose last bytes are not its end marker is decoded to be sure: a trailer (a motion photo's) reads."""
    from tpflow.data.edit_jsonl import image_problem

    whole, trailer = tmp_path / "whole.jpg", tmp_path / "trailer.jpg"
    whole.write_bytes(_jpeg())
    trailer.write_bytes(_jpeg() + b"ftypmp42" * 64)
    assert image_problem(whole, 8) is None and image_problem(trailer, 8) is None
