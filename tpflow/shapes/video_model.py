"""ShapesVideoDiT: the shapes-dit architecture over clips, factorised in space and time, for the video shapes world.

What differs from ``ShapesDiT`` (whose text encoder, conditioning, joint blocks, patches and output it reuses as they
are): each frame is its own row of the joint blocks (its 64 patches of 4×4 pixels with the prompt's words, the
weights shared by every frame), and after each joint block a **temporal block** lets every patch position attend to
itself in the clip's other frames (positions in time: a learned embedding per frame). The factorised attention of
video diffusion models (Ho et al., Video Diffusion Models, arXiv 2204.03458; Blattmann et al., Align your Latents,
arXiv 2304.08818). Its point here: a temporal block starts as the identity (adaLN-zero: its gates are 0), so a model
whose spatial layers are the image model's draws each frame as the image model does (``video_init.inflate``), and
pretraining on 2 CPU cores has to learn the motion only. An earlier design, one full attention over 256 space-time
patches of 2×4×4 trained from scratch for an hour, drew blocks of the right colour and no shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tpflow.shapes import video_world
from tpflow.shapes.model import Attention, FeedForward, ShapesDiT, ShapesDiTConfig, config_from_dict, read_config


@dataclass
class ShapesVideoConfig(ShapesDiTConfig):
    """ShapesDiTConfig plus the clip's frames."""

    frames: int = video_world.FRAMES
    max_tokens: int = video_world.MAX_TOKENS
    vocab_size: int = len(video_world.WORDS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapesVideoConfig:
        return config_from_dict(cls, data)


class TemporalBlock(nn.Module):
    """Attention over the frames of each patch position, then a feed-forward, both adaLN-zero modulated by the
    clip's conditioning: the identity until training moves its gates (``JointBlock``'s form, over time)."""

    def __init__(self, width: int, heads: int, hidden: int, frames: int) -> None:
        super().__init__()
        self.frame_pos = nn.Parameter(torch.zeros(frames, width))
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(width, hidden)
        self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """x [M, F, width] (M = clips × patch positions), c [M, width]."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(c)[:, None].chunk(6, dim=-1)  # [M, 1, width]
        h = self.norm1(x + self.frame_pos) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, None)
        return x + gate2 * self.ff(self.norm2(x) * (1 + scale2) + shift2)


class ShapesVideoDiT(ShapesDiT):
    """``forward(x, sigma, tokens, mask, null) -> v`` on clips x [N, F, C, H, W] (pixels in [-1, 1])."""

    def __init__(self, config: ShapesVideoConfig | None = None) -> None:
        cfg = config or ShapesVideoConfig()
        super().__init__(cfg)
        hidden = int(cfg.width * cfg.mlp_ratio)
        self.temporal = nn.ModuleList(
            TemporalBlock(cfg.width, cfg.heads, hidden, cfg.frames) for _ in range(cfg.depth)
        )
        for block in self.temporal:
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
                    nn.init.zeros_(module.bias)
            nn.init.zeros_(block.adaln[-1].weight)  # adaLN-zero: the identity at the start
            nn.init.zeros_(block.adaln[-1].bias)

    def forward(self, x: Tensor, sigma: Tensor, tokens: Tensor, mask: Tensor, null: Tensor | None = None) -> Tensor:
        """Velocity [N, F, C, H, W] of clips x [N, F, C, H, W] at noise levels sigma [N] (``ShapesDiT.forward``'s
        other arguments)."""
        cfg, (n, f) = self.config, x.shape[:2]
        p, g = cfg.patch_size, self.grid
        frames = x.reshape(n * f, cfg.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n * f, g * g, -1)

        def each_frame(t: Tensor | None) -> Tensor | None:  # [N, ...] -> [N·F, ...], a clip's frames together
            return None if t is None else t.repeat_interleave(f, dim=0)

        def in_time(i: int, h: Tensor, c: Tensor) -> Tensor:  # h [N·F, T, width], c [N·F, width]
            tokens_per_frame, width = h.shape[1:]
            h = h.reshape(n, f, tokens_per_frame, width).transpose(1, 2).reshape(n * tokens_per_frame, f, width)
            c = c.reshape(n, f, width)[:, 0].repeat_interleave(tokens_per_frame, dim=0)  # [N·T, width]
            h = self.temporal[i](h, c)
            return h.reshape(n, tokens_per_frame, f, width).transpose(1, 2).reshape(n * f, tokens_per_frame, width)

        out = self.joint(self.x_embed(frames) + self.pos_embed, each_frame(sigma), each_frame(tokens),
                         each_frame(mask), each_frame(null), x.dtype, between=in_time)  # fmt: skip
        out = out.reshape(n * f, g, g, cfg.channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(n, f, cfg.channels, cfg.image_size, cfg.image_size)


def load_video_checkpoint(path: Path, device: str | torch.device = "cpu") -> ShapesVideoDiT:
    """Rebuild a ShapesVideoDiT from ``save_checkpoint``'s files (safetensors only)."""
    from safetensors.torch import load_file

    model = ShapesVideoDiT(ShapesVideoConfig.from_dict(read_config(path)))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval()
