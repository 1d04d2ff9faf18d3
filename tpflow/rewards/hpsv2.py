"""Reward ``hpsv2``: Human Preference Score v2.1 (Wu et al., arXiv 2306.09341), an open_clip ViT-H-14 fine-tuned on
human preferences, as DanceGRPO and MixGRPO train with it.

    [reward]
    name = "hpsv2"
    checkpoint = "/models/HPS_v2.1_compressed.pt"   # or omit: the file of xswu/HPSv2 in the Hugging Face cache

Score = cos(image_emb, text_emb) of the fine-tuned model (the ``hpsv2`` package's ``score``: the diagonal of
image_features @ text_featuresᵀ, both L2-normalised; about 0.2-0.35 for SD-class images). The model is built by
open_clip from its ``ViT-H-14`` architecture and the HPS checkpoint (read with ``torch.load(weights_only=True)``:
a state dict of tensors, never an arbitrary pickle).

Preprocessing is the package's, not open_clip's default: the package's ``score`` and its evaluation build the model
with ``light_augmentation=True``, whose validation transform resizes the *longest* side to 224 px and pads the rest
with black (its open_clip fork's ``ResizeMaxSize``), then normalises with OpenAI's mean and std
(``tpflow.images.pad_preprocess``). A square image loses nothing either way; a 480×832 Wan frame is scored whole, on a
129×224 band between black bars, where open_clip's default (shortest side to 224, centre crop) would keep only its
middle 58 %. Why not that package: it downloads the checkpoint and the open_clip ViT-H-14 weights when it is
imported or first called, pins its own open_clip fork, and adds nothing the formula above needs; tpflow never
downloads at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import l2_normalize, pad_preprocess
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.open_clip import LazyOpenClip, OpenClip
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource, download_command, hub_checkpoint

REPO, FILE = "xswu/HPSv2", "HPS_v2.1_compressed.pt"  # the published checkpoint (HPS v2.1)
WHERE = "reward 'hpsv2' (options checkpoint, model)"


class HPSv2Options(BaseModel):
    """Options of the HPSv2.1 reward."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(
        None,
        description=f"The HPS checkpoint file ({FILE}); None: the file of {REPO} in the Hugging Face cache "
        f"(fetch it once with {download_command(REPO)}).",
    )
    model: str = Field("ViT-H-14", description="open_clip architecture the checkpoint belongs to (HPS: ViT-H-14).")
    device: str = Field("auto", description=option_help.DEVICE)


def checkpoint_path(options: HPSv2Options) -> Path:
    """The checkpoint file the options name, or a UserError saying how to get it (nothing is downloaded)."""
    return hub_checkpoint(options.checkpoint, REPO, FILE, WHERE, "the HPS checkpoint")


@register("reward", "hpsv2", options=HPSv2Options)
class HPSv2Reward:
    """RewardModel: HPSv2.1 of each image for its prompt; ``scores`` [N] float32 on the CPU (the cosine)."""

    @staticmethod
    def weight_sources(options: HPSv2Options, settings: dict) -> list[WeightSource]:
        """Where the checkpoint will be read from, found without the network (``tpflow.weights``)."""
        what = "reward 'hpsv2' checkpoint (option checkpoint)"
        try:
            path = checkpoint_path(options)
        except UserError as exc:
            return [WeightSource(what, options.checkpoint or f"{REPO}/{FILE}", None, str(exc))]
        origin = "local file" if options.checkpoint else "Hugging Face cache"
        return [WeightSource(what, str(path), f"{origin} {path}", path=str(path))]

    def __init__(self, options: HPSv2Options | None = None):
        self.options = options or HPSv2Options()
        self.device = resolve_device(self.options.device)
        self._clip = LazyOpenClip(self.options.model, lambda: str(checkpoint_path(self.options)), self.device, WHERE)

    def load(self) -> OpenClip:
        """Load the model now (the first call does it otherwise)."""
        return self._clip.get()

    def preprocess(self, images: Tensor) -> Tensor:
        """[N, 3, H, W] in [0, 1] -> [N, 3, s, s] model input on the model's device: the package's resize of the
        longest side to s, black padding, normalisation (``tpflow.images.pad_preprocess``)."""
        clip = self.load()
        if clip.crop[0] != clip.crop[1]:
            raise UserError(
                f"{WHERE}: {self.options.model!r} takes {clip.crop[0]}x{clip.crop[1]} images; the HPS "
                "preprocessing pads to a square."
            )
        device = next(clip.model.parameters()).device
        return pad_preprocess(images.to(device), clip.crop[0], clip.mean, clip.std)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        clip = self.load()
        pixels = self.preprocess(images)  # [N, 3, 224, 224]
        tokens = clip.tokenizer(list(prompts)).to(pixels.device)
        image, text = l2_normalize(clip.model.encode_image(pixels)), l2_normalize(clip.model.encode_text(tokens))
        return RewardOutput(scores=(image * text).sum(-1).float().cpu(), details={})
