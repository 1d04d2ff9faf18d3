"""ShapesEditDiT: the shapes-dit architecture conditioned on a source image, for the editing shapes world.

What differs from ``ShapesDiT`` (whose text encoder, conditioning, joint blocks, patches and output it reuses as they
are): the source image's 64 patches of 4×4 pixels join the joint sequence after the noisy image's, embedded by the
same patch embedding and positions plus two learned terms that only source tokens get (``source_pos``, one vector
per patch position, and ``source_embed``, one for all), and the output is read from the noisy image's tokens only.
This is FLUX.1 Kontext's conditioning (Labs et al., FLUX.1 Kontext, arXiv 2506.15742: context image tokens
appended to the sequence, told apart by their positions) at the shapes world's size; every block attends over
[text; image; source] (16 + 64 + 64 tokens at most).

Classifier-free guidance drops the text only: the null-text rows keep their source, as Kontext and Qwen-Image-Edit
keep the image in the unconditional branch, so guidance pushes along the instruction and not away from the source.

``source=None`` appends nothing: the model is then exactly ``ShapesDiT`` (what ``edit_init.inflate`` relies on and
its test checks). The new terms start at zero, so a source token starts as the noisy image's token at σ = 0 would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tpflow.shapes import edit_world
from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig, config_from_dict, read_config


@dataclass
class ShapesEditConfig(ShapesDiTConfig):
    """ShapesDiTConfig over the editing vocabulary, plus the source images a prompt takes."""

    max_tokens: int = edit_world.MAX_TOKENS
    vocab_size: int = len(edit_world.WORDS)
    sources: int = 1  # source images per prompt (the key that tells an editing checkpoint apart)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapesEditConfig:
        return config_from_dict(cls, data)


class ShapesEditDiT(ShapesDiT):
    """``forward(x, sigma, tokens, mask, null, source) -> v`` on images x [N, C, H, W] and sources [N, C, H, W]
    (pixels in [-1, 1])."""

    def __init__(self, config: ShapesEditConfig | None = None) -> None:
        cfg = config or ShapesEditConfig()
        super().__init__(cfg)
        self.source_pos = nn.Parameter(torch.zeros(self.grid**2, cfg.width))  # [T, width]
        self.source_embed = nn.Parameter(torch.zeros(cfg.width))  # [width]

    def patches(self, x: Tensor) -> Tensor:
        """Images [N, C, H, W] -> patches [N, T, C·p·p] (row-major patch order)."""
        cfg, n = self.config, x.shape[0]
        p, g = cfg.patch_size, self.grid
        return x.reshape(n, cfg.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, -1)

    def forward(
        self,
        x: Tensor,
        sigma: Tensor,
        tokens: Tensor,
        mask: Tensor,
        null: Tensor | None = None,
        source: Tensor | None = None,
    ) -> Tensor:
        """Velocity [N, C, H, W] of images x at noise levels sigma [N]; ``source`` [N, C, H, W] in [-1, 1] (the
        image to edit, or None: text to image, exactly ``ShapesDiT``); the other arguments as ``ShapesDiT``'s."""
        cfg, n = self.config, x.shape[0]
        p, g = cfg.patch_size, self.grid
        image = self.x_embed(self.patches(x)) + self.pos_embed  # [N, T, width]
        count = image.shape[1]
        if source is not None:
            src = self.x_embed(self.patches(source.to(x.dtype))) + self.pos_embed + self.source_pos + self.source_embed
            image = torch.cat([image, src], dim=1)  # [N, 2T, width]
        out = self.joint(image, sigma, tokens, mask, null, x.dtype)[:, :count]  # [N, T, C·p·p]: the target's
        out = out.reshape(n, g, g, cfg.channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(n, cfg.channels, cfg.image_size, cfg.image_size)


def load_edit_checkpoint(path: Path, device: str | torch.device = "cpu") -> ShapesEditDiT:
    """Rebuild a ShapesEditDiT from ``save_checkpoint``'s files (safetensors only)."""
    from safetensors.torch import load_file

    model = ShapesEditDiT(ShapesEditConfig.from_dict(read_config(path)))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval()
