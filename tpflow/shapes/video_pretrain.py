"""Rectified-flow pretraining of ShapesVideoDiT on clips rendered on the fly, within a time budget.

    tpflow shapes video-pretrain --minutes 60 --out runs/shapes-video-pretrain

As ``tpflow shapes pretrain`` (``tpflow.shapes.pretrain``, whose loop, optimizer, EMA and saving it reuses), on clips:
each step draws ``batch_size`` train prompts of the video world (never a held-out triple), renders one clip per
prompt (``video_world.render_clip``, scaled to [-1, 1]), draws σ from a logit-normal, forms z = (1 − σ)·x + σ·ε and
regresses ε − x; 10% of the rows see the learned null text (CFG). The EMA weights are saved.
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tpflow.devices import cpu_generator
from tpflow.shapes import video_world
from tpflow.shapes.pretrain import NULL_TEXT_P, _adamw, _cores, _ema_update, _optimizer_step, _save, _timed_loop
from tpflow.shapes.video_init import start_model
from tpflow.shapes.video_model import ShapesVideoConfig, ShapesVideoDiT

WEIGHTS_FILE = "shapes_video_dit.safetensors"


def clip_batch(batch_size: int, prompt_rng: random.Random, clip_rng: np.random.Generator, max_tokens: int):
    """Clips [B, F, 3, 32, 32] in [-1, 1], word ids [B, L] and mask [B, L] for random train prompts."""
    items = [video_world.random_item(prompt_rng, "train") for _ in range(batch_size)]
    clips = torch.stack([video_world.render_clip(item.metadata, clip_rng) for item in items]) * 2 - 1
    tokens, mask = video_world.tokenize([item.prompt for item in items], max_tokens)
    return clips, tokens, mask


def clip_flow_loss(model: ShapesVideoDiT, x: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, gen):
    """mean‖v_θ(z(σ), σ) − (ε − x)‖² over clips, logit-normal σ, 10% null-text rows."""
    n = x.shape[0]
    sigma = torch.sigmoid(torch.randn(n, generator=gen, device="cpu"))  # CPU-only pretraining
    noise = torch.randn(x.shape, generator=gen, device="cpu")
    null = torch.rand(n, generator=gen, device="cpu") < NULL_TEXT_P
    s = sigma.view(n, 1, 1, 1, 1)
    return F.mse_loss(model((1 - s) * x + s * noise, sigma, tokens, mask, null), noise - x)


def video_pretrain(
    minutes: float = 60.0,
    out: Path = Path("runs/shapes-video-pretrain"),
    seed: int = 0,
    batch_size: int = 12,
    lr: float = 5e-4,  # below the image model's 1e-3: the inflated spatial layers are already trained
    warmup: int = 200,
    ema: float = 0.999,
    log_every: int = 100,
    config: ShapesVideoConfig | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    weight_decay: float = 0.01,
    threads: int | None = None,
    init: str | Path | None = "image",
) -> Path:
    """Train a ShapesVideoDiT for ``minutes`` (or ``max_steps``) and save its EMA weights as
    ``out/shapes_video_dit.safetensors`` (config and stats in the .json beside it); the arguments as
    ``tpflow.shapes.pretrain.pretrain``'s; ``threads``: torch CPU threads (None: every core); ``init``: where the
    weights start (``video_init.start_model``: "image", the shipped image model inflated, by default)."""
    from rich.console import Console

    torch.set_num_threads(threads or _cores())
    config = config or ShapesVideoConfig()
    torch.manual_seed(seed)
    model = ShapesVideoDiT(config).train()
    started = start_model(model, init)
    ema_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = _adamw(list(model.parameters()), lr, weight_decay)
    params, ema_params = list(model.parameters()), list(ema_model.parameters())
    prompt_rng, clip_rng = random.Random(seed), np.random.default_rng(seed)
    gen = cpu_generator(seed)
    console = Console(stderr=True)
    n_params = sum(p.numel() for p in params)
    console.print(f"shapes video pretrain: {n_params / 1e6:.2f} M parameters, batch {batch_size}, {minutes:g} min, "
                  f"init {started}")  # fmt: skip

    def update(step: int, batch: tuple) -> float:
        rate = lr * min(1.0, (step + 1) / max(warmup, 1))
        value = _optimizer_step(model, optimizer, batch, gen, rate, loss=clip_flow_loss)
        _ema_update(ema_params, params, min(ema, (1 + step) / (10 + step)))
        return value

    batches = functools.partial(clip_batch, batch_size, prompt_rng, clip_rng, config.max_tokens)
    run = _timed_loop(batches, update, console, minutes * 60.0, max_steps, log_every, progress)
    hyper = dict(
        init=started, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, ema=ema, weight_decay=weight_decay
    )
    return _save(ema_model, Path(out) / WEIGHTS_FILE, config, run, n_params, hyper, console)
