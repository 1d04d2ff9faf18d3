"""The one open_clip loader: every reward and embedding that runs an open_clip model builds it here.

``load_open_clip`` finds open_clip weights on disk without ever downloading: a checkpoint path, or a pretrained tag
whose file is already in the Hugging Face cache (or open_clip's ``~/.cache/clip``); ``open_clip_source`` says where
before anything loads (the rewards' ``weight_sources`` hooks, ``tpflow.weights``). ``LazyOpenClip`` builds the model
at its first use, once, for the rewards (``clipscore``, ``aesthetic``) and ``[eval] diversity``'s ``clip:`` embedding.
The model's input is made by ``tpflow.images.clip_preprocess`` with the model's own preprocessing settings.
"""

from __future__ import annotations

import difflib
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.images import clip_preprocess
from tpflow.weights import WeightSource, cached_file, download_command, hub_cache_dir


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
