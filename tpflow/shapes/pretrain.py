"""Rectified-flow pretraining of ShapesDiT on shapes rendered on the fly, within a time budget.

    tpflow shapes pretrain --minutes 45 --out runs/shapes-pretrain

Each step draws ``batch_size`` train prompts (``prompts.random_item``), renders one ground-truth image per prompt
(``render.render_batch``, scaled to [-1, 1]), samples σ from a logit-normal (SD3's choice: most steps at mid noise),
forms z = (1 − σ)·x + σ·ε and regresses the velocity ε − x. 10% of the rows see the learned null text, which CFG
needs. AdamW with linear warm-up, gradient clipping at 1, and an EMA of the weights, which is what gets saved.
Rendering costs ~6% of a step on 2 cores, so it runs inline.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from tpflow.shapes import vocab
from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig, save_checkpoint

WEIGHTS_FILE = "shapes_dit.safetensors"
NULL_TEXT_P = 0.1  # fraction of rows trained on the null text: the unconditional branch of CFG


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def training_batch(
    batch_size: int, prompt_rng: random.Random, image_rng: np.random.Generator, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images [B, 3, 32, 32] in [-1, 1], word ids [B, L] and mask [B, L] for random train prompts."""
    from tpflow.shapes.prompts import random_item
    from tpflow.shapes.render import render_batch

    items = [random_item(prompt_rng, "train") for _ in range(batch_size)]
    images = render_batch([item.metadata for item in items], image_rng) * 2 - 1
    tokens, mask = vocab.tokenize([item.prompt for item in items], max_tokens)
    return images, tokens, mask


def flow_loss(model: ShapesDiT, x: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, gen: torch.Generator):
    """Rectified-flow loss mean‖v_θ(z(σ), σ) − (ε − x)‖² with logit-normal σ and 10% null-text rows."""
    n = x.shape[0]
    sigma = torch.sigmoid(torch.randn(n, generator=gen))  # logit-normal(0, 1)
    noise = torch.randn(x.shape, generator=gen)
    null = torch.rand(n, generator=gen) < NULL_TEXT_P
    s = sigma[:, None, None, None]
    z = (1 - s) * x + s * noise
    return F.mse_loss(model(z, sigma, tokens, mask, null), noise - x)


@torch.no_grad()
def _ema_update(ema: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    torch._foreach_lerp_(ema, params, 1 - decay)


def pretrain(
    minutes: float = 45.0,
    out: Path = Path("runs/shapes-pretrain"),
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup: int = 200,
    ema: float = 0.999,
    log_every: int = 100,
    config: ShapesDiTConfig | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    weight_decay: float = 0.01,
) -> Path:
    """Train a ShapesDiT from scratch for ``minutes`` (or ``max_steps``) and save its EMA weights.

    Args:
        minutes: wall-clock budget of the training loop; training stops at the first step past it.
        out: output folder: ``shapes_dit.safetensors`` (EMA weights) and ``shapes_dit.json`` (config + stats).
        seed: seeds the model init, the prompts, the renderings and the noise.
        batch_size: images per step (64: 3.5 it/s with bf16 units, ~2.3 it/s in float32 on 2 AVX2 cores).
        lr: AdamW peak learning rate, reached after ``warmup`` steps and then held.
        warmup: linear warm-up steps.
        ema: EMA decay of the saved weights (ramped as min(ema, (1 + step) / (10 + step)) for short runs).
        log_every: steps between log lines (and loss-history points).
        config: the architecture; None for the default ``ShapesDiTConfig()``.
        progress: show a rich progress bar (time-based) with loss and it/s; otherwise print log lines.
        max_steps: stop after this many steps even within the time budget (tests).
        weight_decay: AdamW weight decay.

    Returns:
        The path of the written ``shapes_dit.safetensors``.
    """
    from rich.console import Console

    torch.set_num_threads(_cores())
    config = config or ShapesDiTConfig()
    model, ema_model, optimizer = _build(config, seed, lr, weight_decay)
    params, ema_params = list(model.parameters()), list(ema_model.parameters())
    prompt_rng, image_rng = random.Random(seed), np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    console = Console(stderr=True)
    n_params = sum(p.numel() for p in params)
    console.print(f"shapes pretrain: {n_params / 1e6:.2f} M parameters, batch {batch_size}, {minutes:g} min budget")

    def update(step: int, batch: tuple) -> float:  # one optimizer step at the warm-up's rate, then the EMA
        value = _optimizer_step(model, optimizer, batch, gen, lr * min(1.0, (step + 1) / max(warmup, 1)))
        _ema_update(ema_params, params, min(ema, (1 + step) / (10 + step)))
        return value

    batches = functools.partial(training_batch, batch_size, prompt_rng, image_rng, config.max_tokens)
    run = _timed_loop(batches, update, console, minutes * 60.0, max_steps, log_every, progress)
    hyper = dict(seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, ema=ema, weight_decay=weight_decay)
    return _save(ema_model, Path(out) / WEIGHTS_FILE, config, run, n_params, hyper, console)


class _Run(NamedTuple):
    """What the loop did, for shapes_dit.json and the closing line."""

    steps: int
    loss: float  # the smoothed loss at the last step (NaN before the first)
    render_s: float  # seconds spent rendering batches
    history: list[dict[str, Any]]  # every ``log_every`` steps: step, minutes, smoothed loss
    elapsed: float  # seconds of the whole loop


def _build(
    config: ShapesDiTConfig, seed: int, lr: float, weight_decay: float
) -> tuple[ShapesDiT, ShapesDiT, torch.optim.AdamW]:
    """The model (its init seeded by ``seed``), its EMA copy (what gets saved: no gradients, eval mode) and AdamW."""
    torch.manual_seed(seed)
    model = ShapesDiT(config).train()
    ema_model = copy.deepcopy(model).eval().requires_grad_(False)
    return model, ema_model, _adamw(list(model.parameters()), lr, weight_decay)


def _timed_loop(
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    update: Callable[[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], float],
    console: Any,
    budget_s: float,
    max_steps: int | None,
    log_every: int,
    progress: bool,
) -> _Run:
    """Steps (a batch from ``batches``, then ``update(step, batch)`` returning its loss) until ``budget_s`` has
    passed or ``max_steps`` are done, with a time-based bar or log lines. Ctrl-C ends the loop early (the caller
    saves what it has) and a non-finite loss stops pretraining; rendering is timed apart from the update, for the
    stats."""
    step, smooth_loss, render_s, history = 0, float("nan"), 0.0, []
    start = time.perf_counter()
    bar = _progress_bar(console, progress)
    task = bar.add_task("pretrain", total=budget_s, info="")
    with bar:
        try:
            while time.perf_counter() - start < budget_s and (max_steps is None or step < max_steps):
                t0 = time.perf_counter()
                batch = batches()  # x [B, 3, 32, 32], tokens [B, L], mask [B, L]
                render_s += time.perf_counter() - t0
                value = update(step, batch)
                step += 1
                if not math.isfinite(value):
                    raise FloatingPointError(f"Pretraining loss became {value} at step {step}; lower --lr.")
                smooth_loss = value if step == 1 else 0.98 * smooth_loss + 0.02 * value
                elapsed = time.perf_counter() - start
                bar.update(
                    task,
                    completed=min(elapsed, budget_s),
                    info=f"step {step} loss {smooth_loss:.4f} {step / elapsed:.2f} it/s",
                )
                if step % log_every == 0:
                    history.append({"step": step, "minutes": round(elapsed / 60, 2), "loss": round(smooth_loss, 5)})
                    if not progress:
                        console.print(
                            f"step {step} {elapsed / 60:.1f} min loss {smooth_loss:.4f} {step / elapsed:.2f} it/s"
                        )
        except KeyboardInterrupt:
            console.print(f"interrupted at step {step}: saving the EMA weights so far")
    return _Run(step, smooth_loss, render_s, history, time.perf_counter() - start)


def _save(
    ema_model: ShapesDiT,
    path: Path,
    config: ShapesDiTConfig,
    run: _Run,
    n_params: int,
    hyper: dict[str, Any],
    console: Any,
) -> Path:
    """Write the EMA weights with the run's stats beside them (shapes_dit.json) and say so; returns the path."""
    stats = _stats(run.steps, run.elapsed, run.loss, run.render_s, n_params, run.history, hyper)
    path = save_checkpoint(ema_model, path, stats)
    console.print(
        f"saved {path} ({run.steps} steps, {run.elapsed / 60:.1f} min, loss {run.loss:.4f}, "
        f"rendering {100 * stats['render_share']:.0f}% of the time); config {asdict(config)}"
    )
    return path


def _adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]  # fused: one kernel for all parameters, ~2% of a step instead of ~10% on CPU
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), fused=True)


def _optimizer_step(
    model: ShapesDiT, optimizer: torch.optim.Optimizer, batch: tuple, gen, lr: float, loss: Callable = flow_loss
) -> float:
    """One rectified-flow step at learning rate ``lr`` (gradient norm clipped at 1; ``loss``: images' or clips');
    returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = loss(model, *batch, gen)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    optimizer.step()
    return loss.item()


def _progress_bar(console: Any, enabled: bool) -> Any:
    """A time-based rich progress bar with a free-text info field (loss, it/s)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("[bold]pretrain"), BarColumn(), TimeElapsedColumn(), TextColumn("/"), TimeRemainingColumn())
    return Progress(*columns, TextColumn("{task.fields[info]}"), console=console, disable=not enabled)


def _stats(step: int, elapsed: float, loss: float, render_s: float, n_params: int, history: list, hyper: dict):
    """What shapes_dit.json records about the run next to the config."""
    return {
        "iterations": step,
        "minutes": round(elapsed / 60, 3),
        "final_loss": loss,
        **hyper,
        "it_per_s": round(step / max(elapsed, 1e-9), 3),
        "render_share": round(render_s / max(elapsed, 1e-9), 3),
        "threads": torch.get_num_threads(),
        "parameters": n_params,
        "loss_history": history,
    }
