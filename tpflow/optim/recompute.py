"""``[optimizer] recompute = "retain" | "reweight"`` on the update's side: what they require of a recipe, which
micro-batches take the rollout's retained graphs, and the on-policy gradient formed from reweight's buffers.

``recompute = "retain"`` (``tpflow.rollout.retain``) keeps the rollout's own forward graphs for the update's first,
on-policy optimizer step. That is exact only where the rollout's forward pass is the update's: the same weights (the
live adapter: GRPO samples with it), the same precision (both run in the trainer's autocast), the same guidance and
CFG gradient (the rollout's velocity call runs in the optimizer's ``cfg_gradient`` context), and every stored step
trained: the window plan, MixGRPO's window-schedule (with Euler or MixGRPO-Flash's DPM-Solver tail after the window)
and TempFlow-GRPO's branch (``samples_one_window``); reweight, whose gradients are per row, also takes a trained
subset of one window and per-row windows (``reweight_only``), which retain refuses here, before anything loads.

``recompute = "reweight"`` (``tpflow.rollout.reweight``) keeps, instead of graphs, each trajectory's gradient of its
log-probabilities, back-propagated by the rollout at advantage 1; the first optimizer step forms −Σ A·w·G from them
(:func:`reweighted_loss`) in place of any forward or backward. It differentiates the policy's log-probabilities
only: the KL term (β > 0) and GRPO-Guard's RatioNorm differentiate the transition mean against another model or
the stored one, which the buffers do not hold, so both are refused with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tpflow import registry
from tpflow.interfaces import capability
from tpflow.optim.loop import RowLoss
from tpflow.types import RetainedPart, RetainedSteps, ReweightedSteps, Rollout, StepOutput


def retain_problems(options: Any, settings: dict) -> list[str]:
    """One sentence per way the recipe cannot use its ``recompute`` and ``max_retained_steps`` options."""
    mode = options.recompute
    if mode == "native":
        if options.max_retained_steps is not None:
            return [
                f"[optimizer] max_retained_steps = {options.max_retained_steps} caps the steps that recompute = "
                '"retain" or "reweight" takes from the rollout, and recompute is "native". Drop it, or set recompute.'
            ]
        return []
    problems = []
    plan = settings.get("plan")
    name = getattr(plan, "name", "window")
    reweighted = plan is not None and capability(registry.get("plan", plan.name).factory, "reweight_only")
    if plan is not None and not _one_window(plan) and not (mode == "reweight" and reweighted):
        why = (
            "trains a part of its steps or a window per trajectory, which only per-trajectory gradients can take "
            'from the rollout. Use recompute = "reweight"'
            if reweighted
            else 'samples with an engine that runs no step with gradients. Use recompute = "native"'
        )
        problems.append(
            f'[optimizer] recompute = "{mode}" keeps whole steps of a one-window rollout, every step of it trained '
            f"(the window, window-schedule and branch plans), and [plan] name = {name!r} {why} with this plan "
            '(docs/training.md, "Recompute-free updates").'
        )
    if mode == "reweight" and (options.beta > 0 or options.ratio_norm):
        what = f"beta = {options.beta:g} (the KL to the reference)" if options.beta > 0 else "ratio_norm = true"
        problems.append(
            f'[optimizer] recompute = "reweight" keeps one gradient of the log-probabilities per trajectory, and '
            f"{what} differentiates the transition mean against another one, which those gradients do not hold. "
            'Use recompute = "retain" (it keeps the means), or beta = 0 and ratio_norm = false.'
        )
    backbone = settings.get("backbone")
    if mode == "reweight" and backbone is not None:
        problems += _per_row_problems(backbone)
    if mode == "reweight" and getattr(getattr(backbone, "options", None), "finetune", "lora") == "full":
        problems.append(
            '[optimizer] recompute = "reweight" takes per-trajectory gradients at the trainable linear layers, and '
            '[backbone] finetune = "full" trains every weight (norms, embeddings, biases too), whose per-row '
            'gradients it cannot form. Use recompute = "retain" or "native" for a full fine-tune.'
        )
    return problems


def _per_row_problems(backbone: Any) -> list[str]:
    """Why reweight's per-row gradients (``tpflow.rollout.per_row_grads``) cannot be taken from the recipe's
    ``[backbone]`` (its ComponentSpec): a model that folds frames into its layers' batch, or compiled blocks."""
    problems = []
    if not capability(registry.get("backbone", backbone.name).factory, "per_row_layers"):
        problems.append(
            f'[optimizer] recompute = "reweight" forms one gradient per trajectory from the rows of each trainable '
            f"linear layer's batch, and [backbone] name = {backbone.name!r} folds more than the trajectories into "
            f"that batch (its blocks run on frames × rows), so a frame's share would be credited to another "
            f'trajectory. Use recompute = "retain" or "native" with this backbone.'
        )
    if getattr(backbone.options, "compile_blocks", False):
        problems.append(
            '[optimizer] recompute = "reweight" records each trainable linear layer\'s input and output with forward '
            "hooks and differentiates the recorded outputs, and inside blocks compiled by [backbone] compile_blocks = "
            "true autograd returns no gradient for them (every per-trajectory gradient would be missing and the step "
            'zero). Use compile_blocks = false with reweight, or recompute = "retain" or "native".'
        )
    return problems


def _one_window(plan: Any) -> bool:
    """Whether the recipe's ``[plan]`` (its ComponentSpec) samples with the window engine (``samples_one_window``)."""
    says = capability(registry.get("plan", plan.name).factory, "samples_one_window")
    return bool(says(plan.options)) if callable(says) else False


def retained_passes(batch: Rollout, micro_batches: list[tuple[Tensor, Tensor]], options: Any,
                    advantages: Tensor) -> tuple[list, bool]:  # fmt: skip
    """The update's passes over ``micro_batches`` (device rows, host rows), each tagged with whether it takes the
    retained graphs (or gradients), and whether any does (``advantages`` [N, W] on the host).

    The first optimizer step's micro-batches are on policy and take them; every later step, and every later pass,
    recomputes natively at the moved weights. The retained backward runs over every row of the rollout batches the
    step touches, trained or not (a batched graph cannot be back-propagated for some rows only), so when the first
    step trains fewer than ``retain_min_trained`` of the rows of the rollout batches it touches (zero-advantage rows
    skipped, rows left to later steps), native is cheaper, and taken. Reweight's gradients are per row: always
    taken."""
    if isinstance(batch.retained, RetainedSteps) and batch.trained is not None:
        raise ValueError("retained graphs come from the one-window plan, whose rollouts train every stored step.")
    accumulation = options.gradient_accumulation_steps
    first = [host for _, host in micro_batches[:accumulation]]
    use = isinstance(batch.retained, ReweightedSteps) and bool(first)  # per-row gradients: any row can take its own
    if use and not batch.retained.per_step:  # one buffer per trajectory holds for one advantage per trajectory
        steps = advantages[:, : batch.retained.steps]  # [N, M] host
        if not torch.equal(steps, steps[:, :1].expand_as(steps)):
            raise ValueError("reweight kept one gradient per trajectory, and the advantages differ by step: the "
                             "credit assigner declares same_reward_every_step wrongly.")  # fmt: skip
    takes = [use] * len(first)  # per first-step micro-batch: whether it takes the kept graphs or gradients
    if isinstance(batch.retained, RetainedSteps) and first:
        takes, use = _retained_graphs_taken(batch, first, options.retain_min_trained)
    passes = [[(*mb, k < len(takes) and takes[k]) for k, mb in enumerate(micro_batches)]]
    passes += [[(*mb, False) for mb in micro_batches]] * (options.num_inner_epochs - 1)
    return passes, use


def _retained_graphs_taken(batch: Rollout, first: list[Tensor], min_trained: float) -> tuple[list[bool], bool]:
    """Which of the first step's micro-batches (``first``, host rows each) back-propagate the retained graphs, and
    whether any does.

    A micro-batch with a row past the kept rollout batches (``Retain.rows``: the zero-advantage filter moved the
    step's rows on) recomputes natively. The graphs of a rollout batch are one batched forward, so a backward through
    them runs every row of it: when one of its rows is not finite (a NaN latent, an overflowed activation), 0·NaN
    reaches every weight's gradient, where native drops only the non-finite micro-batch's losses; and when the step
    trains fewer than ``min_trained`` of the rows of the batches it touches, native is cheaper. Either way the whole
    step recomputes natively (one host read for the finiteness)."""
    kept: RetainedSteps = batch.retained
    takes = [bool((rows < kept.end).all()) for rows in first]
    rows = torch.cat(
        [r for r, t in zip(first, takes, strict=True) if t] or [torch.zeros(0, dtype=torch.long, device="cpu")]
    )
    ends = [*kept.starts[1:], kept.end]
    touched = [p for p in range(len(kept.starts)) if ((rows >= kept.starts[p]) & (rows < ends[p])).any()]
    covered = sum(ends[p] - kept.starts[p] for p in touched)
    if not touched or len(rows) < min_trained * covered:
        return [False] * len(first), False
    spans = [slice(kept.starts[p], ends[p]) for p in touched]
    values = [kept.parts[p].log_prob.detach() for p in touched]
    values += [t[span] for span in spans for t in (batch.latents, batch.next_latents, batch.log_probs)]
    finite = torch.stack([torch.isfinite(v).all() for v in values]).all()
    if not bool(finite):  # the one host read
        return [False] * len(first), False
    return takes, True


def retained_step(kept: RetainedPart | None, part: Rollout, i: int) -> StepOutput | None:
    """Window step i of a micro-batch's retained graphs (``kept``, its rows of ``Rollout.retained``; ``part`` the
    micro-batch) as the sampler's ``log_prob`` would return it, or None when the step was not retained (past
    ``max_retained_steps``: recomputed natively)."""
    if kept is None or i >= kept.log_prob.shape[1]:
        return None
    mean = None if kept.mean is None else kept.mean[:, i]
    return StepOutput(part.next_latents[:, i], mean, kept.std[:, i], kept.log_prob[:, i], kept.std_dev_t[:, i])


def reweighted_loss(kept: ReweightedSteps, adv: Tensor, weight: Tensor | None, old_log_probs: Tensor,
                    scale: float) -> RowLoss:  # fmt: skip
    """The first optimizer step's gradient for one micro-batch's first M steps, from reweight's buffers: at ratio 1
    the clipped surrogate's gradient is −A·w·∇ℓ_θ per live (trajectory, step), so it is −Σ A·w·G.

    Args:
        kept: the micro-batch's rows of ``Rollout.retained`` (buffers [m, ...] or [m, M, ...]).
        adv: [m, W] its advantages; ``weight`` [m, W] the step weights (None: 1); ``old_log_probs`` [m, W] the stored
            ones (their finiteness stands for the rows', as a native loss's does).
        scale: the loss scale ``Precision.backward`` applies now (the buffers were formed at ``kept.scale``).
    """
    steps, live = kept.steps, kept.live  # M, [m, M] bool
    coef = -adv[:, :steps] if weight is None else -adv[:, :steps] * weight[:, :steps]  # [m, M]
    coef = torch.where(live, coef, 0.0)
    factor = scale / kept.scale
    if kept.per_step:
        grads = [torch.einsum("mt,mt...->...", coef, g) * factor for g in kept.grads]
    else:  # every step's advantage and weight alike (Reweight.for_credit): G already sums the live steps
        grads = [torch.einsum("m,m...->...", -adv[:, 0], g) * factor for g in kept.grads]
    zero = torch.zeros((), device=coef.device)
    finite = torch.where(live, old_log_probs[:, :steps], 0.0).sum() * 0  # NaN/inf in a stored log-prob shows
    sums = {"loss": coef.sum(), "policy_loss": coef.sum(), "kl": zero, "approx_kl": zero, "clip_fraction": zero,
            "ratio_mean": live.sum().float()}  # fmt: skip
    return RowLoss(coef.sum() + finite, live.sum().float(), sums, {"ratio_max_deviation": zero}, grads=grads)
