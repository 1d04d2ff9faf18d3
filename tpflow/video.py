"""Clips shown as images: a video backbone decodes clips [N, F, 3, H, W]; grids, sample sheets and trajectory plots
show each clip as a strip of a few of its frames, side by side, so every place that lays out images lays out clips
unchanged."""

from __future__ import annotations

import torch
from torch import Tensor


def strip_frames(frames: int, most: int = 4) -> list[int]:
    """Up to ``most`` frame indices evenly spaced over ``frames``, the first and the last included."""
    if frames <= most:
        return list(range(frames))
    return sorted({round(i * (frames - 1) / (most - 1)) for i in range(most)})


def frame_strip(images: Tensor, most: int = 4) -> Tensor:
    """Clips [..., F, 3, H, W] (5-D and more) -> [..., 3, H, k·W]: ``strip_frames`` of each clip side by side;
    images [N, 3, H, W] are returned as they are."""
    if images.ndim < 5:
        return images
    picked = images[..., strip_frames(images.shape[-4], most), :, :, :]  # [..., k, 3, H, W]
    return torch.cat(picked.unbind(dim=-4), dim=-1)
