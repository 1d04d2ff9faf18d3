"""ShapesCLIP: a tiny text-image contrastive model of the embedded shapes world (the world's PickScore).

Image encoder: 32×32 RGB in [0, 1] plus two coordinate channels (CoordConv: where a shape is matters for the
``position`` prompts) -> a 4×4 stride-2 convolution to 16×16, two 3×3 convolutions (the second with stride 2, to
8×8), one more 3×3, then the 8×8 feature map is flattened (not pooled: pooling would forget positions) into an MLP.
Text encoder: word ids from ``vocab.tokenize`` with learned positional embeddings and two pre-norm transformer layers
(the layer of ``shapes-dit``'s text encoder), masked mean-pooled: word order matters ("a red circle and a blue square"
is not "a blue circle and a red square"). Both project to a shared L2-normalised embedding; a learned
``logit_scale`` starts at CLIP's log(1/0.07) and is clamped to at most log(100), as in CLIP.

Trained by ``tpflow.shapes.clip_pretrain`` (symmetric InfoNCE with hard negatives); saved as safetensors plus a JSON
with the config and training statistics, like ``tpflow.shapes.model``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tpflow.shapes import vocab
from tpflow.shapes.model import TextLayer, _key_bias, config_from_dict, read_config, save_checkpoint

MAX_LOGIT_SCALE = math.log(100.0)  # CLIP's clamp: temperature never below 1/100


@dataclass
class ShapesClipConfig:
    """Architecture of ShapesCLIP; ``asdict`` of it is stored next to the weights (``shapes_clip.json``)."""

    image_size: int = 32  # pixels per side (the flattened feature map fixes it)
    channels: tuple[int, int, int] = (32, 64, 64)  # conv widths at 16×16, 16×16, and the 8×8 tokens' width
    image_layers: int = 2  # transformer layers over the 8×8 image tokens
    embed_dim: int = 128  # shared text-image embedding
    text_width: int = 128  # word embedding width
    text_layers: int = 2  # transformer layers of the text encoder
    heads: int = 4  # attention heads of the text encoder
    max_tokens: int = vocab.MAX_TOKENS  # words per prompt
    vocab_size: int = len(vocab.WORDS)  # closed word vocabulary

    def __post_init__(self) -> None:
        self.channels = tuple(int(c) for c in self.channels)  # JSON gives a list
        if self.image_size % 4 or len(self.channels) != 3:
            raise ValueError("image_size must be divisible by 4 and channels must hold three widths.")
        if self.text_width % self.heads:
            raise ValueError(f"text_width ({self.text_width}) must be divisible by heads ({self.heads}).")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapesClipConfig:
        """The config from its ``asdict`` form; unknown keys raise."""
        return config_from_dict(cls, data)


class ImageEncoder(nn.Module):
    """[N, 3, S, S] in [0, 1] -> [N, embed_dim] (not normalised): CoordConv stem, transformer over the 8×8 map.

    The convolutions bind colour to shape locally; the transformer relates objects (which one is left of which);
    mean and max pooling keep "there is a red circle somewhere" whatever the position.
    """

    def __init__(self, cfg: ShapesClipConfig) -> None:
        super().__init__()
        c1, c2, width = cfg.channels
        side = cfg.image_size // 4
        self.convs = nn.Sequential(
            nn.Conv2d(5, c1, 4, stride=2, padding=1),  # RGB + (x, y) -> [N, c1, S/2, S/2]
            nn.GELU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(c2, width, 3, stride=2, padding=1),  # [N, width, S/4, S/4]
        )
        self.pos = nn.Parameter(torch.randn(side * side, width) * 0.02)
        self.layers = nn.ModuleList(TextLayer(width, cfg.heads, 2 * width) for _ in range(cfg.image_layers))
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(2 * width, cfg.embed_dim)

    def forward(self, images: Tensor) -> Tensor:
        n, _, h, w = images.shape
        ys = torch.linspace(-1, 1, h, dtype=images.dtype, device=images.device)
        xs = torch.linspace(-1, 1, w, dtype=images.dtype, device=images.device)
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))[None].expand(n, 2, h, w)  # [N, 2, H, W]
        x = self.convs(torch.cat([images * 2 - 1, grid], dim=1))  # [N, width, S/4, S/4]
        x = x.flatten(2).transpose(1, 2) + self.pos  # [N, (S/4)², width]
        for layer in self.layers:
            x = layer(x, None)
        x = self.norm(x)
        return self.proj(torch.cat([x.mean(1), x.amax(1)], dim=-1))


class TextEncoder(nn.Module):
    """Word ids [N, L] + mask [N, L] -> [N, embed_dim] (not normalised): positions, transformer, masked mean."""

    def __init__(self, cfg: ShapesClipConfig) -> None:
        super().__init__()
        width = cfg.text_width
        self.word_embed = nn.Embedding(cfg.vocab_size, width)
        nn.init.normal_(self.word_embed.weight, std=0.02)  # as large as the positions: order must be visible
        self.pos = nn.Parameter(torch.randn(cfg.max_tokens, width) * 0.02)
        self.layers = nn.ModuleList(TextLayer(width, cfg.heads, 2 * width) for _ in range(cfg.text_layers))
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, cfg.embed_dim)

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        mask = mask.bool()
        x = self.word_embed(tokens) + self.pos[: tokens.shape[1]]  # [N, L, width]
        bias = _key_bias(mask, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        weights = mask.to(x.dtype)[..., None]  # [N, L, 1]
        pooled = (self.norm(x) * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # [N, width]
        return self.proj(pooled)


class ShapesClip(nn.Module):
    """CLIP of the shapes world: ``encode_image``, ``encode_text`` (unit vectors), ``scale()`` = exp(logit_scale)."""

    def __init__(self, config: ShapesClipConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or ShapesClipConfig()
        self.image = ImageEncoder(cfg)
        self.text = TextEncoder(cfg)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature

    def encode_image(self, images: Tensor) -> Tensor:
        """Images [N, 3, S, S] in [0, 1] -> unit embeddings [N, embed_dim] float32."""
        emb = self.image(images.float())
        return emb / emb.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def encode_text(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Word ids [N, L] and mask [N, L] -> unit embeddings [N, embed_dim] float32."""
        emb = self.text(tokens, mask)
        return emb / emb.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def encode_prompts(self, prompts: list[str]) -> Tensor:
        """Prompts -> unit embeddings [N, embed_dim] on the model's device (tokens padded to ``max_tokens``)."""
        tokens, mask = vocab.tokenize(list(prompts), self.config.max_tokens)
        device = self.logit_scale.device
        return self.encode_text(tokens.to(device), mask.to(device))

    def scale(self) -> Tensor:
        """exp(logit_scale) with CLIP's clamp (≤ 100): the inverse temperature of the logits."""
        return self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()


def save_clip(model: ShapesClip, path: Path, stats: dict[str, Any] | None = None) -> Path:
    """Write weights to ``path`` (.safetensors) and config + stats to the ``.json`` beside it, both atomically
    (``model.save_checkpoint``, shared with ShapesDiT)."""
    return save_checkpoint(model, path, stats)


def load_clip(path: Path, device: str | torch.device = "cpu") -> ShapesClip:
    """Rebuild a ShapesClip from ``save_clip``'s files (config from the .json, else the file's metadata), in eval
    mode with gradients off."""
    from safetensors.torch import load_file

    config = read_config(path)
    model = ShapesClip(ShapesClipConfig.from_dict(config))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval().requires_grad_(False)
