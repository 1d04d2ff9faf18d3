"""ShapesVideoDiT: the shapes-dit architecture over clips, for the video shapes world.

What differs from ``ShapesDiT`` (whose text encoder, conditioning and joint blocks it reuses as they are): the image
tokens are space-time patches of ``frame_patch`` frames × ``patch_size``² pixels (2 × 4 × 4 by default: 4 × 64 = 256
tokens for 8 frames of 32×32), their positions the 2-D sin-cos table plus a learned embedding per time patch, and
the closed vocabulary has the world's motion words (``video_world.WORDS``). A full attention over the 256 tokens and
the text lets an object's patches in every frame see each other, which is all a rigid motion needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tpflow.shapes import video_world
from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig, config_from_dict, read_config


@dataclass
class ShapesVideoConfig(ShapesDiTConfig):
    """ShapesDiTConfig plus the clip's frames and the time extent of a patch."""

    frames: int = video_world.FRAMES
    frame_patch: int = 2
    max_tokens: int = video_world.MAX_TOKENS
    vocab_size: int = len(video_world.WORDS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.frames % self.frame_patch:
            raise ValueError(f"frames ({self.frames}) must be divisible by frame_patch ({self.frame_patch}).")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapesVideoConfig:
        return config_from_dict(cls, data)


class ShapesVideoDiT(ShapesDiT):
    """``forward(x, sigma, tokens, mask, null) -> v`` on clips x [N, F, C, H, W] (pixels in [-1, 1])."""

    def __init__(self, config: ShapesVideoConfig | None = None) -> None:
        cfg = config or ShapesVideoConfig()
        super().__init__(cfg)
        patch = cfg.channels * cfg.frame_patch * cfg.patch_size**2
        self.times = cfg.frames // cfg.frame_patch
        self.x_embed = nn.Linear(patch, cfg.width)
        self.time_pos = nn.Parameter(torch.zeros(self.times, cfg.width))
        self.proj_out = nn.Linear(cfg.width, patch)
        nn.init.xavier_uniform_(self.x_embed.weight)
        nn.init.zeros_(self.x_embed.bias)
        nn.init.zeros_(self.proj_out.weight)  # adaLN-zero's output: the model starts at velocity 0
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x: Tensor, sigma: Tensor, tokens: Tensor, mask: Tensor, null: Tensor | None = None) -> Tensor:
        """Velocity [N, F, C, H, W] of clips x [N, F, C, H, W] at noise levels sigma [N] (``ShapesDiT.forward``'s
        other arguments)."""
        cfg, n = self.config, x.shape[0]
        p, g, fp, t = cfg.patch_size, self.grid, cfg.frame_patch, self.times
        # [N, T, fp, C, g, p, g, p] -> [N, T, g, g, fp, C, p, p] -> [N, T·g², fp·C·p·p]
        patches = x.reshape(n, t, fp, cfg.channels, g, p, g, p).permute(0, 1, 4, 6, 2, 3, 5, 7)
        patches = patches.reshape(n, t * g * g, -1)
        positions = (self.pos_embed[None] + self.time_pos[:, None]).reshape(t * g * g, -1)  # [T·g², width]
        out = self.joint(self.x_embed(patches) + positions, sigma, tokens, mask, null, x.dtype)
        out = out.reshape(n, t, g, g, fp, cfg.channels, p, p).permute(0, 1, 4, 5, 2, 6, 3, 7)
        return out.reshape(n, cfg.frames, cfg.channels, cfg.image_size, cfg.image_size)


def load_video_checkpoint(path: Path, device: str | torch.device = "cpu") -> ShapesVideoDiT:
    """Rebuild a ShapesVideoDiT from ``save_checkpoint``'s files (safetensors only)."""
    from safetensors.torch import load_file

    model = ShapesVideoDiT(ShapesVideoConfig.from_dict(read_config(path)))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval()
