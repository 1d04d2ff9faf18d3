"""tpflow.sources: an editing prompt's sources reach the backbone once per (instruction, sources) pair, and a group
is one such pair's samples; a text-only backbone keeps its one-argument encode."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tpflow import sources
from tpflow.errors import UserError
from tpflow.types import Conditioning, PromptItem


class _TextOnly:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def encode(self, prompts):  # the protocol's one-argument encode: no sources= keyword at all
        self.calls.append(list(prompts))
        return Conditioning({"row": torch.arange(len(prompts))})


class _Editing(_TextOnly):
    source_images = (1, 2)

    def encode(self, prompts, sources=None):
        self.calls.append(list(prompts))
        self.seen = sources
        means = torch.stack([torch.stack([s.mean() for s in per]).sum() for per in sources])  # [N]
        return Conditioning({"row": torch.arange(len(prompts)), "mean": means})


def _png(path, value: int, size: int = 8) -> str:
    Image.new("RGB", (size, size), (value, value, value)).save(path)
    return str(path)


def test_sources_reach_an_editing_backbone_once_per_pair_and_rows_follow_items(tmp_path) -> None:
    dark, light = _png(tmp_path / "a.png", 0), _png(tmp_path / "b.png", 255)
    items = [PromptItem("make it red", {"sources": [dark]}), PromptItem("make it red", {"sources": [light]}),
             PromptItem("make it red", {"sources": [dark]})]  # fmt: skip
    backbone = _Editing()
    cond = sources.encode_rows(backbone, items)
    assert len(backbone.calls) == 1 and len(backbone.calls[0]) == 2  # two distinct pairs, one call
    assert [tuple(s.shape) for per in backbone.seen for s in per] == [(3, 8, 8), (3, 8, 8)]
    assert cond.tensors["mean"].tolist() == [0.0, 1.0, 0.0]  # each row got its own source's encoding
    keys = [sources.group_text(it) for it in items]
    assert keys[0] == keys[2] != keys[1]  # one group per (instruction, source) pair


def test_a_text_only_backbone_is_called_without_sources_and_groups_by_text() -> None:
    backbone = _TextOnly()
    items = [PromptItem("a cat", {}), PromptItem("a dog", {}), PromptItem("a cat", {})]
    cond = sources.encode_rows(backbone, items)
    assert backbone.calls == [["a cat", "a dog"]] and cond.tensors["row"].tolist() == [0, 1, 0]
    assert sources.group_text(items[0]) == "a cat"  # text-to-image groups are unchanged


def test_schemes_render_without_files_and_bad_files_name_themselves(tmp_path) -> None:
    sources.register_scheme("test-grey", lambda spec: torch.full((3, 2, 2), float(spec)))
    assert sources.load("test-grey:0.25").mean().item() == 0.25
    with pytest.raises(ValueError, match="registered already"):
        sources.register_scheme("test-grey", lambda spec: torch.zeros(3, 1, 1))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(UserError, match="could not be read"):
        sources.load(str(tmp_path / "bad.png"))
    with pytest.raises(UserError, match="does not exist"):
        sources.load(str(tmp_path / "missing.png"))


def test_source_counts_outside_the_backbones_range_are_one_paragraph() -> None:
    assert sources.source_count_problem([1, 2], (1, 3), "qwen-image-edit") is None
    assert "needs each instruction's source" in sources.source_count_problem([0, 1], (1, 1), "flux.1-kontext-dev")
    assert "from text alone" in sources.source_count_problem([1], (0, 0), "sd3.5-medium")
