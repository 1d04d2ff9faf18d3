"""Pixel conversion: images as the rewards, the sample grids, ``inspect-trajectory`` and evaluation see them.

A backbone decodes to float tensors in [0, 1]; the references quantise them to uint8 before anything reads them
(docs/algorithm.md §7), so every consumer goes through ``to_uint8`` (one quantisation, the same on every device).
``clip_preprocess`` does CLIP's PIL-based preprocessing in torch on the whole batch (resize the shortest side with
PIL's antialiased bicubic, centre-crop, normalise), which is fast on the GPU and independent of the batch: each image
goes through exactly the same operations whatever its neighbours. It differs from PIL only by PIL's rounding of each
resampling pass to uint8 (about one grey level). ``pad_preprocess`` is open_clip's resize-longest-side-and-pad
transform that HPS v2 scores with.

A low-level module: it imports torch and numpy, nothing from tpflow, so that any room may use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def to_uint8(images: Tensor) -> Tensor:
    """[N, 3, H, W] float in [0, 1] -> uint8 as round(x · 255) clipped, the reference's conversion (NaN -> 0).

    The one quantisation every reward, the reward server and the sample grids use.
    """
    return (torch.nan_to_num(images.detach().float(), nan=0.0) * 255).round().clamp(0, 255).to(torch.uint8)


def to_uint8_hwc(images: Tensor) -> np.ndarray:
    """[N, 3, H, W] float in [0, 1] (any device) -> [N, H, W, 3] uint8 numpy (PIL / OpenCV layout), by ``to_uint8``.

    Quantised where the images are, then copied: a quarter of the bytes of float32 cross to the host, and the values
    are the same on every device (one correctly rounded product, then round half to even).
    """
    return to_uint8(images).cpu().permute(0, 2, 3, 1).numpy()


def clip_preprocess(
    images: Tensor,
    resize: int,
    crop: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    mode: str = "bicubic",
    squash: bool = False,
    offset: str = "floor",
) -> Tensor:
    """CLIP image preprocessing in torch, image by image: PIL's resize, a centre crop, normalisation.

    Args:
        images: [N, 3, H, W] float in [0, 1] (any device).
        resize: target of the shortest side (ignored when ``squash``).
        crop: (height, width) of the centre crop, the model's input size.
        mean, std: per-channel normalisation of the model.
        mode: ``"bicubic"`` (CLIP, PickScore) or ``"bilinear"``.
        squash: resize straight to ``crop`` without keeping the aspect ratio (SigLIP-style models).
        offset: how an odd margin is split: ``"floor"`` as transformers' processors, ``"round"`` (half to even) as
            torchvision's CenterCrop in open_clip's transforms.
    Returns:
        [N, 3, crop[0], crop[1]] float32, normalised.
    """
    x = to_uint8(images).float() / 255  # [N, 3, H, W] on the uint8 grid, like the reference's PIL images
    h, w = x.shape[-2:]
    if squash:
        size = crop
    else:  # torchvision / transformers rule: the long side is int(resize · long / short)
        short, long = min(h, w), max(h, w)
        size = (resize, int(resize * long / short)) if h <= w else (int(resize * long / short), resize)
    if size[0] < crop[0] or size[1] < crop[1]:
        raise ValueError(f"Image resized to {size[0]}x{size[1]} is smaller than the crop {crop[0]}x{crop[1]}.")
    if offset == "floor":
        top, left = (size[0] - crop[0]) // 2, (size[1] - crop[1]) // 2
    else:
        top, left = int(round((size[0] - crop[0]) / 2.0)), int(round((size[1] - crop[1]) / 2.0))
    # PIL resizes in two separable passes, horizontal then vertical, clipping each to the pixel range (what matters
    # on detailed images, where the cubic's negative lobes overshoot). Only the rows and columns of the crop are made.
    rows = _resample_matrix(h, size[0], mode, x.device)[top : top + crop[0]]  # [crop_h, H]
    cols = _resample_matrix(w, size[1], mode, x.device)[left : left + crop[1]]  # [crop_w, W]
    x = torch.einsum("nchw,jw->nchj", x, cols).clamp(0, 1)  # [N, 3, H, crop_w]
    x = torch.einsum("ih,nchj->ncij", rows, x).clamp(0, 1)  # [N, 3, crop_h, crop_w]
    mean_t = torch.tensor(mean, dtype=x.dtype, device=x.device)[:, None, None]
    std_t = torch.tensor(std, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean_t) / std_t


def pad_preprocess(images: Tensor, size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """open_clip's ``ResizeMaxSize`` validation transform in torch, image by image: the longest side resized to
    ``size`` (antialiased bicubic, aspect kept), the rest padded with black, then normalised.

    What the hpsv2 package scores with: its open_clip fork's ``image_transform(..., resize_longest_max=True)``, which
    ``create_model_and_transforms(light_augmentation=True)`` builds (tgxs002/HPSv2, ``hpsv2/img_score.py`` and
    ``hpsv2/src/open_clip/transform.py``). The package resizes the float tensor of the 8-bit image with torchvision
    (``F.resize``, bicubic, antialiased) and never clamps, so the cubic's overshoot past [0, 1] is kept here too;
    the shorter side is ``round(side · size / longest)`` (half to even) and the margin is split with the odd pixel
    at the bottom and the right. One difference: an image whose longest side is already ``size`` is padded here,
    where the package returns it unpadded (a non-square input its ViT cannot take).

    Args:
        images: [N, 3, H, W] float in [0, 1] (any device).
        size: the model's square input side (224 for HPS's ViT-H-14).
        mean, std: per-channel normalisation of the model.
    Returns:
        [N, 3, size, size] float32, normalised (padding becomes -mean / std).
    """
    x = to_uint8(images).float() / 255  # [N, 3, H, W] on the uint8 grid, like the package's ToTensor()
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    new_h, new_w = round(h * scale), round(w * scale)  # the package's rounding, computed the same way
    rows = _resample_matrix(h, new_h, "bicubic", x.device)  # [new_h, H]
    cols = _resample_matrix(w, new_w, "bicubic", x.device)  # [new_w, W]
    x = torch.einsum("ih,nchw,jw->ncij", rows, x, cols)  # [N, 3, new_h, new_w], not clamped
    top, left = (size - new_h) // 2, (size - new_w) // 2
    out = x.new_zeros(*x.shape[:2], size, size)  # [N, 3, size, size] black
    out[..., top : top + new_h, left : left + new_w] = x
    mean_t = torch.tensor(mean, dtype=x.dtype, device=x.device)[:, None, None]
    std_t = torch.tensor(std, dtype=x.dtype, device=x.device)[:, None, None]
    return (out - mean_t) / std_t


def _resample_matrix(size_in: int, size_out: int, mode: str, device: torch.device) -> Tensor:
    """[size_out, size_in] float32 weights of PIL's antialiased resampling along one axis.

    PIL (what the reference's processors resize with) stretches the filter by the downscale factor and
    renormalises it at the borders; its bicubic is Keys' cubic with a = -0.5.
    """
    if size_in == size_out:
        return torch.eye(size_out, device=device)
    scale = size_in / size_out
    stretch = max(scale, 1.0)
    # Built in float64 on the CPU, then moved: the weights are the same whatever the images' device.
    center = (torch.arange(size_out, dtype=torch.float64, device="cpu") + 0.5) * scale  # [out] source coordinates
    t = ((torch.arange(size_in, dtype=torch.float64, device="cpu") + 0.5)[None, :] - center[:, None]).abs() / stretch
    if mode == "bilinear":
        weights = (1 - t).clamp(min=0)
    else:  # Keys' cubic convolution with a = -0.5
        a = -0.5
        weights = torch.where(
            t < 1, ((a + 2) * t - (a + 3)) * t * t + 1, torch.where(t < 2, (((t - 5) * t + 8) * t - 4) * a, 0.0)
        )
    weights = weights / weights.sum(dim=1, keepdim=True)
    return weights.to(device=device, dtype=torch.float32)


def l2_normalize(x: Tensor) -> Tensor:
    """Rows of [N, D] scaled to unit L2 norm, in float32."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True)
