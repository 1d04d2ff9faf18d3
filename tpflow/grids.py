"""Captioned image grids: every grid tpflow writes (the trainer's ``samples/eval_XXXX.png``, ``tpflow eval``'s
``grid.png`` and ``comparison.png``, ``tpflow sample``'s PNG), each with its tile map beside it (``<name>.png.json``).

Tiles are enlarged (nearest) to at least ``MIN_TILE`` pixels and set apart by white gaps, the caption (the prompt)
wrapped under each. A tile may carry a pass/fail mark, a frame in the gap around it (``MARKS`` says which colour means
what; a tile without one gets a thin grey outline): the evaluation grids mark GenEval-style rewards' strict verdict.
The tile map gives, per tile, its box in the PNG, its caption and whatever the caller adds (the image's index in
``eval.json``, its score, ...). A clip's tile is a strip of some of its frames (``tpflow.video.frame_strip``): each
frame is sized on its own and a ``DIVIDER`` of mid-grey set between them, so that one moving shape does not read as
several; the tile map gives each frame's box (``frame_boxes``). An edit's tile (``Tile.sources``) is a strip too:
its source image(s), each resized to the edit's size, then the edit, set apart by the same divider and captioned with
the instruction; the tile map gives ``source_boxes`` and ``edit_box``. Tiles with fewer sources than others get
white panels on the left, so that every edit lines up in the last panel.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from tpflow.images import to_uint8_hwc

MIN_TILE = 160  # pixels: smaller images are enlarged (nearest) to at least this side
PAD = 8  # the white gap between tiles (the mark's frame is drawn inside it)
FRAME = 3  # width of the pass/fail frame
GROUP_GAP = 4 * PAD  # the extra gap between column groups (a comparison's pairs)
CAPTION_LINES = 3
NOTE = (40, 40, 160)  # a tile's note (its score): dark blue, apart from the black prompt
FONT_SIZE = 12  # Pillow's own font (no font file needed); below 12 its spacing runs words together
GRID_IMAGES = 64  # evaluation grids show at most this many images of an eval (``shown_images`` says which)
EVAL_TILE = 256  # evaluation grids shrink larger images to this side, to keep the PNGs small
PASS, FAIL, EDGE = (0, 160, 0), (220, 0, 0), (190, 190, 190)  # frame colours; EDGE: a thin outline, no verdict
DIVIDER, DIVIDER_COLOUR = 2, (128, 128, 128)  # a clip's strip: mid-grey pixels between its frames, at display size
MARKS = "green frame: strictly correct (the reward's strict detail is 1); red frame: not; thin grey line: no verdict"


@dataclass(frozen=True)
class Tile:
    """One image of a grid and what is written with it."""

    image: torch.Tensor  # [3, H, W] float in [0, 1]
    caption: str  # drawn under the image; the tile map's "prompt"
    mark: bool | None = None  # True: pass (green frame), False: fail (red), None: no frame
    info: dict[str, Any] = field(default_factory=dict)  # more entries of this tile in the tile map
    note: str = ""  # one short line drawn above the caption, e.g. the image's reward ("score 0.734")
    frames: torch.Tensor | None = None  # a clip's frames [F, 3, H, W] uint8 (``image``: a strip of some of them)
    sources: tuple[torch.Tensor, ...] = ()  # an edit's source images [3, h, w] in [0, 1], drawn left of ``image``


@dataclass(frozen=True)
class Grid:
    """Where each tile landed: ``boxes[i]`` = (left, top, right, bottom) of tile i's image in the PNG."""

    path: Path
    size: tuple[int, int]  # (width, height)
    boxes: list[tuple[int, int, int, int]]
    prompts: list[str]  # [len(boxes)] the caption of each tile


def shown_images(
    prompts: int, per_prompt: int, limit: int = GRID_IMAGES, texts: Sequence[str] | None = None
) -> tuple[list[int], str]:
    """Which images of a prompt-major evaluation (image r is the (r mod n)-th of prompt r // n) a grid shows, and
    the rule in words: every image when they fit in ``limit``; else m = limit // k prompts spread evenly (prompt
    ⌊i·P/m⌋ for i < m, the first always), each with its first k = min(n, limit) images.

    With ``texts`` (each prompt's text), when that even spread would repeat a text while others go unshown (an eval
    set that asks a few instructions on many scenes, in passes: every ⌊P/m⌋-th prompt can fall on the same two), the
    prompts are chosen to cover the distinct texts instead (``_covering``)."""
    total = prompts * per_prompt
    if total <= limit:
        return list(range(total)), f"all {total} images"
    keep = min(per_prompt, limit)
    count = min(prompts, limit // keep)
    chosen = [i * prompts // count for i in range(count)]
    each = f"its first {keep} of {per_prompt} images" if keep < per_prompt else f"its {per_prompt} image(s)"
    how = f"{count} of {prompts} prompts spread evenly (prompt floor(i*{prompts}/{count}) for i = 0..{count - 1}: "
    how += f"{', '.join(map(str, chosen[:3]))}, ...)"
    if texts is not None:
        distinct = len(set(texts))
        if len({texts[p] for p in chosen}) < min(count, distinct):
            chosen = _covering(list(texts), count)
            how = f"{count} of {prompts} prompts, " + (
                f"the first prompt of {count} of their {distinct} distinct texts spread evenly"
                if distinct >= count
                else f"each of their {distinct} distinct texts in rounds, its prompts spread evenly"
            )
    rows = [p * per_prompt + j for p in chosen for j in range(keep)]
    return rows, f"{len(rows)} of {total} images: {how}, {each}"


def _covering(texts: list[str], count: int) -> list[int]:
    """``count`` prompt indices (sorted) covering as many distinct ``texts`` as fit: when there are at least
    ``count`` texts, the first prompt of every ⌊i·D/count⌋-th text (in order of first appearance); otherwise rounds
    r = 0, 1, ... over the texts in that order, round r taking each text's occurrence ⌊r·n_t/R⌋ of its n_t (R rounds
    in all), until ``count`` are taken, then the other prompts spread evenly when rounds fell short (texts
    with fewer prompts than rounds)."""
    where: dict[str, list[int]] = {}
    for index, text in enumerate(texts):
        where.setdefault(text, []).append(index)
    occurrences = list(where.values())  # [D] each text's prompt indices, in order of first appearance
    if len(occurrences) >= count:
        return [occurrences[i * len(occurrences) // count][0] for i in range(count)]
    rounds, picked = -(-count // len(occurrences)), []  # R rounds fill count: each takes D < count prompts
    for r in range(rounds):
        for occurrence in occurrences:
            index = occurrence[r * len(occurrence) // rounds]
            if index not in picked and len(picked) < count:
                picked.append(index)
    rest = sorted(set(range(len(texts))) - set(picked))  # texts of few prompts left rounds short: the rest, evenly
    need = count - len(picked)
    return sorted(picked + [rest[j * len(rest) // need] for j in range(need)] if need > 0 else picked)


def columns_for(per_group: int, count: int, width: int = 8) -> int:
    """Columns of a grid of ``count`` tiles whose groups (a prompt's images, a comparison's pairs) of ``per_group``
    stay on one row: about ``width``, never more than the tiles."""
    return per_group * max(1, min(width, count) // per_group)


def captioned_grid(
    tiles: list[Tile],
    columns: int,
    path: Path,
    headers: list[str] | None = None,
    group: int = 0,
    max_tile: int | None = None,
    about: dict[str, Any] | None = None,
) -> Grid:
    """Draw ``tiles`` ``columns`` per row, each caption wrapped under its image, and write the PNG and its tile map
    ``<path>.json`` (size, boxes, captions, each tile's ``info`` and mark, ``about``, ``MARKS`` when a tile has one).

    Args:
        headers: a label above each column (``columns`` of them), e.g. "baseline" / "trained".
        group: a wider gap after every ``group`` columns (0: none).
        max_tile: larger images are shrunk to this side (None: never).
    """
    canvas, size, boxes = _draw(tiles, columns, headers, group, max_tile)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)  # zlib level 6: optimize=True is 8x slower for 4% less
    grid = Grid(path, size, boxes, [t.caption for t in tiles])
    _write_tile_map(grid, tiles, headers, about)
    return grid


def clip_grid(
    tiles: list[Tile], columns: int, path: Path, max_tile: int | None = None, ms_per_frame: int = 250
) -> Path:
    """An animated WebP of clips laid out as ``captioned_grid`` lays out images: frame f of the animation shows each
    tile's frame f (``Tile.frames``), with the same captions, marks and notes; it loops."""
    count = min(t.frames.shape[0] for t in tiles if t.frames is not None)
    pictures = []
    for f in range(count):
        shown = [replace(t, image=t.frames[f].float() / 255) if t.frames is not None else t for t in tiles]
        pictures.append(_draw(shown, columns, None, 0, max_tile)[0])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=ms_per_frame, loop=0, quality=90)
    return path


def _draw(
    tiles: list[Tile], columns: int, headers: list[str] | None, group: int, max_tile: int | None
) -> tuple[Image.Image, tuple[int, int], list[tuple[int, int, int, int]]]:
    """The grid's picture, its size and each tile's image box (``captioned_grid``'s layout)."""
    tiles = edit_strips(tiles)
    h, w = tiles[0].image.shape[-2:]
    count = strip_count(tiles)  # frames side by side in each tile (1: an image)
    fw = w // count  # a frame's width in the tile's image
    side = max(h, fw) if edit_panels(tiles) else max(h, w)  # an edit's panels are each sized as an image tile
    scale = max(1, math.ceil(MIN_TILE / side))
    shrink = min(1.0, max_tile / side) if max_tile else 1.0
    frame_w, tile_h = (round(fw * shrink), round(h * shrink)) if shrink < 1 else (fw * scale, h * scale)
    tile_w = count * frame_w + (count - 1) * DIVIDER
    font = ImageFont.load_default(size=FONT_SIZE)
    line_h = _line_height(font)
    chars = max(8, int(tile_w / max(1.0, font.getlength("x"))))
    notes = any(t.note for t in tiles)  # a line above the captions, in every tile's place when any has one
    caption_h = FRAME + (CAPTION_LINES + notes) * line_h + PAD
    header_h = line_h + PAD if headers else 0
    rows = math.ceil(len(tiles) / columns)
    lefts = [PAD + c * (tile_w + PAD) + (c // group if group else 0) * GROUP_GAP for c in range(columns)]
    width, height = lefts[-1] + tile_w + PAD, header_h + rows * (tile_h + caption_h + PAD) + PAD
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for c, label in enumerate(headers or []):
        draw.text((lefts[c], PAD), label, fill="black", font=font)
    pixels = to_uint8_hwc(torch.stack([t.image for t in tiles]))  # [R, H, W, 3], the rewards' quantisation
    boxes = []
    for i, (tile, image) in enumerate(zip(tiles, pixels, strict=True)):
        r, c = divmod(i, columns)
        left, top = lefts[c], header_h + PAD + r * (tile_h + caption_h + PAD)
        for j, x in enumerate(_frame_lefts(left, count, frame_w)):  # a strip's frames each sized on its own
            frame = np.ascontiguousarray(image[:, j * fw : (j + 1) * fw])  # [H, fw, 3] uint8
            canvas.paste(_sized(frame, frame_w, tile_h, shrink, scale), (x, top))
            if j:
                draw.rectangle((x - DIVIDER, top, x - 1, top + tile_h - 1), fill=DIVIDER_COLOUR)
        box = (left, top, left + tile_w, top + tile_h)
        boxes.append(box)
        _frame_and_caption(draw, tile, box, font, chars, notes, line_h)
    return canvas, (width, height), boxes


def edit_panels(tiles: list[Tile]) -> int:
    """Panels side by side in the grid's edit tiles: the most sources of a tile, plus the edit (0: no edit)."""
    most = max((len(t.sources) for t in tiles), default=0)
    return most + 1 if most else 0


def edit_strip(image: torch.Tensor, sources: tuple[torch.Tensor, ...], panels: int) -> torch.Tensor:
    """An edit [3, H, W] after its sources [3, h, w] (each resized to H × W, bilinear): [3, H, panels · W] in [0, 1],
    white panels first where the edit has fewer than ``panels`` - 1 sources."""
    h, w = image.shape[-2:]
    shown = [F.interpolate(s[None].float().cpu(), size=(h, w), mode="bilinear", antialias=True)[0] for s in sources]
    blank = [torch.ones(3, h, w, device="cpu")] * (panels - 1 - len(sources))
    return torch.cat([*blank, *shown, image.float().cpu()], dim=-1).clamp(0, 1)


def edit_strips(tiles: list[Tile]) -> list[Tile]:
    """The tiles as drawn: each edit's image replaced by its strip source(s) | edit (``edit_strip``), all with as
    many panels; the tiles as they are when none has sources."""
    panels = edit_panels(tiles)
    if not panels:
        return tiles
    return [replace(t, image=edit_strip(t.image, t.sources, panels)) for t in tiles]


def strip_count(tiles: list[Tile]) -> int:
    """How many frames side by side each tile's image holds: a clip's strip (``Tile.frames`` given, the image as
    high as a frame and a whole number of frames wide) holds width / frame width; an edit's strip its sources and
    itself (``edit_panels``); an image holds 1."""
    if edit_panels(tiles):
        return edit_panels(tiles)
    tile = next((t for t in tiles if t.frames is not None), None)
    if tile is None:
        return 1
    (h, w), (fh, fw) = tile.image.shape[-2:], tile.frames.shape[-2:]
    return w // fw if h == fh and w % fw == 0 else 1


def _frame_lefts(left: int, count: int, frame_w: int) -> list[int]:
    """The left edge of each of a tile's ``count`` frames, ``DIVIDER`` apart."""
    return [left + j * (frame_w + DIVIDER) for j in range(count)]


def _frame_boxes(box: tuple[int, int, int, int], count: int) -> list[list[int]]:
    """Each frame's box inside a strip tile's ``box`` (``_draw``'s layout)."""
    left, top, right, bottom = box
    frame_w = (right - left - (count - 1) * DIVIDER) // count
    return [[x, top, x + frame_w, bottom] for x in _frame_lefts(left, count, frame_w)]


def _sized(image: np.ndarray, tile_w: int, tile_h: int, shrink: float, scale: int) -> Image.Image:
    """One tile's image at its size in the grid: shrunk smoothly (LANCZOS) when ``shrink`` < 1, else enlarged by
    repeating pixels ``scale`` times, so that a small image's pixels stay sharp, as the reward saw them."""
    if shrink < 1:  # image: [H, W, 3] uint8
        return Image.fromarray(image).resize((tile_w, tile_h), Image.Resampling.LANCZOS)
    return Image.fromarray(np.ascontiguousarray(image.repeat(scale, axis=0).repeat(scale, axis=1)))


def _frame_and_caption(
    draw: ImageDraw.ImageDraw,
    tile: Tile,
    box: tuple[int, int, int, int],
    font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
    chars: int,
    notes: bool,
    line_h: int,
) -> None:
    """Around the tile's image at ``box``: its pass/fail frame, or a thin outline that keeps a white-background
    image apart from the white gaps; under it the note (a line kept for it in every tile when ``notes``) and the
    wrapped caption."""
    left, top = box[:2]
    if tile.mark is None:  # white-background images stay apart from the white gaps
        draw.rectangle((left - 1, top - 1, box[2], box[3]), outline=EDGE, width=1)
    else:
        frame = (left - FRAME, top - FRAME, box[2] + FRAME - 1, box[3] + FRAME - 1)
        draw.rectangle(frame, outline=PASS if tile.mark else FAIL, width=FRAME)
    if tile.note:
        draw.text((left, box[3] + FRAME + 2), tile.note[:chars], fill=NOTE, font=font)
    for k, line in enumerate(_caption_lines(tile.caption, chars), start=int(notes)):
        draw.text((left, box[3] + FRAME + 2 + k * line_h), line, fill="black", font=font)


def _write_tile_map(grid: Grid, tiles: list[Tile], headers: list[str] | None, about: dict[str, Any] | None) -> None:
    """``<grid>.json`` beside the PNG: its size, each tile's box, caption, ``info`` and mark (and what the marks
    mean when any tile has one), the column headers and ``about``, so that a reader finds a tile's image and its
    figures without measuring the picture."""
    path = grid.path
    meta: dict[str, Any] = {"image": path.name, "size": list(grid.size), **(about or {})}
    if headers:
        meta["columns"] = list(headers)
    if any(t.mark is not None for t in tiles):
        meta["marks"] = MARKS
    count, edits = strip_count(tiles), edit_panels(tiles) > 0
    meta["tiles"] = [
        {"prompt": t.caption, "box": list(b), **_strip_boxes(t, b, count, edits), **t.info,
         **({} if t.mark is None else {"mark": "pass" if t.mark else "fail"})}
        for t, b in zip(tiles, grid.boxes, strict=True)
    ]  # fmt: skip
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(meta, indent=2), encoding="utf-8")


def _strip_boxes(tile: Tile, box: tuple[int, int, int, int], count: int, edits: bool) -> dict[str, Any]:
    """A strip tile's entries in the tile map: each frame's box (a clip), or in a grid of edits its sources' and its
    edit's (its sources right before the edit); nothing for an image."""
    if count == 1:
        return {}
    boxes = _frame_boxes(box, count)
    if not edits:
        return {"frame_boxes": boxes}
    return {"source_boxes": boxes[count - 1 - len(tile.sources) : -1], "edit_box": boxes[-1]}


def _caption_lines(caption: str, chars: int) -> list[str]:
    lines = textwrap.wrap(caption, chars) or [""]
    if len(lines) > CAPTION_LINES:
        lines = lines[:CAPTION_LINES]
        lines[-1] = lines[-1][: max(0, chars - 3)] + "..."
    return lines


def _line_height(font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> int:
    left, top, right, bottom = font.getbbox("Hgy")
    return int(bottom - top) + 3
