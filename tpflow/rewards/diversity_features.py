"""The feature extractors the ``diversity-shaped`` reward compares a group's images with, named by a spec string.

GARDO (docs/algorithm.md §10.9) measures how far an image lies from its siblings in DINOv3's feature space. What is
available offline here, by spec:

- ``"shapes-clip"`` (or ``"shapes-clip:<weights>"``): the image encoder of the shapes world's tiny CLIP, the weights
  shipped in tpflow/shapes/weights by default: the embedded world's features;
- ``"clip:<arch>"`` or ``"clip:<arch>:<pretrained>"``: an open_clip image encoder (``pretrained`` a cached tag or a
  local file, "openai" by default), read as the CLIP rewards read theirs, never downloaded;
- ``"timm:<model>"`` or ``"timm:<model>:<file>"``: a timm model's output on its own eval transform, as GARDO's code
  embeds its images (github.com/tinnerhrhe/GARDO 52fd5e7, ``scripts/train_sd3_grpo_gardo.py``: ``timm.create_model(
  "vit_large_patch16_dinov3.lvd1689m", pretrained=True)``, ``timm.data.create_transform`` of its
  ``resolve_model_data_config``, the float32 output; its ``stat_tracking.py`` L2-normalises the rows). The weights
  come from ``file`` (a local .safetensors, the code's ``pretrained_cfg_overlay``) or from the model's hub repo
  ``timm/<model>`` in the Hugging Face cache; never downloaded. GARDO's features:
  ``"timm:vit_large_patch16_dinov3.lvd1689m"``;
- ``"pixels"``: the image average-pooled to 16×16, its mean removed: no weights, for tests; it sees layout and
  colour, not content.

The same specs, and the same extractors, as ``[eval] diversity`` (``tpflow.train.diversity`` builds its embedding
here; ``tpflow.diversity_specs.diversity_problem`` checks a spec before anything loads).
Each returns unit rows [N, D] float32 on the CPU; weights load at the first call, under a lock (the scoring thread
and a reward server may call from several threads). A clip [N, F, 3, H, W] is embedded by its middle frame.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tpflow.diversity_specs import diversity_problem
from tpflow.errors import UserError
from tpflow.images import l2_normalize, to_uint8
from tpflow.weights import WeightSource, cached_file, download_command, file_source, hub_cache_dir

PIXEL_SIDE = 16  # "pixels": the side of the pooled image

Features = Callable[[Tensor], Tensor]  # images [N, 3, H, W] in [0, 1] -> unit rows [N, D] float32 on the CPU


def build_features(spec: str, device: torch.device, where: str | None = None) -> Features:
    """The extractor ``spec`` names (module docstring), its weights loaded on ``device`` at its first call.
    ``where`` names the setting in a missing weight's message (default: the diversity-shaped reward's
    ``features``); ``[eval] diversity`` (tpflow.train.diversity) builds its embedding here too."""
    problem = diversity_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    kind, _, rest = spec.partition(":")
    if kind == "pixels":
        return pixel_features
    lock, loaded = threading.Lock(), []
    if kind == "shapes-clip":
        from tpflow.rewards.shapes_clip import resolve_weights
        from tpflow.shapes.clip import load_clip

        @torch.no_grad()
        def shapes(images: Tensor) -> Tensor:
            with lock:
                if not loaded:
                    loaded.append(load_clip(resolve_weights(rest or None), device))
            model = loaded[0]
            size = model.config.image_size
            x = to_uint8(middle_frame(images).to(device)).float() / 255
            if x.shape[-2:] != (size, size):
                x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True).clamp(0, 1)
            return model.encode_image(x).float().cpu()

        return shapes
    if kind == "timm":
        return timm_features(rest, device, where or f"reward 'diversity-shaped', features = {spec!r}")
    from tpflow.rewards.open_clip import LazyOpenClip

    arch, _, pretrained = rest.partition(":")
    where = where or f"reward 'diversity-shaped', features = {spec!r}"
    clip = LazyOpenClip(arch, pretrained or "openai", device, where)

    @torch.no_grad()
    def open_clip_features(images: Tensor) -> Tensor:
        model = clip.get()
        return l2_normalize(model.model.encode_image(model.preprocess(middle_frame(images)))).float().cpu()

    return open_clip_features


def middle_frame(images: Tensor) -> Tensor:
    """[N, 3, H, W] as they are; a clip batch [N, F, 3, H, W] by its middle frame."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


@torch.no_grad()
def pixel_features(images: Tensor) -> Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 3·16·16] unit rows: pooled to 16×16 on the uint8 grid, each image's mean removed
    (a uniform image, which has no direction, gives zeros)."""
    x = to_uint8(middle_frame(images)).float().cpu() / 255
    x = F.adaptive_avg_pool2d(x, PIXEL_SIDE).flatten(1)
    x = x - x.mean(dim=1, keepdim=True)
    return x / x.norm(dim=1, keepdim=True).clamp(min=1e-12)


def feature_sources(spec: str, where: str) -> list[WeightSource]:
    """The weights ``spec`` reads that can be found before anything loads (a timm model's file or cache entry);
    the other extractors are checked when they load."""
    kind, _, rest = spec.partition(":")
    return [timm_source(*_timm_parts(rest), where)] if kind == "timm" else []


def _timm_parts(rest: str) -> tuple[str, str | None]:
    model, _, file = rest.partition(":")
    return model, file or None


def timm_source(model: str, file: str | None, where: str) -> WeightSource:
    """Where a timm model's weights are: ``file``, else ``model.safetensors`` of ``timm/<model>`` in the cache."""
    what = f"{where}: timm model {model!r}"
    fetch = download_command(f"timm/{model}")
    how = f'set features = "timm:{model}:<file>" to its model.safetensors, or fetch it with {fetch}'
    if file is not None:
        return file_source(what, file, how)
    found = cached_file(f"timm/{model}", "model.safetensors")
    if found is None:
        return WeightSource(what, model, None, f"{what} is not in the Hugging Face cache ({hub_cache_dir()}), and "
                            f"tpflow never downloads weights; {how}.")  # fmt: skip
    return WeightSource(what, model, f"Hugging Face cache {Path(found).parent}", path=found)


def timm_features(rest: str, device: torch.device, where: str) -> Features:
    """GARDO's embedding (module docstring): ``timm.create_model(model, pretrained=True)`` with the weights of
    ``timm_source``, its eval transform applied to the image batch, the output in float32, L2-normalised."""
    model_name, file = _timm_parts(rest)
    lock, loaded = threading.Lock(), []

    def load() -> tuple[Any, Any]:
        with lock:
            if not loaded:
                import timm

                found = timm_source(model_name, file, where)
                if found.problem or found.path is None:
                    raise UserError(found.problem or f"{where}: {model_name!r} was not found.")
                overlay = {"file": found.path}
                model = timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=overlay)
                model = model.eval().requires_grad_(False).to(device)
                config = timm.data.resolve_model_data_config(model)
                loaded.append((model, timm.data.create_transform(**config, is_training=False)))
        return loaded[0]

    @torch.no_grad()
    def features(images: Tensor) -> Tensor:
        model, transform = load()
        x = transform(middle_frame(images).to(device).float())  # [N, 3, h, w]: the float images, as the code
        return l2_normalize(model(x.float()).float()).cpu()

    return features
