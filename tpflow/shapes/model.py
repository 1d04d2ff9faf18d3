"""ShapesDiT: the tiny text-conditioned rectified-flow DiT of the embedded shapes world (docs/shapes.md).

Pixel space, 32×32 RGB scaled to [-1, 1], patch 4 (64 image tokens). A two-layer transformer encodes the prompt's
word ids; its tokens join the image tokens in ONE attention sequence (pad tokens masked out of the keys). Every
block has QK-norm and adaLN-zero modulation from the timestep embedding of 1000·σ plus the pooled text vector. The
network predicts the rectified-flow velocity v ≈ ε − x for z(σ) = (1 − σ)·x + σ·ε (docs/algorithm.md §1.1).

Classifier-free guidance uses a learned null text (``null_text`` [max_tokens, width], every position real) that
replaces the encoded prompt of the rows flagged ``null``: 10% of the pretraining rows, the unconditional half of
a CFG batch.

Linear layers carry diffusers' names (``attn.to_q``, ``attn.to_k``, ``attn.to_v``, ``attn.to_out.0``,
``ff.net.0``, ``ff.net.2``) so that peft LoRA targets them as it targets SD3's transformer. The text encoder uses
other names (``self_attn.q_proj``...), so the default targets adapt the joint blocks only, as Flow-GRPO's SD3 LoRA
adapts the transformer and not the text encoders.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tpflow.shapes import vocab

LORA_TARGETS: list[str] = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
"""Default LoRA targets: the attention projections of the joint blocks (Flow-GRPO's SD3 choice)."""


@dataclass
class ShapesDiTConfig:
    """Architecture of ShapesDiT; ``asdict`` of it is stored next to the weights (``shapes_dit.json``)."""

    image_size: int = 32  # pixels per side
    channels: int = 3  # RGB
    patch_size: int = 4  # 4×4 patches: 64 image tokens at 32×32
    width: int = 128  # token width of every layer
    depth: int = 4  # joint (text + image) DiT blocks
    heads: int = 4  # attention heads (head dim = width / heads)
    text_width: int = 128  # word embedding width; must equal width (the text joins the image sequence)
    text_layers: int = 2  # transformer layers of the text encoder
    max_tokens: int = vocab.MAX_TOKENS  # words per prompt (longer prompts are truncated by the tokenizer)
    vocab_size: int = len(vocab.WORDS)  # closed word vocabulary
    mlp_ratio: float = 4.0  # hidden width of the feed-forward layers / width

    def __post_init__(self) -> None:
        if self.text_width != self.width:
            raise ValueError(f"text_width ({self.text_width}) must equal width ({self.width}): joint attention.")
        if self.width % self.heads or self.image_size % self.patch_size:
            raise ValueError("width must be divisible by heads and image_size by patch_size.")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapesDiTConfig:
        """The config from its ``asdict`` form; unknown keys raise."""
        return config_from_dict(cls, data)


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """A dataclass config from its ``asdict`` form (as stored next to the weights); unknown keys raise."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"Unknown {cls.__name__} fields {unknown}; known: {sorted(known)}.")
    return cls(**data)


def _attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """softmax(q·kᵀ/√d + bias)·v written out: on CPU its backward is ~2× faster than the fused SDPA kernel.

    q, k, v: [N, heads, L, d]; bias: [N, 1, 1, L] additive key mask (0 or a large negative) or None.
    """
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # [N, heads, L, L]
    if bias is not None:
        scores = scores + bias
    return scores.softmax(dim=-1) @ v


class Attention(nn.Module):
    """Multi-head self-attention with QK-norm (RMSNorm over the head dim); diffusers' layer names."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(width, width)
        self.to_v = nn.Linear(width, width)
        self.norm_q = nn.RMSNorm(width // heads, eps=1e-6)
        self.norm_k = nn.RMSNorm(width // heads, eps=1e-6)
        self.to_out = nn.Sequential(nn.Linear(width, width))  # "to_out.0", as in diffusers

    def forward(self, x: Tensor, bias: Tensor | None) -> Tensor:
        n, length, width = x.shape
        split = (n, length, self.heads, width // self.heads)
        q = self.norm_q(self.to_q(x).view(split)).transpose(1, 2)  # [N, heads, L, d]
        k = self.norm_k(self.to_k(x).view(split)).transpose(1, 2)
        v = self.to_v(x).view(split).transpose(1, 2)
        out = _attention(q, k, v, bias).transpose(1, 2).reshape(n, length, width)
        return self.to_out(out)


class FeedForward(nn.Module):
    """Linear, GELU, Linear, named ``net.0`` / ``net.2`` as in diffusers."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TextLayer(nn.Module):
    """Pre-norm transformer layer of the text encoder (names kept apart from the LoRA targets)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.self_attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = FeedForward(width, hidden)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm1(x), bias)
        return x + self.mlp(self.norm2(x))


class JointBlock(nn.Module):
    """DiT block over the joint [text; image] sequence with adaLN-zero modulation (shift, scale, gate) × 2."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(width, hidden)
        self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))

    def forward(self, x: Tensor, c: Tensor, bias: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(c)[:, None].chunk(6, dim=-1)  # [N, 1, width]
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1, bias)
        return x + gate2 * self.ff(self.norm2(x) * (1 + scale2) + shift2)


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding [N, dim] of timesteps t [N] (here 1000·σ), cos then sin as in DiT."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _sincos_2d(grid: int, width: int) -> Tensor:
    """2-D sin-cos position table [grid², width]: the initial value of the learned image positions."""
    coords = torch.arange(grid, dtype=torch.float32)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    parts = [f(c.reshape(-1, 1) * omega) for c in (ys, xs) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=1)


class ShapesDiT(nn.Module):
    """Text-conditioned rectified-flow DiT in pixel space: ``forward(x, sigma, tokens, mask, null) -> v``."""

    def __init__(self, config: ShapesDiTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or ShapesDiTConfig()
        width, hidden = cfg.width, int(cfg.width * cfg.mlp_ratio)
        self.grid = cfg.image_size // cfg.patch_size
        # text encoder
        self.word_embed = nn.Embedding(cfg.vocab_size, width)
        self.text_pos = nn.Parameter(torch.randn(cfg.max_tokens, width) * 0.02)
        self.text_layers = nn.ModuleList(TextLayer(width, cfg.heads, hidden) for _ in range(cfg.text_layers))
        self.text_norm = nn.LayerNorm(width)
        self.null_text = nn.Parameter(torch.randn(cfg.max_tokens, width) * 0.02)  # CFG's unconditional text
        self.text_pool = nn.Linear(width, width)
        # image and timestep
        self.x_embed = nn.Linear(cfg.channels * cfg.patch_size**2, width)
        self.pos_embed = nn.Parameter(_sincos_2d(self.grid, width))
        self.time_embed = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        # joint blocks and output
        self.blocks = nn.ModuleList(JointBlock(width, cfg.heads, hidden) for _ in range(cfg.depth))
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.adaln_out = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.proj_out = nn.Linear(width, cfg.channels * cfg.patch_size**2)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.word_embed.weight, std=0.02)
        for block in self.blocks:  # adaLN-zero: every block starts as the identity
            nn.init.zeros_(block.adaln[-1].weight)
            nn.init.zeros_(block.adaln[-1].bias)
        for layer in (self.adaln_out[-1], self.proj_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def encode_text(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Word ids [N, L] and their mask [N, L] -> text tokens [N, L, width] (positions beyond L unused)."""
        length = tokens.shape[1]
        x = self.word_embed(tokens) + self.text_pos[:length]
        bias = _key_bias(mask, x.dtype)
        for layer in self.text_layers:
            x = layer(x, bias)
        return self.text_norm(x)

    def forward(self, x: Tensor, sigma: Tensor, tokens: Tensor, mask: Tensor, null: Tensor | None = None) -> Tensor:
        """Velocity [N, C, H, W] of images x [N, C, H, W] at noise levels sigma [N] in [0, 1].

        Args:
            x: noisy images z(σ).
            sigma: [N] noise levels (1 = pure noise).
            tokens: [N, L] word ids (``vocab.tokenize``), L <= max_tokens.
            mask: [N, L] bool, True for real words.
            null: [N] bool, rows that use the learned null text instead of their prompt (CFG), or None.
        """
        cfg, n = self.config, x.shape[0]
        p, g = cfg.patch_size, self.grid
        patches = x.reshape(n, cfg.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, -1)
        out = self.joint(self.x_embed(patches) + self.pos_embed, sigma, tokens, mask, null, x.dtype)  # [N, g², C·p·p]
        out = out.reshape(n, g, g, cfg.channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(n, cfg.channels, cfg.image_size, cfg.image_size)

    def joint(
        self,
        image: Tensor,
        sigma: Tensor,
        tokens: Tensor,
        mask: Tensor,
        null: Tensor | None,
        dtype: torch.dtype,
        between: Callable[[int, Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """The text encoder, the conditioning and the joint blocks over embedded image tokens [N, T, width]; returns
        the output patches [N, T, proj_out's width] (what ``forward`` and the video model share). ``dtype``: the
        input pixels' (the null text and the timestep embedding are cast to it, under autocast too). ``between(i,
        image_tokens, c)``: applied to the image tokens [N, T, width] after block i, with the conditioning c [N,
        width] (the video model's temporal layers)."""
        cfg, n = self.config, image.shape[0]
        length = tokens.shape[1]
        mask = mask.bool()
        if null is None or not bool(null.any()):
            text = self.encode_text(tokens, mask)
        else:  # encode only the conditional rows; the null rows take the learned null text
            null = null.bool()
            text = self.null_text[:length].to(dtype).expand(n, length, -1).clone()
            keep = (~null).nonzero().squeeze(1)
            if keep.numel():
                text[keep] = self.encode_text(tokens[keep], mask[keep]).to(text.dtype)
            mask = mask | null[:, None]
        weights = mask.to(text.dtype)[..., None]
        pooled = (text * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # [N, width]
        c = self.time_embed(timestep_embedding(1000.0 * sigma.reshape(n), cfg.width).to(dtype))
        c = c + self.text_pool(pooled)
        h = torch.cat([text, image], dim=1)  # [N, L + T, width]
        image_mask = torch.ones(n, image.shape[1], dtype=torch.bool, device=image.device)
        bias = _key_bias(torch.cat([mask, image_mask], dim=1), h.dtype)
        for i, block in enumerate(self.blocks):
            h = block(h, c, bias)
            if between is not None:
                h = torch.cat([h[:, :length], between(i, h[:, length:], c)], dim=1)
        shift, scale = self.adaln_out(c)[:, None].chunk(2, dim=-1)
        return self.proj_out(self.norm_out(h[:, length:]) * (1 + scale) + shift)


def _key_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive attention bias [N, 1, 1, L]: 0 for real keys, a large negative (finite: no NaN) for padding."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -1e4)[:, None, None]


def save_checkpoint(
    model: nn.Module, path: Path, stats: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write weights to ``path`` (.safetensors) and config + stats to the ``.json`` beside it, both atomically.

    Any shapes-world model with a dataclass ``config`` (ShapesDiT, ShapesClip). The state dict is taken as is (pass
    the EMA model to ship EMA weights); the config also goes into the safetensors metadata so that the file alone is
    enough to rebuild the model. ``state``: the weights to write in place of ``model.state_dict()`` (a sharded run's,
    gathered).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = asdict(model.config)
    state = model.state_dict() if state is None else state
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in state.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"config": json.dumps(config)})
    os.replace(tmp, path)
    meta = path.with_suffix(".json")
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps({"config": config, "stats": stats or {}}, indent=2) + "\n")
    os.replace(tmp, meta)
    return path


def read_config(path: Path) -> dict[str, Any]:
    """The config ``save_checkpoint`` stored: from the ``.json`` beside ``path``, else the file's metadata."""
    from safetensors import safe_open

    path = Path(path)
    meta = path.with_suffix(".json")
    if meta.is_file():
        return json.loads(meta.read_text())["config"]
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {})["config"])


def load_checkpoint(path: Path, device: str | torch.device = "cpu") -> ShapesDiT:
    """Rebuild a ShapesDiT from ``save_checkpoint``'s files (config from the .json, else the file's metadata)."""
    from safetensors.torch import load_file

    model = ShapesDiT(ShapesDiTConfig.from_dict(read_config(path)))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval()
