"""Grids of edits: a tile of an editing prompt shows its source image(s) left of the edit (tpflow.grids.edit_strip),
set apart by the clips' divider and captioned with the instruction; the tile map says where the sources and the edit
are. The trainer's (and ``tpflow eval``'s) sample grid does it from the item's ``metadata["sources"]``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tpflow.grids import DIVIDER, DIVIDER_COLOUR, Tile, captioned_grid
from tpflow.train.evaluation import Scored, save_eval_grid
from tpflow.types import PromptItem


def _png(path: Path, pixels: np.ndarray) -> str:
    Image.fromarray(pixels).save(path)
    return str(path)


def _uint8(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)  # [h, w, 3]


def test_an_eval_grid_of_an_edit_is_source_then_edit_twice_as_wide(tmp_path: Path):
    """The tile of an edit is two panels of the image tile's width (a divider between): the left one the source's
    pixels, the right one the edit's; the instruction is its caption, the tile map names the source and both boxes.
    The same image without a source is one panel."""
    source = _uint8(8, 8, 0)
    edit = torch.from_numpy(_uint8(8, 8, 1)).permute(2, 0, 1)[None]  # [1, 3, 8, 8] uint8, as the eval keeps it
    ref = _png(tmp_path / "source.png", source)
    items = [PromptItem("make the square blue", {"sources": [ref]})]
    scored = Scored([0], [0.5], {}, grid=[edit], grid_rows=[0], grid_rule="all 1 images")
    grid = save_eval_grid(scored, items, tmp_path / "edit.png")
    plain = save_eval_grid(scored, [PromptItem("make the square blue", {})], tmp_path / "plain.png")

    width = plain.boxes[0][2] - plain.boxes[0][0]  # the image tile, enlarged to the grid's minimum
    left, top, right, bottom = grid.boxes[0]
    assert right - left == 2 * width + DIVIDER and bottom - top == plain.boxes[0][3] - plain.boxes[0][1]
    pixels = np.asarray(Image.open(grid.path).convert("RGB"))
    scale = width // 8
    assert np.array_equal(pixels[top:bottom, left : left + width], source.repeat(scale, 0).repeat(scale, 1))
    edit_hwc = edit[0].permute(1, 2, 0).numpy()
    assert np.array_equal(pixels[top:bottom, right - width : right], edit_hwc.repeat(scale, 0).repeat(scale, 1))
    assert (pixels[top:bottom, left + width : left + width + DIVIDER] == DIVIDER_COLOUR).all()
    meta = json.loads((tmp_path / "edit.png.json").read_text())
    (tile,) = meta["tiles"]
    assert tile["prompt"] == "make the square blue" and tile["sources"] == [ref]
    assert tile["source_boxes"] == [[left, top, left + width, bottom]]
    assert tile["edit_box"] == [right - width, top, right, bottom]
    assert "source image" in meta["edits"]
    assert "edits" not in json.loads((tmp_path / "plain.png.json").read_text())


def test_edits_with_fewer_sources_line_up_behind_white_panels(tmp_path: Path):
    """As ``tpflow sample`` would draw them (tiles given their sources): a prompt of two sources and one of one
    source of another size; both edits sit in the last panel, the missing source is white, a source is resized."""
    edits = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    a, b = (torch.from_numpy(_uint8(h, w, s)).permute(2, 0, 1).float() / 255 for h, w, s in ((8, 8, 3), (16, 4, 4)))
    tiles = [Tile(edits[0], "add a circle", sources=(a, b)), Tile(edits[1], "remove the square", sources=(b,))]
    grid = captioned_grid(tiles, 2, tmp_path / "grid.png")
    meta = json.loads((tmp_path / "grid.png.json").read_text())["tiles"]
    pixels = np.asarray(Image.open(grid.path).convert("RGB"))
    assert len(meta[0]["source_boxes"]) == 2 and len(meta[1]["source_boxes"]) == 1
    first = meta[1]["source_boxes"][0]
    blank_right = first[0] - DIVIDER  # the white panel left of the one source
    assert (pixels[first[1] : first[3], meta[1]["box"][0] : blank_right] == 255).all()
    for tile, image in zip(meta, edits, strict=True):
        x0, y0, x1, y1 = tile["edit_box"]
        shown = pixels[y0:y1, x0:x1][:: (y1 - y0) // 8, :: (x1 - x0) // 8]  # back to 8 x 8
        expected = (image.permute(1, 2, 0).numpy() * 255).round()
        assert np.abs(shown.astype(float) - expected).max() <= 1
