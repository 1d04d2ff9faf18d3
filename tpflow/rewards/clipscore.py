"""Reward ``clipscore``: CLIPScore (Hessel et al., 2021), image-text agreement of an open_clip model.

    [reward]
    name = "clipscore"
    model = "ViT-L-14"          # open_clip architecture
    pretrained = "openai"       # a tag whose weights are already cached, or a checkpoint file

Score = scale · max(cos(image_emb, text_emb), 0) with scale 2.5, the published CLIPScore (its w = 2.5 stretches
the usual cosines, about 0.2-0.4, towards [0, 1]). ``details["cosine"]`` holds the raw cosine. Weights are never
downloaded: fetch them once (``hf download timm/vit_large_patch14_clip_224.openai``) or give a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.images import l2_normalize
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.open_clip import LazyOpenClip, OpenClip, open_clip_source
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource


class ClipScoreOptions(BaseModel):
    """Options of the CLIPScore reward."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("ViT-L-14", description="open_clip architecture name (see open_clip.list_models()).")
    pretrained: str = Field(
        "openai",
        description="open_clip weights: a local checkpoint file, or a pretrained tag of the architecture whose "
        "weights are already in the Hugging Face cache (tpflow never downloads).",
    )
    scale: float = Field(2.5, gt=0, description="w of CLIPScore = w · max(cos, 0); 2.5 in Hessel et al. (2021).")
    device: str = Field("auto", description=option_help.DEVICE)


@register("reward", "clipscore", options=ClipScoreOptions)
class ClipScoreReward:
    """RewardModel: CLIPScore of each image for its prompt.

    Options: ``model``, ``pretrained``, ``scale``, ``device``. The model loads on the first call (or ``load()``)
    under a lock; preprocessing is per image in torch (``tpflow.images``), so scores do not depend on the
    batch. ``scores`` [N] float32 on the CPU; ``details["cosine"]`` [N] the raw cosine similarity.
    """

    @staticmethod
    def weight_sources(options: ClipScoreOptions, settings: dict) -> list[WeightSource]:
        """Where the open_clip checkpoint will be read from (a file, the Hugging Face or open_clip cache), found
        without the network (``tpflow.weights``)."""
        what = "reward 'clipscore' open_clip weights (options model, pretrained)"
        where = "reward 'clipscore' (options model, pretrained)"
        return [open_clip_source(what, options.model, options.pretrained, where)]

    def __init__(self, options: ClipScoreOptions | None = None):
        self.options = options or ClipScoreOptions()
        self.device = resolve_device(self.options.device)  # in the building thread, on its current GPU
        where = "reward 'clipscore' (options model, pretrained)"
        self._clip = LazyOpenClip(self.options.model, self.options.pretrained, self.device, where)

    def load(self) -> OpenClip:
        """Load the open_clip model now (the first call does it otherwise)."""
        return self._clip.get()

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        clip = self.load()
        pixels = clip.preprocess(images)  # [N, 3, h, w]
        tokens = clip.tokenizer(list(prompts)).to(pixels.device)  # [N, L], truncated to the context length
        cosine = (l2_normalize(clip.model.encode_image(pixels)) * l2_normalize(clip.model.encode_text(tokens))).sum(-1)
        cosine = cosine.cpu()  # [N]
        return RewardOutput(scores=self.options.scale * cosine.clamp(min=0), details={"cosine": cosine})
