"""tpflow.grids: which images of a large evaluation a grid shows (the stated rule), and what a grid draws (marks,
column headers, large images shrunk), read back from its pixels through its tile map."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from tpflow.grids import EDGE, FAIL, FRAME, PASS, Tile, captioned_grid, columns_for, shown_images


def test_a_small_eval_is_shown_whole():
    rows, rule = shown_images(12, 1)
    assert rows == list(range(12)) and rule == "all 12 images"


def test_a_large_eval_shows_prompts_spread_evenly_with_their_images():
    rows, rule = shown_images(192, 1)  # the shapes recipe's eval: one image for each third prompt
    assert rows == list(range(0, 192, 3))
    assert rule.startswith("64 of 192 images: 64 of 192 prompts spread evenly")
    rows, rule = shown_images(553, 4)  # GenEval: 16 prompts, all 4 images of each, the first prompt first
    assert len(rows) == 64 and rows[:5] == [0, 1, 2, 3, 34 * 4]
    assert [r // 4 for r in rows[::4]] == [i * 553 // 16 for i in range(16)]
    assert "16 of 553 prompts" in rule and "its 4 image(s)" in rule
    rows, rule = shown_images(2, 40)  # more images per prompt than fit: the first prompt's first 64 of them
    assert rows == list(range(40)) and "1 of 2 prompts" in rule


def test_an_eval_that_asks_few_texts_in_passes_shows_each_text():
    """160 prompts, 8 instructions asked in passes over 20 scenes: the even spread (every 20th prompt) would show two
    of the 8; the grid shows each once. With fewer texts than shown prompts every text is shown, then again; with
    distinct texts (or texts the even spread already covers) the rule is the even spread."""
    texts = [f"instruction {i % 8}" for i in range(160)]
    assert {texts[r // 8] for r in shown_images(160, 8)[0]} == {"instruction 0", "instruction 4"}
    rows, rule = shown_images(160, 8, texts=texts)
    assert sorted({r // 8 for r in rows}) == list(range(8)) and len(rows) == 64
    assert "the first prompt of 8 of their 8 distinct texts" in rule
    six = [f"instruction {i % 6}" for i in range(120)]
    shown = sorted({r // 8 for r in shown_images(120, 8, texts=six)[0]})
    assert len(shown) == 8 and {six[p] for p in shown} == set(six) and shown[:6] == list(range(6))
    assert shown_images(192, 1, texts=[str(i) for i in range(192)]) == shown_images(192, 1)
    assert shown_images(12, 1, texts=["a"] * 12) == shown_images(12, 1)
    few = ["a", "b"] * 3 + [f"c{i}" for i in range(4)] + ["a"] * 60  # 7 texts, 70 prompts: the rounds fall short
    rows = shown_images(70, 1, texts=few)[0]
    assert len(rows) == 64 == len(set(rows)) and {few[r] for r in rows} == set(few)


def test_grid_draws_headers_marks_and_captions_where_its_tile_map_says(tmp_path):
    g = torch.Generator().manual_seed(0)
    images = 0.2 + 0.6 * torch.rand(3, 3, 512, 512, generator=g)  # large: shrunk to max_tile
    tiles = [Tile(images[i], f"prompt {i}", mark, {"index": i}) for i, mark in enumerate([True, False, None])]
    path = tmp_path / "g.png"
    grid = captioned_grid(tiles, 2, path, headers=["baseline", "trained"], group=2, max_tile=256)
    layout = json.loads(path.with_suffix(".png.json").read_text())
    pixels = np.asarray(Image.open(path).convert("RGB"))
    assert tuple(layout["size"]) == grid.size == (pixels.shape[1], pixels.shape[0])
    assert layout["columns"] == ["baseline", "trained"] and "green frame" in layout["marks"]
    assert [t.get("mark") for t in layout["tiles"]] == ["pass", "fail", None]
    assert [t["index"] for t in layout["tiles"]] == [0, 1, 2]
    for tile, colour in zip(layout["tiles"], [PASS, FAIL, EDGE], strict=True):
        left, top, right, bottom = tile["box"]
        assert (right - left, bottom - top) == (256, 256)
        assert pixels[top:bottom, left:right].std() > 1  # the image
        assert tuple(pixels[top - 1, (left + right) // 2]) == colour  # its frame (or outline) just outside
        caption = pixels[bottom + FRAME : bottom + FRAME + 14, left:right]
        assert (caption.max(axis=-1) < 100).any()  # dark caption text below the frame
    first_top = layout["tiles"][0]["box"][1]
    for tile in layout["tiles"][:2]:  # a header above each column
        assert (pixels[: first_top - FRAME, tile["box"][0] : tile["box"][2]].max(axis=-1) < 100).any()


def test_a_tile_note_is_drawn_between_its_image_and_its_caption(tmp_path):
    """Eval grids of rewards without a strict verdict showed no figure on their tiles (only eval.json had it)."""
    from tpflow.grids import NOTE

    image = torch.full((3, 32, 32), 0.5)
    plain = captioned_grid([Tile(image, "a prompt")], 1, tmp_path / "plain.png")
    noted = captioned_grid([Tile(image, "a prompt", note="score 0.734")], 1, tmp_path / "noted.png")
    pixels = np.asarray(Image.open(noted.path).convert("RGB")).astype(int)
    before = np.asarray(Image.open(plain.path).convert("RGB")).astype(int)
    assert noted.size[1] > plain.size[1]  # a line more under every tile
    left, _, right, bottom = noted.boxes[0]
    band = pixels[bottom + FRAME : bottom + FRAME + 14, left:right]  # the first line under the image
    blue = (band[..., 2] - band[..., 0] > 60).sum()  # the note's colour, not the black prompt's
    assert blue > 5 and NOTE[2] - NOTE[0] > 60
    assert (before[bottom + FRAME : bottom + FRAME + 14, left:right][..., 2] - before[bottom + FRAME : bottom + FRAME
            + 14, left:right][..., 0] > 60).sum() == 0  # fmt: skip
    below = pixels[bottom + FRAME + 14 : bottom + FRAME + 30, left:right]
    assert (below.max(axis=-1) < 100).any()  # the prompt, one line lower


def test_eval_tiles_carry_their_score_whatever_the_reward():
    from tpflow.train.evaluation import Scored, grid_tiles
    from tpflow.types import PromptItem

    pixels = [torch.zeros(1, 3, 8, 8, dtype=torch.uint8)] * 2
    scored = Scored([0, 1], [0.25, 0.7341], {}, grid=pixels, grid_rows=[0, 1])  # no strict detail: PickScore-like
    tiles = grid_tiles(scored, [PromptItem("a", {}), PromptItem("b", {})])
    assert [t.note for t in tiles] == ["score 0.250", "score 0.734"] and all(t.mark is None for t in tiles)


def test_columns_keep_a_prompts_images_or_a_comparisons_pair_on_one_row():
    assert columns_for(1, 64) == 8 and columns_for(4, 64) == 8 and columns_for(3, 60) == 6
    assert columns_for(2, 48) == 8 and columns_for(8, 32) == 8  # pairs of 1 and of 4 images
    assert columns_for(1, 3) == 3 and columns_for(2, 2) == 2  # a small grid is no wider than its tiles
