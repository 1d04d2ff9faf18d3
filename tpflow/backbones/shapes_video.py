"""Backbone ``shapes-video-dit``: the video shapes world's pixel-space clip DiT with a peft LoRA adapter.

    [backbone]
    name = "shapes-video-dit"
    weights = "runs/shapes-video-pretrain/shapes_video_dit.safetensors"   # omit for the shipped weights

What differs from ``shapes-dit`` (whose backbone code it is, hooks replaced): the model is ``ShapesVideoDiT``
(``tpflow.shapes.video_model``), its latents are clips of pixels [N, F, 3, 32, 32] in [-1, 1], decoded to clips
[N, F, 3, H, W] in [0, 1], and prompts are tokenized over the video world's vocabulary. Its recipes need a reward
that takes clips (``shapes-video``, or an image reward through ``frames``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.shapes import ShapesBackbone, ShapesDitOptions, resolve_weights
from tpflow.registry import register
from tpflow.shapes import video_world
from tpflow.shapes.video_model import ShapesVideoConfig, ShapesVideoDiT, load_video_checkpoint
from tpflow.shapes.video_pretrain import WEIGHTS_FILE


class ShapesVideoDitOptions(ShapesDitOptions):
    """Options of ``shapes-video-dit`` (``shapes-dit``'s)."""

    weights: str | None = Field(None, description=option_help.WEIGHTS)


@register("backbone", "shapes-video-dit", options=ShapesVideoDitOptions)
class ShapesVideoBackbone(ShapesBackbone):
    """Backbone of the video shapes world: ShapesVideoDiT plus a peft LoRA adapter (``ShapesBackbone``'s code)."""

    # its blocks run on [N·F, T, width] (spatial) and [N·T, F, width] (temporal): frames folded into the batch, so a
    # linear layer's leading dimension is not the rows (recompute = "reweight" refused: tpflow.optim.recompute)
    per_row_layers = False

    weights_file = WEIGHTS_FILE
    model_name = "shapes-video-dit"
    options_class = ShapesVideoDitOptions
    samples_clips = True  # its recipes need a reward that takes clips (tpflow.rewards.needs)

    @staticmethod
    def _resolve(weights: str | None) -> Path:
        create = "`tpflow shapes video-pretrain --out DIR` (about 60 minutes on 2 CPU cores)"
        return resolve_weights(weights, WEIGHTS_FILE, "shapes-video-dit", create)

    @staticmethod
    def _model(config: Any) -> ShapesVideoDiT:
        return ShapesVideoDiT(ShapesVideoConfig.from_dict(config) if isinstance(config, dict) else config)

    @staticmethod
    def _tokenize(prompts: list[str], max_tokens: int) -> tuple[Tensor, Tensor]:
        return video_world.tokenize(prompts, max_tokens)

    @staticmethod
    def prompt_warnings(prompts: Sequence[str]) -> list[str]:
        """Words outside the video world's vocabulary (they become <unk>)."""
        unknown = dict.fromkeys(
            w for p in prompts for w in video_world.vocab.words(p) if w not in video_world.WORD_IDS
        )
        if not unknown:
            return []
        return [f"{', '.join(map(repr, unknown))} not in the video shapes world's vocabulary: they become <unk>."]

    def _load(self, path: Path) -> ShapesVideoDiT:
        return load_video_checkpoint(path, self.device)

    def latent_shape(self) -> tuple[int, ...]:
        """One clip's pixels: (F, C, H, W)."""
        cfg = self.config
        return (cfg.frames, cfg.channels, cfg.image_size, cfg.image_size)
