"""Reward ``temporal-consistency``: how alike a clip's consecutive frames look to an open_clip image encoder.

    [reward]
    name = "temporal-consistency"
    model = "ViT-L-14"          # open_clip architecture, as clipscore
    pretrained = "openai"       # a tag whose weights are already cached, or a checkpoint file

Score = the mean over a clip's F − 1 consecutive frame pairs of cos(e_f, e_{f+1}), e the L2-normalised CLIP image
embedding of a frame (VBench's "subject consistency" and the CLIP frame-similarity used by video RL papers measure
this way). A clip that flickers or changes its subject scores low; a still clip scores 1, so train on it only beside
a reward for the content (``weighted``), or watch it (``[eval] rewards``). ``details["min_cosine"]``: the least
similar pair. Takes clips [N, F, 3, H, W] in [0, 1] (``accepts_clips``); an image is a clip of one frame and scores
1. Weights are never downloaded (as ``clipscore``).
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

WHERE = "reward 'temporal-consistency' (options model, pretrained)"


class TemporalConsistencyOptions(BaseModel):
    """Options of the temporal-consistency reward."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("ViT-L-14", description="open_clip architecture name (see open_clip.list_models()).")
    pretrained: str = Field(
        "openai",
        description="open_clip weights: a local checkpoint file, or a pretrained tag of the architecture whose "
        "weights are already in the Hugging Face cache (tpflow never downloads).",
    )
    device: str = Field("auto", description=option_help.DEVICE)


@register("reward", "temporal-consistency", options=TemporalConsistencyOptions)
class TemporalConsistencyReward:
    """RewardModel over clips: mean CLIP-image cosine of consecutive frames; ``scores`` [N] float32 on the CPU."""

    accepts_clips = True
    accepts_images = False  # an image is a clip of one frame, scored 1 whatever it shows: nothing to train or watch

    @staticmethod
    def weight_sources(options: TemporalConsistencyOptions, settings: dict) -> list[WeightSource]:
        """Where the open_clip checkpoint will be read from, found without the network (``tpflow.weights``)."""
        what = "reward 'temporal-consistency' open_clip weights (options model, pretrained)"
        return [open_clip_source(what, options.model, options.pretrained, WHERE)]

    def __init__(self, options: TemporalConsistencyOptions | None = None):
        self.options = options or TemporalConsistencyOptions()
        self.device = resolve_device(self.options.device)
        self._clip = LazyOpenClip(self.options.model, self.options.pretrained, self.device, WHERE)

    def load(self) -> OpenClip:
        """Load the open_clip model now (the first call does it otherwise)."""
        return self._clip.get()

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score clips [N, F, 3, H, W] (or images [N, 3, H, W]) in [0, 1]."""
        clips = images[:, None] if images.ndim == 4 else images
        n, frames = clips.shape[:2]
        if frames < 2:
            ones = torch.ones(n, dtype=torch.float32, device="cpu")
            return RewardOutput(scores=ones, details={"min_cosine": ones.clone()})
        clip = self.load()
        embeddings = l2_normalize(clip.model.encode_image(clip.preprocess(clips.flatten(0, 1))))  # [N·F, D]
        embeddings = embeddings.float().view(n, frames, -1)
        cosine = (embeddings[:, 1:] * embeddings[:, :-1]).sum(-1).cpu()  # [N, F − 1]
        return RewardOutput(scores=cosine.mean(1), details={"min_cosine": cosine.min(1).values})
