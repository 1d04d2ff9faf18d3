"""How ``edit-consistency`` sees an edited image and its source: the source brought to the edit's size, and the
image features it compares them by (``pixel``, ``clip``, ``dino``).

``source_at`` resizes a source to the edit's size the way flow_grpo's Kontext script feeds its reward: the source is
a PIL image resized to the training resolution (``ref_image.resize((res, res))``, PIL's bicubic, the aspect ratio
not kept) and read back as uint8 / 255 (github.com/yifan123/flow_grpo, commit 74db691, scripts/train_flux_kontext.py).

``ClipFeatures`` is flow_grpo's ``ClipScorer.image_similarity``, which its ``image_similarity`` reward calls
(flow_grpo/rewards.py at yifan123/flow_grpo 94e23ee; flow_grpo/clip_scorer.py read in the forks that carry it, e.g.
github.com/YunzeTong/TurningPoint-GRPO at f9f6ff4, the same in zhtmike/flow_grpo at 19d5169): the image's CLIP
embedding (``get_image_features``) after torchvision's ``Resize`` of the shortest side (bilinear, antialiased, on
the float tensor, not quantised), ``CenterCrop`` and ``Normalize`` with the model's mean and std, L2-normalised. The
model comes from the one open_clip loader (``tpflow.rewards.open_clip``): open_clip's ViT-L-14 with the ``openai``
tag holds the weights of flow_grpo's ``openai/clip-vit-large-patch14``. ``DinoFeatures`` is the CLS token
(``pooler_output``: DINOv2's and DINOv3's normalised CLS) of a transformers ``AutoModel`` read from a local folder
or the Hugging Face cache, its input made by ``tpflow.images.clip_preprocess`` with its own processor's resize, crop,
mean and std. Both load at their first call, once, under a lock (the scoring thread calls them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.images import clip_preprocess, l2_normalize, to_uint8
from tpflow.rewards.open_clip import LazyOpenClip
from tpflow.sources import SOURCES, references
from tpflow.weights import MODEL_FILES, WeightSource, download_command, model_folder

DINO_NEEDS = [("config.json",), MODEL_FILES, ("preprocessor_config.json",)]
DINO_HOW = "set the option to a local folder written by save_pretrained (the model with its image processor)"


def first_source(metadata: dict[str, Any], who: str) -> str:
    """The first source reference of an item's metadata (the image being edited); a UserError naming ``who`` (the
    reward that compares with it) when the item has none."""
    refs = references(metadata)
    if not refs:
        raise UserError(
            f"{who} compares each edited image with its source image, and a prompt has none (metadata {SOURCES!r}): "
            "use an editing dataset such as 'edit-jsonl', whose every item names its source image(s)."
        )
    return refs[0]


def source_at(source: Tensor, size: tuple[int, int]) -> Tensor:
    """A source [3, h, w] in [0, 1] -> [3, H, W] float32 on the uint8 grid at ``size`` = (H, W): PIL's bicubic
    resize of its uint8 pixels (none when the size is already right), as flow_grpo resizes its reference images."""
    pixels = to_uint8(source[None])[0]  # [3, h, w] uint8
    if tuple(pixels.shape[-2:]) != tuple(size):
        from PIL import Image

        image = Image.fromarray(pixels.permute(1, 2, 0).numpy()).resize((size[1], size[0]), Image.Resampling.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # [3, H, W] uint8
    return pixels.float() / 255


@torch.no_grad()
def pixel_similarity(edits: Tensor, sources: Tensor) -> Tensor:
    """1 − mean |edit − source| over pixels and channels, both on the uint8 grid; [N] float32 in [0, 1] on the CPU.

    Args:
        edits: [N, 3, H, W] in [0, 1].
        sources: [N, 3, H, W] in [0, 1], at the edits' size (``source_at``).
    """
    e = to_uint8(edits).cpu().float() / 255
    s = to_uint8(sources).cpu().float() / 255
    return 1 - (e - s).abs().flatten(1).mean(1)


def flow_grpo_clip_input(
    images: Tensor, resize: int, crop: tuple[int, int], mean: Sequence[float], std: Sequence[float]
) -> Tensor:
    """[N, 3, H, W] float in [0, 1] -> [N, 3, crop] float32: flow_grpo's ``get_image_transform`` (torchvision
    ``Resize(resize)`` bilinear antialiased on the float tensor, ``CenterCrop(crop)``, ``Normalize(mean, std)``)."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    x = TF.resize(images.float(), [resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    x = TF.center_crop(x, list(crop))
    return TF.normalize(x, list(mean), list(std))


class ClipFeatures:
    """Unit CLIP image embeddings [N, D] float32 on the CPU of images [N, 3, H, W] in [0, 1] (module docstring)."""

    def __init__(self, arch: str, pretrained: str, device: torch.device, where: str) -> None:
        self.clip = LazyOpenClip(arch, pretrained, device, where)

    @torch.no_grad()
    def __call__(self, images: Tensor) -> Tensor:
        clip = self.clip.get()
        device = next(clip.model.parameters()).device
        pixels = flow_grpo_clip_input(images.to(device), clip.resize, clip.crop, clip.mean, clip.std)
        return l2_normalize(clip.model.encode_image(pixels)).cpu()


class DinoFeatures:
    """Unit CLS features [N, D] float32 on the CPU of images [N, 3, H, W] in [0, 1] (module docstring)."""

    def __init__(self, model: str, device: torch.device, where: str) -> None:
        self.name, self.device, self.where = model, device, where
        self._lock = threading.Lock()
        self._model: Any = None
        self._input: dict[str, Any] = {}

    def source(self) -> WeightSource:
        """Where the model will be read from, found without the network (``tpflow.weights``)."""
        return model_folder(self.where, self.name, DINO_NEEDS, DINO_HOW)

    def load(self) -> Any:
        with self._lock:
            if self._model is None:
                self._model = self._read()
            return self._model

    def _read(self) -> Any:
        found = self.source()
        if found.problem or found.path is None:
            raise UserError(found.problem or f"{self.where}: {self.name!r} was not found.")
        from transformers import AutoImageProcessor, AutoModel

        try:
            processor = AutoImageProcessor.from_pretrained(found.path, local_files_only=True)
            model = AutoModel.from_pretrained(found.path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{self.where}: {self.name!r} could not be loaded from {found.path}: {reason}. Fetch it again with "
                f"{download_command(self.name)}, or {DINO_HOW}."
            ) from None
        self._input = processor_input(processor)
        return model.eval().requires_grad_(False).to(self.device)

    @torch.no_grad()
    def __call__(self, images: Tensor) -> Tensor:
        model = self.load()
        pixels = clip_preprocess(images.to(self.device), **self._input)  # [N, 3, h, w]
        out = model(pixel_values=pixels.to(model.dtype))
        return l2_normalize(out.pooler_output).cpu()  # the CLS token after the final norm


def processor_input(processor: Any) -> dict[str, Any]:
    """``clip_preprocess``'s arguments from a transformers image processor: the shortest side resized then a centre
    crop (DINOv2's BitImageProcessor), or a resize to a fixed size (DINOv3's), with its resample and mean / std."""
    size = processor.size if isinstance(processor.size, dict) else vars(processor.size)
    crop_size = getattr(processor, "crop_size", None) or {}
    crop_size = crop_size if isinstance(crop_size, dict) else vars(crop_size)
    resample = int(getattr(processor, "resample", 3) or 3)
    mode = "bilinear" if resample == 2 else "bicubic"  # PIL's numbering: 2 bilinear, 3 bicubic
    mean, std = tuple(processor.image_mean), tuple(processor.image_std)
    if size.get("shortest_edge"):
        side = int(size["shortest_edge"])
        crop = (int(crop_size["height"]), int(crop_size["width"])) if processor.do_center_crop else (side, side)
        return dict(resize=side, crop=crop, mean=mean, std=std, mode=mode)
    fixed = (int(size["height"]), int(size["width"]))
    return dict(resize=max(fixed), crop=fixed, mean=mean, std=std, mode=mode, squash=True)
