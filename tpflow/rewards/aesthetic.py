"""Reward ``aesthetic``: the LAION improved aesthetic predictor (a Table 1 metric of the paper, docs/algorithm.md §7).

    [reward]
    name = "aesthetic"
    head = "/models/sac+logos+ava1-l14-linearMSE.pth"     # or a .safetensors conversion
    clip_model = "ViT-L-14"
    clip_pretrained = "openai"

An MLP (768 → 1024 → 128 → 64 → 16 → 1, Linear layers with dropout between the first four, no activation) on the
L2-normalised CLIP ViT-L/14 image embedding; scores are on the AVA 1-10 scale. The head's keys are those of
``sac+logos+ava1-l14-linearMSE.pth`` (``layers.0``, ``.2``, ``.4``, ``.6``, ``.7``), from
github.com/christophschuhmann/improved-aesthetic-predictor. Nothing is downloaded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import l2_normalize
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.open_clip import OpenClip, load_open_clip, open_clip_source
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource, file_source

HEAD_SOURCE = "https://github.com/christophschuhmann/improved-aesthetic-predictor (sac+logos+ava1-l14-linearMSE.pth)"
_LINEAR = (0, 2, 4, 6, 7)  # indices of the Linear layers in the original nn.Sequential


class AestheticOptions(BaseModel):
    """Options of the aesthetic reward."""

    model_config = ConfigDict(extra="forbid")

    head: str | None = Field(
        None,
        description="Path of the aesthetic MLP weights: the original sac+logos+ava1-l14-linearMSE.pth "
        "(read with torch.load(weights_only=True)) or a .safetensors file with the same keys. Required to score.",
    )
    clip_model: str = Field("ViT-L-14", description=option_help.CLIP_MODEL)
    clip_pretrained: str = Field("openai", description=option_help.CLIP_PRETRAINED)
    device: str = Field("auto", description=option_help.DEVICE)


class AestheticHead(nn.Module):
    """The predictor's MLP; layer sizes are read from the weights, so ``layers.*`` keys load unchanged."""

    def __init__(self, dims: Sequence[int]):
        super().__init__()
        d = list(dims)  # [in, 1024, 128, 64, 16, 1] for the published head
        self.layers = nn.Sequential(
            nn.Linear(d[0], d[1]),
            nn.Dropout(0.2),
            nn.Linear(d[1], d[2]),
            nn.Dropout(0.2),
            nn.Linear(d[2], d[3]),
            nn.Dropout(0.1),
            nn.Linear(d[3], d[4]),
            nn.Linear(d[4], d[5]),
        )

    def forward(self, x: Tensor) -> Tensor:
        """[N, D] normalised embeddings -> [N, 1] scores."""
        return self.layers(x)


def load_head(path: str | None) -> AestheticHead:
    """Read the head from .safetensors or a torch pickle of tensors only; UserError when absent or malformed."""
    if path is None:
        raise UserError(
            f"reward 'aesthetic': set option head to the path of the aesthetic MLP weights, from {HEAD_SOURCE}."
        )
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"reward 'aesthetic': the head file {path} does not exist. Download it from {HEAD_SOURCE}.")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle with code in it, or not a torch file at all
            raise UserError(
                f"reward 'aesthetic': {path} could not be read as tensors only (torch.load(weights_only=True): "
                f"{type(exc).__name__}). Give the original .pth state dict or a .safetensors file."
            ) from None
    state = state.get("state_dict", state)
    expected = [f"layers.{i}.{p}" for i in _LINEAR for p in ("weight", "bias")]
    missing = [k for k in expected if k not in state]
    if missing:
        raise UserError(
            f"reward 'aesthetic': {path} is not an aesthetic predictor head: it lacks {', '.join(missing)} "
            f"(has {', '.join(sorted(state)[:8])}...)."
        )
    dims = [state["layers.0.weight"].shape[1]] + [state[f"layers.{i}.weight"].shape[0] for i in _LINEAR]
    head = AestheticHead(dims)
    head.load_state_dict({k: state[k].float() for k in expected})
    return head.eval().requires_grad_(False)


@register("reward", "aesthetic", options=AestheticOptions)
class AestheticReward:
    """RewardModel: LAION aesthetic score (about 1-10) of each image; prompts are ignored.

    Options: ``head``, ``clip_model``, ``clip_pretrained``, ``device``. Both models load on the first call (or
    ``load()``) under a lock. ``scores`` [N] float32 on the CPU.
    """

    @staticmethod
    def weight_sources(options: AestheticOptions, settings: dict) -> list[WeightSource]:
        """Where the head and the open_clip checkpoint will be read from, found without the network
        (``tpflow.weights``); the head's keys are checked when it loads."""
        head = file_source(
            "reward 'aesthetic' head (option head)", options.head, f"download it from {HEAD_SOURCE} and set head to it"
        )
        what = "reward 'aesthetic' open_clip weights (options clip_model, clip_pretrained)"
        where = "reward 'aesthetic' (options clip_model, clip_pretrained)"
        return [head, open_clip_source(what, options.clip_model, options.clip_pretrained, where)]

    def __init__(self, options: AestheticOptions | None = None):
        self.options = options or AestheticOptions()
        self.device = resolve_device(self.options.device)  # in the building thread, on its current GPU
        self._lock = threading.Lock()
        self._models: tuple[OpenClip, AestheticHead] | None = None

    def load(self) -> tuple[OpenClip, AestheticHead]:
        """Load CLIP and the head now (the first call does it otherwise)."""
        with self._lock:
            if self._models is None:
                o = self.options
                head = load_head(o.head)  # the cheap check first
                where = "reward 'aesthetic' (options clip_model, clip_pretrained)"
                clip = load_open_clip(o.clip_model, o.clip_pretrained, self.device, where)
                width = clip.model.encode_image(torch.zeros(1, 3, *clip.crop, device=_device(clip))).shape[-1]
                if head.layers[0].in_features != width:
                    raise UserError(
                        f"reward 'aesthetic': the head {o.head} reads {head.layers[0].in_features}-d embeddings but "
                        f"open_clip {o.clip_model!r} gives {width}-d ones; the published head needs ViT-L-14."
                    )
                self._models = (clip, head.to(_device(clip)))
            return self._models

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1]; ``scores`` [N] float32."""
        clip, head = self.load()
        embedding = l2_normalize(clip.model.encode_image(clip.preprocess(images)))  # [N, D]
        return RewardOutput(scores=head(embedding)[:, 0].float().cpu())


def _device(clip: OpenClip) -> torch.device:
    return next(clip.model.parameters()).device
