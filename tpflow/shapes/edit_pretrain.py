"""Rectified-flow pretraining of ShapesEditDiT on (source, instruction) -> target pairs rendered on the fly.

    tpflow shapes pretrain-edit --minutes 40 --out runs/shapes-edit-pretrain

As ``tpflow shapes pretrain`` (``tpflow.shapes.pretrain``, whose loop, optimizer, EMA and saving it reuses), on
edits: each step draws ``batch_size`` train edits of the editing world (never a held-out one, ``edit_world``),
renders each source scene and its target scene (scaled to [-1, 1]), draws σ from a logit-normal, forms
z = (1 − σ)·x + σ·ε from the target x and regresses ε − x given the source; 10% of the rows see the learned null text
(CFG's unconditional branch, which keeps its source). The model starts from the shipped image model
(``edit_init``). The EMA weights are written atomically every ``save_every`` steps and at the end, so a run that is
killed keeps its last save, and ``--init`` that file continues it.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tpflow.devices import cpu_generator
from tpflow.shapes import edit_world
from tpflow.shapes.edit_init import start_model
from tpflow.shapes.edit_model import ShapesEditConfig, ShapesEditDiT
from tpflow.shapes.model import save_checkpoint
from tpflow.shapes.pretrain import NULL_TEXT_P, _adamw, _cores, _ema_update, _optimizer_step, _save, _timed_loop
from tpflow.shapes.render import draw_scene
from tpflow.sources import load

WEIGHTS_FILE = "shapes_edit_dit.safetensors"


def edit_batch(batch_size: int, rng: np.random.Generator, max_tokens: int):
    """Targets [B, 3, 32, 32] and sources [B, 3, 32, 32] in [-1, 1], word ids [B, L] and mask [B, L] for random
    train edits (what ``edit_flow_loss`` takes after the model)."""
    pairs = [edit_world.random_pair(rng, "train") for _ in range(batch_size)]
    targets = torch.stack([draw_scene(target, edit_world.SIZE) for _, target in pairs]) * 2 - 1
    sources = torch.stack([load(item.metadata["sources"][0]) for item, _ in pairs]) * 2 - 1
    tokens, mask = edit_world.tokenize([item.prompt for item, _ in pairs], max_tokens)
    return targets, sources, tokens, mask


def edit_flow_loss(model: ShapesEditDiT, x: torch.Tensor, source: torch.Tensor, tokens, mask, gen):
    """mean‖v_θ(z(σ), σ | source) − (ε − x)‖², logit-normal σ, 10% null-text rows (their source kept)."""
    n = x.shape[0]
    sigma = torch.sigmoid(torch.randn(n, generator=gen, device="cpu"))  # CPU-only pretraining
    noise = torch.randn(x.shape, generator=gen, device="cpu")
    null = torch.rand(n, generator=gen, device="cpu") < NULL_TEXT_P
    s = sigma.view(n, 1, 1, 1)
    return F.mse_loss(model((1 - s) * x + s * noise, sigma, tokens, mask, null, source), noise - x)


def edit_pretrain(
    minutes: float = 40.0,
    out: Path = Path("runs/shapes-edit-pretrain"),
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 5e-4,  # below the image model's 1e-3: the copied layers are already trained
    warmup: int = 100,
    ema: float = 0.998,
    log_every: int = 50,
    config: ShapesEditConfig | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    weight_decay: float = 0.01,
    threads: int | None = None,
    init: str | Path | None = "image",
    save_every: int = 200,
) -> Path:
    """Train a ShapesEditDiT for ``minutes`` (or ``max_steps``) and save its EMA weights as
    ``out/shapes_edit_dit.safetensors`` (config and stats in the .json beside it); the arguments as
    ``tpflow.shapes.pretrain.pretrain``'s; ``threads``: torch CPU threads (None: every core); ``init``: where the
    weights start (``edit_init.start_model``); ``save_every``: steps between atomic saves of the EMA weights."""
    from rich.console import Console

    torch.set_num_threads(threads or _cores())
    config = config or ShapesEditConfig()
    torch.manual_seed(seed)
    model = ShapesEditDiT(config).train()
    started = start_model(model, init)
    ema_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = _adamw(list(model.parameters()), lr, weight_decay)
    params, ema_params = list(model.parameters()), list(ema_model.parameters())
    rng, gen = np.random.default_rng(seed), cpu_generator(seed)
    path = Path(out) / WEIGHTS_FILE
    console = Console(stderr=True)
    n_params = sum(p.numel() for p in params)
    console.print(f"shapes edit pretrain: {n_params / 1e6:.2f} M parameters, batch {batch_size}, {minutes:g} min, "
                  f"init {started}")  # fmt: skip

    def update(step: int, batch: tuple) -> float:
        rate = lr * min(1.0, (step + 1) / max(warmup, 1))
        value = _optimizer_step(model, optimizer, batch, gen, rate, loss=edit_flow_loss)
        _ema_update(ema_params, params, min(ema, (1 + step) / (10 + step)))
        if (step + 1) % save_every == 0:  # a killed run keeps this (atomic: save_checkpoint)
            save_checkpoint(ema_model, path, {"iterations": step + 1, "init": started, "partial": True})
        return value

    batches = functools.partial(edit_batch, batch_size, rng, config.max_tokens)
    run = _timed_loop(batches, update, console, minutes * 60.0, max_steps, log_every, progress)
    hyper = dict(init=started, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, ema=ema,
                 weight_decay=weight_decay)  # fmt: skip
    return _save(ema_model, path, config, run, n_params, hyper, console)
