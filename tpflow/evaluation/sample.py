"""``tpflow sample``: a few images of a trained run or adapter for a quick look, each with its prompt under it.

One row per prompt, ``n`` images per row, ODE-sampled like ``tpflow eval`` (image j of prompt i starts from row
i·n + j of one seeded noise draw). Small images (the shapes world's 32 px) are enlarged so the grid is readable.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from tpflow.devices import cpu_generator
from tpflow.evaluation.targets import Target, load_model
from tpflow.rewards._images import to_uint8_hwc
from tpflow.rollout import sample_ode

MIN_TILE = 160  # pixels: smaller images are enlarged (nearest) to at least this side
PAD = 6
CAPTION_LINES = 3


@dataclass(frozen=True)
class Grid:
    """Where each tile landed: ``boxes[i]`` = (left, top, right, bottom) of image i in the PNG."""

    path: Path
    size: tuple[int, int]  # (width, height)
    boxes: list[tuple[int, int, int, int]]
    prompts: list[str]  # [len(boxes)] the prompt of each tile


@torch.no_grad()
def sample_images(
    target: Target,
    prompts: list[str],
    n: int,
    steps: int,
    guidance: float,
    seed: int,
    autocast: Callable[[], AbstractContextManager],
    ema: bool = True,
    batch_size: int = 16,
) -> torch.Tensor:
    """[len(prompts)·n, 3, H, W] images in [0, 1], prompt-major."""
    torch.manual_seed(target.recipe.train.seed)
    backbone = load_model(target, ema=ema)
    rows = [p for p in prompts for _ in range(n)]
    z0 = backbone.initial_noise(len(rows), cpu_generator(seed))
    images = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        cond = backbone.encode(part)
        with autocast():
            latents = sample_ode(backbone, cond, z0[start : start + len(part)], backbone.sigmas(steps), guidance,
                                 batch_size)  # fmt: skip
        images.append(backbone.decode(latents).float().cpu())
    return torch.cat(images)


def captioned_grid(images: torch.Tensor, prompts: list[str], n: int, path: Path) -> Grid:
    """Tile ``images`` [R, 3, H, W] in [0, 1] ``n`` per row, each prompt wrapped under its image; write a PNG and
    ``<path>.json`` (the tile boxes and prompts)."""
    count, _, h, w = images.shape
    scale = max(1, math.ceil(MIN_TILE / max(h, w)))
    tile_w, tile_h = w * scale, h * scale
    font = ImageFont.load_default()
    line_h = _line_height(font)
    chars = max(8, int(tile_w / max(1.0, font.getlength("x"))))
    caption_h = CAPTION_LINES * line_h + PAD
    rows = math.ceil(count / n)
    width = n * (tile_w + PAD) + PAD
    height = rows * (tile_h + caption_h + PAD) + PAD
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    pixels = to_uint8_hwc(images)  # [R, H, W, 3], the rewards' quantisation
    boxes = []
    for i, (image, prompt) in enumerate(zip(pixels, prompts, strict=True)):
        r, c = divmod(i, n)
        left, top = PAD + c * (tile_w + PAD), PAD + r * (tile_h + caption_h + PAD)
        big = np.ascontiguousarray(image.repeat(scale, axis=0).repeat(scale, axis=1))
        canvas.paste(Image.fromarray(big), (left, top))
        boxes.append((left, top, left + tile_w, top + tile_h))
        lines = textwrap.wrap(prompt, chars)[:CAPTION_LINES] or [""]
        if len(textwrap.wrap(prompt, chars)) > CAPTION_LINES:
            lines[-1] = lines[-1][: max(0, chars - 3)] + "..."
        for k, line in enumerate(lines):
            draw.text((left, top + tile_h + 2 + k * line_h), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    grid = Grid(path, (width, height), boxes, list(prompts))
    meta = {"image": path.name, "size": list(grid.size), "tiles": [{"prompt": p, "box": list(b)} for p, b in
                                                                    zip(prompts, boxes, strict=True)]}  # fmt: skip
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return grid


def _line_height(font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> int:
    left, top, right, bottom = font.getbbox("Hgy")
    return int(bottom - top) + 3
