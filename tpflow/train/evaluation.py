"""Evaluation: ODE samples of the held-out prompts, their reward, per-tag accuracy and a sample grid.

The prompts are dealt to the processes (prompt k to process k mod P) and the scores gathered; prompt k starts from
the same noise whatever P (row k of one seeded draw), so the figures do not depend on the number of processes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from tpflow.devices import cpu_generator
from tpflow.distributed import Distributed
from tpflow.interfaces import Backbone, RewardModel
from tpflow.rewards._images import to_uint8
from tpflow.rollout import sample_ode
from tpflow.settings import EvalSettings
from tpflow.train.samples import save_grid
from tpflow.types import PromptItem

GRID_IMAGES = 64  # evaluation images in each sample grid: the first test prompts


@torch.no_grad()
def evaluate(
    backbone: Backbone,
    reward: RewardModel,
    everything: list[PromptItem],
    settings: EvalSettings,
    seed: int,
    dist: Distributed,
    autocast: Callable[[], AbstractContextManager],
    grid: Path,
) -> dict[str, float]:
    """Mean reward (``eval_reward``), each reward detail (``eval_<name>``) and, for GenEval-style rewards, strict
    accuracy per tag (``eval_acc_<tag>``) of ODE samples of ``everything``; process 0 writes ``grid``.

    Call it on every process (it gathers), with the weights to evaluate already in place (e.g. the EMA swapped in)."""
    mine = list(range(dist.rank, len(everything), dist.world_size))
    items = [everything[k] for k in mine]
    rows: list[tuple[int, float, dict[str, float]]] = []  # (prompt index, score, details)
    shown: list[tuple[int, torch.Tensor]] = []  # (prompt index, [1, 3, H, W] uint8) for the sample grid
    if items:
        z0 = backbone.initial_noise(len(everything), cpu_generator(seed))[mine]  # same z_0 on every device
        cond = backbone.encode([it.prompt for it in items])
        with autocast():
            latents = sample_ode(backbone, cond, z0, backbone.sigmas(settings.num_steps), settings.guidance,
                                 settings.batch_size)  # fmt: skip
        images = torch.cat([backbone.decode(part) for part in latents.split(settings.batch_size)])
        out = reward(images, [it.prompt for it in items], [it.metadata for it in items])
        details = {name: values.float().tolist() for name, values in out.details.items()}
        rows = [
            (k, score, {name: values[j] for name, values in details.items()})
            for j, (k, score) in enumerate(zip(mine, out.scores.float().tolist(), strict=True))
        ]
        shown = [(k, to_uint8(images[j : j + 1].cpu())) for j, k in enumerate(mine) if k < GRID_IMAGES]
    rows = sorted(dist.gather_objects(rows))
    shown = sorted(dist.gather_objects(shown), key=lambda pair: pair[0])
    if dist.is_main:
        save_grid(torch.cat([pixels for _, pixels in shown]).float() / 255, grid)
    metrics = {"eval_reward": sum(score for _, score, _ in rows) / len(rows)}
    for name in rows[0][2]:
        metrics[f"eval_{name}"] = sum(d[name] for _, _, d in rows) / len(rows)
    tags = [everything[k].metadata.get("tag") for k, _, _ in rows]
    if "strict" in rows[0][2] and all(tags):
        per_tag: dict[str, list[float]] = defaultdict(list)
        for tag, (_, _, d) in zip(tags, rows, strict=True):
            per_tag[tag].append(d["strict"])
        for tag, oks in sorted(per_tag.items()):
            metrics[f"eval_acc_{tag}"] = sum(oks) / len(oks)
    return metrics
