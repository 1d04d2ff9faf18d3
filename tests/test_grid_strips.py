"""A clip's tile in a PNG grid is a strip of some of its frames (tpflow.video.frame_strip): a mid-grey divider sits
between its frames at display size, each frame's pixels are that frame's, and the tile map gives every frame's box;
an image grid is laid out as before."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from tpflow.grids import DIVIDER, DIVIDER_COLOUR, PAD, Tile, captioned_grid, clip_grid
from tpflow.video import frame_strip, strip_frames


def _clips(n: int = 2, frames: int = 9, h: int = 8, w: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (n, frames, 3, h, w), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def _tiles(clips: torch.Tensor) -> list[Tile]:
    return [Tile(frame_strip(c[None])[0].float() / 255, f"clip {i}", frames=c) for i, c in enumerate(clips)]


def test_the_frames_of_a_strip_are_set_apart_by_a_divider(tmp_path):
    clips = _clips()
    grid = captioned_grid(_tiles(clips), 2, tmp_path / "grid.png")
    pixels = np.asarray(Image.open(grid.path).convert("RGB"))
    meta = json.loads((tmp_path / "grid.png.json").read_text())
    shown = strip_frames(clips.shape[1])  # [0, 3, 5, 8]
    for c, tile in enumerate(meta["tiles"]):
        boxes = tile["frame_boxes"]
        assert len(boxes) == len(shown) and boxes[0][0] == tile["box"][0] and boxes[-1][2] == tile["box"][2]
        scale = (boxes[0][2] - boxes[0][0]) // clips.shape[-1]
        assert scale > 1  # enlarged to the grid's minimum tile: the divider is drawn after, at display size
        for j, (left, top, right, bottom) in enumerate(boxes):
            frame = clips[c, shown[j]].permute(1, 2, 0).numpy().repeat(scale, 0).repeat(scale, 1)
            assert np.array_equal(pixels[top:bottom, left:right], frame)  # each frame's pixels, its own
            if j:
                divider = pixels[top:bottom, boxes[j - 1][2] : left]
                assert divider.shape[1] == DIVIDER and (divider == DIVIDER_COLOUR).all()
    assert meta["tiles"][1]["box"][0] - meta["tiles"][0]["box"][2] == PAD  # tiles apart as before, no divider


def test_a_shrunk_strip_keeps_its_divider_whole(tmp_path):
    """Evaluation grids shrink large tiles (Wan's 416-px frames to a 256-px tile): the divider is not shrunk away."""
    clips = _clips(1, 5, 64, 96)
    grid = captioned_grid(_tiles(clips), 1, tmp_path / "grid.png", max_tile=128)
    pixels = np.asarray(Image.open(grid.path).convert("RGB"))
    boxes = json.loads((tmp_path / "grid.png.json").read_text())["tiles"][0]["frame_boxes"]
    for before, after in zip(boxes, boxes[1:], strict=False):
        divider = pixels[after[1] : after[3], before[2] : after[0]]
        assert divider.shape[1] == DIVIDER and (divider == DIVIDER_COLOUR).all()


def test_an_image_grid_and_the_animation_have_no_dividers(tmp_path):
    images = torch.rand(2, 3, 8, 8)
    grid = captioned_grid([Tile(i, "image") for i in images], 2, tmp_path / "images.png")
    meta = json.loads((tmp_path / "images.png.json").read_text())
    assert "frame_boxes" not in meta["tiles"][0]
    assert grid.boxes[0][2] - grid.boxes[0][0] == 8 * 20  # enlarged 20x to the 160-px minimum, nothing added
    clips = _clips(2, 3)
    webp = clip_grid(_tiles(clips), 2, tmp_path / "clips.webp")
    assert Image.open(webp).n_frames == 3
