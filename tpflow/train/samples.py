"""Image grids of evaluation samples, written with PIL (no plotting stack needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tpflow.rewards._images import to_uint8_hwc


def save_grid(images: torch.Tensor, path: Path, cols: int = 8, scale: int = 4, pad: int = 2) -> Path:
    """Tile images [N, 3, H, W] in [0, 1] into one PNG, each upscaled ``scale``× (nearest), white gaps."""
    n, _, h, w = images.shape
    rows = math.ceil(n / cols)
    cell_h, cell_w = h * scale + pad, w * scale + pad
    canvas = np.full((rows * cell_h + pad, cols * cell_w + pad, 3), 255, dtype=np.uint8)
    pixels = to_uint8_hwc(images)  # [N, H, W, 3], the rewards' quantisation
    for i, image in enumerate(pixels):
        r, c = divmod(i, cols)
        big = image.repeat(scale, axis=0).repeat(scale, axis=1)
        canvas[pad + r * cell_h : pad + r * cell_h + h * scale, pad + c * cell_w : pad + c * cell_w + w * scale] = big
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path)
    return path
