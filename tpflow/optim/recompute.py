"""``[optimizer] recompute = "retain"`` on the update's side: what it requires of a recipe, and which micro-batches
take the rollout's retained graphs.

``recompute = "retain"`` (``tpflow.rollout.retain``) keeps the rollout's own forward graphs for the update's first,
on-policy optimizer step. That is exact only where the rollout's forward pass is the update's: the same weights (the
live adapter: GRPO samples with it), the same precision (both run in the trainer's autocast), the same guidance and
CFG gradient (the rollout's velocity call runs in the optimizer's ``cfg_gradient`` context), and every stored step
trained. The last is the one-window plan's alone today: the branch, per-row windows, the DPM-Solver tail and a
trained subset of steps have engines of their own that keep no graphs, and are refused here, before anything loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tpflow.types import RetainedPart, Rollout, StepOutput


def retain_problems(options: Any, settings: dict) -> list[str]:
    """One sentence per way the recipe cannot use its ``recompute`` and ``max_retained_steps`` options."""
    if options.recompute != "retain":
        if options.max_retained_steps is not None:
            return [
                f"[optimizer] max_retained_steps = {options.max_retained_steps} caps the graphs that recompute = "
                f'"retain" keeps, and recompute is "{options.recompute}". Drop it, or set recompute = "retain".'
            ]
        return []
    plan = settings.get("plan")
    name = getattr(plan, "name", "window")
    if name != "window":
        return [
            f'[optimizer] recompute = "retain" keeps the graphs of the one-window plan\'s rollout, where every stored '
            f"step is trained, and [plan] name = {name!r} samples with an engine of its own that keeps none yet "
            '(docs/training.md, "Recompute-free updates"). Use recompute = "native" with this plan, or the '
            '"window" plan.'
        ]
    return []


def retained_passes(batch: Rollout, micro_batches: list[tuple[Tensor, Tensor]], options: Any) -> tuple[list, bool]:
    """The update's passes over ``micro_batches`` (device rows, host rows), each tagged with whether it takes the
    retained graphs, and whether any does.

    The first optimizer step's micro-batches are on policy and take them; every later step, and every later pass,
    recomputes natively at the moved weights. The retained backward runs over every row of the rollout batches the
    step touches, trained or not (a batched graph cannot be back-propagated for some rows only), so when the first
    step trains fewer than ``retain_min_trained`` of the rows of the rollout batches it touches (zero-advantage rows
    skipped, rows left to later steps), native is cheaper, and taken."""
    if batch.retained is not None and batch.trained is not None:
        raise ValueError("retained graphs come from the one-window plan, whose rollouts train every stored step.")
    accumulation = options.gradient_accumulation_steps
    first = [host for _, host in micro_batches[:accumulation]]
    use = False
    if batch.retained is not None and first:
        starts = batch.retained.starts
        ends = [*starts[1:], len(batch)]
        rows = torch.cat(first)  # [m] host
        touched = {p for p in range(len(starts)) if ((rows >= starts[p]) & (rows < ends[p])).any()}
        covered = sum(ends[p] - starts[p] for p in touched)
        use = len(rows) >= options.retain_min_trained * covered
    first = accumulation if use else 0
    passes = [[(*mb, k < first) for k, mb in enumerate(micro_batches)]]
    passes += [[(*mb, False) for mb in micro_batches]] * (options.num_inner_epochs - 1)
    return passes, use


def retained_step(kept: RetainedPart | None, part: Rollout, i: int) -> StepOutput | None:
    """Window step i of a micro-batch's retained graphs (``kept``, its rows of ``Rollout.retained``; ``part`` the
    micro-batch) as the sampler's ``log_prob`` would return it, or None when the step was not retained (past
    ``max_retained_steps``: recomputed natively)."""
    if kept is None or i >= kept.log_prob.shape[1]:
        return None
    mean = None if kept.mean is None else kept.mean[:, i]
    return StepOutput(part.next_latents[:, i], mean, kept.std[:, i], kept.log_prob[:, i], kept.std_dev_t[:, i])
