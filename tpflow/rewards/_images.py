"""Helpers shared by the CLIP-based rewards (``pickscore``, ``clipscore``, ``aesthetic``).

Images arrive as float tensors in [0, 1]; the reference quantises them to uint8 before its PIL-based CLIP
preprocessing (docs/algorithm.md §7). ``clip_preprocess`` does the same preprocessing in torch on the whole batch
(resize the shortest side with PIL's antialiased bicubic, centre-crop, normalise), which is fast on the GPU and
independent of the batch: each image goes through exactly the same operations whatever its neighbours. It differs
from PIL only by PIL's rounding of each resampling pass to uint8 (about one grey level).

``load_open_clip`` finds open_clip weights on disk without ever downloading: a checkpoint path, or a pretrained tag
whose file is already in the Hugging Face cache (or open_clip's ``~/.cache/clip``); ``open_clip_source`` says where
before anything loads (the rewards' ``weight_sources`` hooks, ``tpflow.weights``).
"""

from __future__ import annotations

import difflib
import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.weights import WeightSource, cached_file, download_command, hub_cache_dir


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


@dataclass(frozen=True)
class OpenClip:
    """An open_clip model with what its inputs need."""

    model: torch.nn.Module  # .encode_image(pixels [N, 3, h, w]) -> [N, D]; .encode_text(tokens [N, L]) -> [N, D]
    tokenizer: Callable[[list[str]], Tensor]  # prompts -> [N, L] long, truncated to the context length
    resize: int
    crop: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    mode: str
    squash: bool

    def preprocess(self, images: Tensor) -> Tensor:
        """[N, 3, H, W] in [0, 1] -> [N, 3, h, w] normalised model input on the model's device."""
        device = next(self.model.parameters()).device
        return clip_preprocess(
            images.to(device), self.resize, self.crop, self.mean, self.std, self.mode, self.squash, offset="round"
        )


def load_open_clip(arch: str, pretrained: str, device: torch.device, where: str) -> OpenClip:
    """Build open_clip model ``arch`` with weights ``pretrained`` (a file, or a tag already cached), in eval mode.

    Args:
        arch: an open_clip architecture name, e.g. ``"ViT-L-14"``.
        pretrained: a checkpoint file (.safetensors, .bin, .pt) or an open_clip pretrained tag, e.g. ``"openai"``.
        device: where the model lives.
        where: names the options in error messages, e.g. ``"reward 'clipscore' (options model, pretrained)"``.
    Raises:
        UserError: unknown architecture, missing checkpoint file, or a tag whose weights are not cached.
    """
    import open_clip

    checkpoint, tag_cfg = find_open_clip(arch, pretrained, where)
    preprocess = {k: tag_cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if k in tag_cfg}
    model = open_clip.create_model(
        arch,
        pretrained=checkpoint,
        device=device,
        force_quick_gelu=bool(tag_cfg.get("quick_gelu", False)),  # OpenAI weights were trained with QuickGELU
        force_preprocess_cfg=preprocess,
        pretrained_text=False,
    ).eval()
    model.requires_grad_(False)
    cfg = open_clip.get_model_preprocess_cfg(model)
    size = cfg["size"]
    crop = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    return OpenClip(
        model=model,
        tokenizer=open_clip.get_tokenizer(arch),
        resize=max(crop),
        crop=crop,
        mean=tuple(cfg.get("mean", open_clip.OPENAI_DATASET_MEAN)),
        std=tuple(cfg.get("std", open_clip.OPENAI_DATASET_STD)),
        mode="bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic",
        squash=cfg.get("resize_mode") == "squash",
    )


class LazyOpenClip:
    """An open_clip model built at its first ``get()`` (``load_open_clip``), once, under a lock: the rewards build
    it in the scoring thread, where the first calls of two threads must share one model. ``pretrained`` may be a
    callable giving the checkpoint path then (a cache lookup that must not run when the recipe is built)."""

    def __init__(self, arch: str, pretrained: str | Callable[[], str], device: torch.device, where: str) -> None:
        import threading

        self.arch, self.pretrained, self.device, self.where = arch, pretrained, device, where
        self._lock = threading.Lock()
        self._clip: OpenClip | None = None

    def get(self) -> OpenClip:
        with self._lock:
            if self._clip is None:
                pretrained = self.pretrained() if callable(self.pretrained) else self.pretrained
                self._clip = load_open_clip(self.arch, pretrained, self.device, self.where)
            return self._clip


def open_clip_source(what: str, arch: str, pretrained: str, where: str) -> WeightSource:
    """Where ``load_open_clip(arch, pretrained)`` will read its checkpoint (``tpflow.weights``), or why it cannot.

    Args:
        what: the weight and its options, e.g. "reward 'clipscore' open_clip weights (options model, pretrained)".
        where: as for ``load_open_clip``: names the options in the problem.
    """
    try:
        checkpoint, _ = find_open_clip(arch, pretrained, where)
    except UserError as exc:
        return WeightSource(what, f"{arch} {pretrained}", None, str(exc))
    if Path(pretrained).expanduser().is_file():
        origin = "local file"
    elif Path(checkpoint).resolve().is_relative_to(hub_cache_dir().resolve()):
        origin = "Hugging Face cache"
    else:
        origin = "open_clip cache"
    return WeightSource(what, f"{arch} {pretrained}", f"{origin} {checkpoint}", path=checkpoint)


def find_open_clip(arch: str, pretrained: str, where: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint file, the tag's open_clip config or {}) of open_clip ``arch`` with ``pretrained``, found on disk
    without touching the network; UserError for an unknown architecture or tag, or weights not on this machine."""
    import open_clip

    if open_clip.get_model_config(arch) is None:
        close = difflib.get_close_matches(arch, open_clip.list_models(), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UserError(f"{where}: {arch!r} is not an open_clip architecture.{hint} See open_clip.list_models().")
    path = Path(pretrained).expanduser()
    if path.is_file():
        return str(path), {}
    tag_cfg = open_clip.get_pretrained_cfg(arch, pretrained)
    if not tag_cfg:
        if os.sep in pretrained or path.suffix in {".safetensors", ".bin", ".pt", ".pth"} or path.is_dir():
            raise UserError(
                f"{where}: the checkpoint file {pretrained} does not exist (or is a folder). Give the path of an "
                f"open_clip checkpoint file of {arch!r}, or one of its pretrained tags."
            )
        tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "(none)"
        raise UserError(
            f"{where}: {pretrained!r} is neither a checkpoint file nor a pretrained tag of open_clip {arch!r} "
            f"(tags: {tags})."
        )
    looked: list[str] = []
    hub = tag_cfg.get("hf_hub", "")
    if hub:
        repo, filename = posixpath.split(hub)  # open_clip's convention: "org/name/" means the default file
        filename = filename or "open_clip_pytorch_model.bin"
        for name in (*_safetensors_names(filename), filename):
            found = cached_file(repo, name)
            if found:
                return found, tag_cfg
            looked.append(f"{repo}/{name} in the Hugging Face cache {hub_cache_dir()}")
    url = tag_cfg.get("url", "")
    if url:
        local = Path("~/.cache/clip").expanduser() / os.path.basename(url)
        if local.is_file():
            return str(local), tag_cfg
        looked.append(str(local))
    how = download_command(posixpath.split(hub)[0]) if hub else f"open_clip (pretrained={pretrained!r})"
    raise UserError(
        f"{where}: the weights of open_clip {arch!r} with tag {pretrained!r} are not on this machine (looked for "
        f"{'; '.join(looked)}) and tpflow never downloads them. Fetch them once with "
        f"{how}, "
        "or set the option to the path of a local checkpoint file."
    )


def _safetensors_names(filename: str) -> list[str]:
    """open_clip prefers a .safetensors twin of a pickled checkpoint when the hub has one."""
    if filename == "open_clip_pytorch_model.bin":
        return ["open_clip_model.safetensors"]
    if filename.endswith((".bin", ".pth")):
        return [filename[:-4] + ".safetensors"]
    return []
