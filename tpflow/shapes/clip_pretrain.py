"""Contrastive training of ShapesCLIP on shapes rendered on the fly, with hard negatives, within a time budget.

    tpflow shapes clip-pretrain --minutes 11 --out runs/shapes-clip --threads 1

Each step draws ``batch_size`` prompts (``prompts.random_item``; the binding tags color_attr and position three times
as often), renders one scene per prompt and its hard negatives (``negatives.hard_negatives``: the same scene with
one colour, shape, count or position changed), and augments every image with mild Gaussian noise and blur (the
reward scores a diffusion model's imperfect samples).
The text side is every distinct prompt, so each image is also contrasted with the prompts of its own hard
negatives ("a blue circle and a red square" against "a red circle and a blue square"). Which prompt matches which
image comes from GenEval's rules on the drawn objects (``negatives.satisfies``), so "a photo of a circle" is a
positive of a red circle's image too. The loss is CLIP's symmetric InfoNCE with several positives per row (uniform
targets over them). AdamW, linear warm-up then a cosine decay over the time budget; no EMA (the loss is smooth).

Which prompts: by default every prompt of the world (the ``test`` split), held-out colour-shape pairs included. The
reward is a judge, like shapes-geneval's detector, which knows every pair; the held-out pairs stay unseen by the
generator, which is what the split is for. ``split="train"`` never hears them, and then ranks the swapped colours
of a held-out pair below chance (a tiny CLIP does not compose "blue" and "square" it never heard together).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tpflow.devices import cpu_generator
from tpflow.shapes import vocab
from tpflow.shapes.clip import ShapesClip, ShapesClipConfig, save_clip

WEIGHTS_FILE = "shapes_clip.safetensors"
NOISE_P, NOISE_MAX = 0.5, 0.08  # fraction of images with added Gaussian noise, and its largest std
BLUR_P, BLUR_MAX = 0.3, 1.0  # fraction of images blurred (3×3 Gaussian), and the largest blur sigma in pixels
HARD_TAGS = ("color_attr", "position")  # binding tags (learned last), drawn three times as often as the others
LOGIT_SCALE_LR = 10.0  # the temperature's learning rate / lr: at lr it climbs ~1e-3 per step, too slow for 10 min


def training_batch(
    batch_size: int,
    texts: list[dict[str, Any]],
    prompt_rng: random.Random,
    image_rng: np.random.Generator,
    split: str = "test",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [I, 3, 32, 32] in [0, 1] (each prompt's scene, then its hard negatives) and positives [T, I] bool.

    ``texts`` are the text side's include lists (every distinct prompt of ``split``); positives[t, i] says whether
    image i satisfies text t.
    """
    from tpflow.shapes.negatives import hard_negatives, satisfies
    from tpflow.shapes.prompts import random_item
    from tpflow.shapes.render import draw_scene, scene

    scenes = []
    for _ in range(batch_size):
        metadata = random_item(prompt_rng, split).metadata
        while metadata["tag"] not in HARD_TAGS and prompt_rng.random() < 2 / 3:  # hard tags three times as often
            metadata = random_item(prompt_rng, split).metadata
        objects = scene(metadata, image_rng)
        scenes += [objects] + [neg.objects for neg in hard_negatives(metadata, objects, image_rng)]
    images = torch.stack([draw_scene(objects) for objects in scenes])  # [I, 3, 32, 32]
    positives = torch.tensor(
        [[satisfies(include, objects) for objects in scenes] for include in texts], dtype=torch.bool, device="cpu"
    )  # [T, I]
    return images, positives


def augment(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Mild corruption like a diffusion sample's: a random 3×3 Gaussian blur and Gaussian noise, clamped to [0, 1].

    images: [N, 3, H, W] float32 in [0, 1] on the CPU (the generator's device).
    """
    n = images.shape[0]
    sigma = torch.rand(n, generator=gen, device="cpu") * BLUR_MAX + 1e-3  # [N]
    sigma = torch.where(torch.rand(n, generator=gen, device="cpu") < BLUR_P, sigma, torch.full_like(sigma, 1e-3))
    taps = torch.exp(-(torch.arange(-1, 2, dtype=torch.float32, device="cpu")[None] ** 2) / (2 * sigma[:, None] ** 2))
    taps = taps / taps.sum(1, keepdim=True)  # [N, 3]; sigma 1e-3 -> (0, 1, 0): no blur
    kernel = (taps[:, :, None] * taps[:, None, :]).repeat_interleave(3, dim=0)[:, None]  # [N·3, 1, 3, 3]
    padded = F.pad(images.reshape(1, n * 3, *images.shape[2:]), (1, 1, 1, 1), mode="replicate")
    blurred = F.conv2d(padded, kernel, groups=n * 3).reshape(images.shape)
    std = torch.rand(n, generator=gen, device="cpu") * NOISE_MAX
    std = torch.where(torch.rand(n, generator=gen, device="cpu") < NOISE_P, std, torch.zeros_like(std))
    noise = torch.randn(images.shape, generator=gen, device="cpu") * std[:, None, None, None]
    return (blurred + noise).clamp(0, 1)


def clip_loss(model: ShapesClip, images: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, positives):
    """Symmetric InfoNCE over texts [T] and images [I] with several positives per row (uniform targets).

    Texts without a positive image in the batch are left out of the text->image half; images that no text
    describes (five circles, a held-out colour) only serve as negatives.
    """
    logits = model.scale() * model.encode_text(tokens, mask) @ model.encode_image(images).T  # [T, I]
    pos = positives.float()
    rows, cols = positives.any(1), positives.any(0)
    t2i = -(pos[rows] / pos[rows].sum(1, keepdim=True) * logits[rows].log_softmax(1)).sum(1).mean()
    pos_t, logits_t = pos.T[cols], logits.T[cols]  # [I', T]
    i2t = -(pos_t / pos_t.sum(1, keepdim=True) * logits_t.log_softmax(1)).sum(1).mean()
    return (t2i + i2t) / 2


def clip_pretrain(
    minutes: float = 11.0,
    out: Path = Path("runs/shapes-clip"),
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 2e-3,
    warmup: int = 100,
    threads: int | None = None,
    max_steps: int | None = None,
    progress: bool = True,
    config: ShapesClipConfig | None = None,
    weight_decay: float = 0.01,
    split: str = "test",
) -> Path:
    """Train a ShapesCLIP from scratch for ``minutes`` (or ``max_steps``); returns the written .safetensors path.

    Args:
        minutes: wall-clock budget of the training loop; training stops at the first step past it.
        out: output folder: ``shapes_clip.safetensors`` and ``shapes_clip.json`` (config + stats).
        seed: seeds the initialisation, prompts, renderings and augmentation.
        batch_size: train prompts per step (each brings its scene and 1-2 hard negatives).
        lr: AdamW peak learning rate after ``warmup`` steps, then cosine-decayed over the budget.
        warmup: linear warm-up steps.
        threads: torch CPU threads (None: torch's default).
        max_steps: stop after this many steps even within the budget (tests).
        progress: show a progress bar; otherwise print a log line every 100 steps.
        config: the architecture; None for the default ``ShapesClipConfig()``.
        weight_decay: AdamW weight decay of the matrices.
        split: the prompts it learns: "test" (all, the default) or "train" (no held-out pairs; module docstring).
    """
    from tpflow.shapes.prompts import prompts

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = ShapesClip(config).train()
    texts, optimizer = prompts(split), _optimizer(model, lr, weight_decay)
    tokens, mask = vocab.tokenize([item.prompt for item in texts], model.config.max_tokens)
    includes = [item.metadata["include"] for item in texts]
    prompt_rng, image_rng, gen = random.Random(seed), np.random.default_rng(seed), cpu_generator(seed)
    budget_s = minutes * 60.0

    def step_fn(step: int, elapsed: float) -> float:
        done = max(elapsed / budget_s, step / max_steps if max_steps else 0.0)
        factor = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = group["lr_scale"] * lr * factor
        images, positives = training_batch(batch_size, includes, prompt_rng, image_rng, split)
        loss = clip_loss(model, augment(images, gen), tokens, mask, positives)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    step, smooth, elapsed, history = _loop(step_fn, budget_s, max_steps, progress)
    run = {"seed": seed, "batch_size": batch_size, "lr": lr, "warmup": warmup, "weight_decay": weight_decay}
    stats = _stats(model.eval(), step, smooth, elapsed, history, {**run, "split": split})
    return save_clip(model, Path(out) / WEIGHTS_FILE, stats)


def _optimizer(model: ShapesClip, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW: decay on matrices only; the logit scale at ``LOGIT_SCALE_LR`` × lr (each group's ``lr_scale``)."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "lr_scale": 1.0},
            {
                "params": [p for p in params if p.ndim < 2 and p is not model.logit_scale],
                "weight_decay": 0.0,
                "lr_scale": 1.0,
            },
            {"params": [model.logit_scale], "weight_decay": 0.0, "lr_scale": LOGIT_SCALE_LR},
        ],
        lr=lr,
    )


def _stats(model: ShapesClip, step: int, smooth: float, elapsed: float, history: list, run: dict) -> dict[str, Any]:
    """Training statistics for the JSON beside the weights, with the pairwise accuracy on 240 test prompts."""
    from tpflow.shapes.clip_accuracy import pairwise_accuracy
    from tpflow.shapes.prompts import prompts

    accuracy = pairwise_accuracy(model, prompts("test", 240, seed=1), seed=1)
    return {
        "iterations": step,
        "minutes": round(elapsed / 60, 3),
        "final_loss": round(smooth, 5),
        **run,
        "threads": torch.get_num_threads(),
        "it_per_s": round(step / max(elapsed, 1e-9), 3),
        "parameters": sum(p.numel() for p in model.parameters()),
        "logit_scale": round(float(model.scale().detach()), 3),
        "pairwise_accuracy_test240": accuracy["by_tag"],
        "loss_history": history,
    }


def _loop(step_fn, budget_s: float, max_steps: int | None, progress: bool) -> tuple[int, float, float, list]:
    """Run ``step_fn(step, elapsed) -> loss`` until the budget or ``max_steps``; a progress bar or log lines.

    Returns (steps, smoothed loss, elapsed seconds, loss history every 100 steps). Ctrl-C stops early and keeps
    what was trained.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    columns = (TextColumn("[bold]clip-pretrain"), BarColumn(), TimeElapsedColumn(), TextColumn("/"))
    bar = Progress(*columns, TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)
    bar.disable = not progress
    task = bar.add_task("clip-pretrain", total=budget_s, info="")
    step, smooth, history, start = 0, float("nan"), [], time.perf_counter()
    with bar:
        try:
            while time.perf_counter() - start < budget_s and (max_steps is None or step < max_steps):
                value = step_fn(step, time.perf_counter() - start)
                if not math.isfinite(value):
                    raise FloatingPointError(f"clip-pretrain loss became {value} at step {step}; lower --lr.")
                step += 1
                smooth = value if step == 1 else 0.98 * smooth + 0.02 * value
                elapsed = time.perf_counter() - start
                info = f"step {step} loss {smooth:.4f} {step / elapsed:.2f} it/s"
                bar.update(task, completed=min(elapsed, budget_s), info=info)
                if step % 100 == 0:
                    history.append({"step": step, "minutes": round(elapsed / 60, 2), "loss": round(smooth, 5)})
                    if not progress:
                        console.print(info)
        except KeyboardInterrupt:
            console.print(f"interrupted at step {step}: saving the model so far")
    return step, smooth, time.perf_counter() - start, history
