"""Group-normalised advantages per prompt and per window step, and the all-zero-trajectory filter.

docs/algorithm.md §5 is the specification; §8 D6 the decision. Each column i of the step rewards [N, W] is
normalised on its own (the reference keeps one ``PerPromptStatTracker`` per window position):

    A[n, i] = clamp((r[n, i] − mean_{p(n), i}) / (std_{p(n), i} + eps), −clip, +clip)

where p(n) is the prompt of trajectory n, the mean is over that prompt's samples and the std is their population
std (ddof = 0; ``correction = 1``: the sample std, DanceGRPO's), or, with ``global_std``, the std of column i over
all N samples. Everything is float64.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def group_advantages(
    step_rewards: Tensor,
    groups: Sequence[Hashable],
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
    correction: int = 0,
    divide: bool = True,
) -> Tensor:
    """Per-prompt, per-step z-scores of the step rewards (docs/algorithm.md §5 items 2-4 and 7).

    Special cases:

    * **Every group a singleton** (one image per prompt): per-prompt statistics are meaningless (each sample would be
      its own mean, so every advantage would be 0). As in the reference (``num_image_per_prompt == 1`` turns the
      per-prompt tracker off), the fallback is a global z-score per column, ``(r − mean_i) / (std_i + eps)``, with
      mean and population std over all N samples. Batches that mix singletons and larger groups are normalised
      per prompt; their singletons get advantage 0.
    * **Constant groups** (every sample of the prompt has the same reward at step i, std 0): the advantage is
      **exactly** 0. The reference gets 0 only up to rounding (its mean can differ from the values by an ulp, and
      the ulp is divided by ``eps``); tpflow zeroes the numerator so the all-zero-trajectory filter
      (:func:`informative_trajectories`) sees them. This also keeps ``eps = 0`` free of 0/0.

    Args:
        step_rewards: [N, W] per-step rewards (any real dtype; cast to float64).
        groups: N prompt keys (anything hashable, e.g. the prompt strings); equal keys form a group. The order of
            the rows does not matter: groups need not be contiguous.
        global_std: divide by the std of the whole column instead of the prompt's std; the mean stays per prompt.
        eps: added to the std (the reference's 1e-4); must be ≥ 0.
        clip: advantages are clamped to ±clip (the reference's ``adv_clip_max`` = 5); must be > 0.
        correction: the std's ddof: 0 the population std (Flow-GRPO, TP-GRPO), 1 the sample std (DanceGRPO's
            ``torch.std``); a group of one keeps advantage 0 either way.
        divide: False returns the centred rewards, clipped, divided by nothing (GARDO's, docs/algorithm.md §10.9).

    Returns:
        [N, W] float64 advantages on the device of ``step_rewards``.

    Raises:
        ValueError: ``step_rewards`` is not 2-D or holds NaN/inf, ``groups`` has the wrong length, or ``eps`` /
            ``clip`` are out of range.
    """
    rewards, groups, eps, clip = _checked(step_rewards, groups, eps, clip, correction)  # rewards: [N, W] float64
    n = rewards.shape[0]
    if n == 0:
        return rewards.clone()

    ids, num_groups = _prompt_groups(groups, rewards.device)
    centred = _constant_groups_zeroed(rewards, rewards - _group_mean(rewards, ids, num_groups)[ids], ids, num_groups)
    if not divide:
        return centred.clamp(-clip, clip)
    std = _std(rewards, centred, ids, num_groups, global_std, correction)  # [N, W] or [1, W]
    denominator = std + eps
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    advantages = torch.where(denominator > 0, centred / safe, torch.zeros_like(centred))
    return advantages.clamp(-clip, clip)


def _checked(
    step_rewards: Tensor, groups: Sequence[Hashable], eps: float, clip: float, correction: int
) -> tuple[Tensor, Sequence[Hashable], float, float]:
    """``group_advantages``' arguments checked (a ValueError naming the mistake, before any arithmetic), as
    (rewards [N, W] float64 detached, groups (a tensor's as a list), eps, clip as floats). Non-finite rewards are
    refused rather than normalised: one NaN would spread through its group's mean to every advantage of the
    prompt."""
    if step_rewards.dim() != 2:
        raise ValueError(
            f"step_rewards must be 2-D [N, W] (trajectories × window steps), got shape {tuple(step_rewards.shape)}; "
            "for a single step pass rewards[:, None]."
        )
    if isinstance(groups, Tensor):  # a tensor's elements hash by identity, which would make every group a singleton
        groups = groups.tolist()
    n = step_rewards.shape[0]
    if len(groups) != n:
        raise ValueError(f"groups must hold one prompt key per trajectory: got {len(groups)} keys for N = {n} rows.")
    eps, clip = float(eps), float(clip)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number ≥ 0 (the reference uses 1e-4), got {eps!r}.")
    if correction not in (0, 1):
        raise ValueError(f"correction must be 0 (population std) or 1 (sample std), got {correction!r}.")
    if not clip > 0:
        raise ValueError(f"clip must be > 0 (the reference uses 5.0; use math.inf to disable clipping), got {clip!r}.")

    rewards = step_rewards.detach().to(torch.float64)
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(
            f"step_rewards must be finite; found {rewards[bad[0], bad[1]].item()} at row {bad[0]}, step {bad[1]}. "
            "Check the reward model's scores and the credit assigner."
        )
    return rewards, groups, eps, clip


def _prompt_groups(groups: Sequence[Hashable], device: torch.device) -> tuple[Tensor, int]:
    """[N] group ids and the number of groups; every prompt once (all singletons) makes one global group, since
    per-prompt statistics would then make every advantage 0 (the reference turns its tracker off there too)."""
    ids = _group_ids(groups, device)
    num_groups = int(ids.max().item()) + 1
    if num_groups == len(groups):  # every prompt once: per-prompt statistics are meaningless, use one global group
        ids = torch.zeros_like(ids)
        num_groups = 1
    return ids, num_groups


def _constant_groups_zeroed(rewards: Tensor, centred: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """``centred`` [N, W] with exactly 0 where the row's group is constant at that step, whatever the rounding of the
    mean: the all-zero-trajectory filter must see those rows as 0, and ``eps = 0`` must not divide 0 by 0."""
    width = rewards.shape[1]
    index = ids[:, None].expand(rewards.shape[0], width)
    high = rewards.new_full((num_groups, width), -math.inf).scatter_reduce(0, index, rewards, "amax")
    low = rewards.new_full((num_groups, width), math.inf).scatter_reduce(0, index, rewards, "amin")
    return torch.where((high == low)[ids], torch.zeros_like(centred), centred)


def _std(rewards: Tensor, centred: Tensor, ids: Tensor, num_groups: int, global_std: bool, correction: int) -> Tensor:
    """The std each advantage is divided by (ddof ``correction``): the column's over all N rows with ``global_std``
    ([1, W]; 0 when N ≤ ``correction``), else the row's prompt's ([N, W], from the zeroed ``centred``; a group of
    one with ``correction = 1`` divides by 1, its centred values being 0)."""
    n, width = rewards.shape
    if global_std:
        return rewards.std(dim=0, correction=correction)[None, :] if n > correction else rewards.new_zeros(1, width)
    sums = rewards.new_zeros((num_groups, width)).index_add_(0, ids, centred.square())
    counts = torch.bincount(ids, minlength=num_groups).to(rewards.dtype)
    return (sums / (counts - correction).clamp_min(1)[:, None]).sqrt()[ids]  # [N, W], the prompt's std


def informative_trajectories(advantages: Tensor) -> Tensor:
    """Which trajectories carry a training signal: True where any advantage is non-zero (docs/algorithm.md §5 item 6).

    A trajectory whose advantage is 0 at every window step contributes nothing to the clipped surrogate but still
    costs its forward and backward passes, so the update skips it (``GRPOOptions.filter_zero_advantage``,
    docs/algorithm.md §8 D6). The reference then re-adds randomly chosen dropped trajectories until the count divides
    ``num_batches_per_epoch`` (its micro-batches must have equal sizes). tpflow does not: its micro-batches may be
    ragged, so the kept set is exactly the informative one.

    Args:
        advantages: [N, W] advantages.

    Returns:
        [N] bool mask of the trajectories to train on.
    """
    if advantages.dim() != 2:
        raise ValueError(f"advantages must be 2-D [N, W], got shape {tuple(advantages.shape)}.")
    return (advantages != 0).any(dim=1)


def _group_ids(groups: Sequence[Hashable], device: torch.device) -> Tensor:
    """[N] int64 ids, one per distinct key in order of first appearance."""
    table: dict[Hashable, int] = {}
    ids = [table.setdefault(key, len(table)) for key in groups]
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _group_mean(values: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """[num_groups, W] mean of the rows of ``values`` [N, W] in each group."""
    sums = values.new_zeros((num_groups, values.shape[1])).index_add_(0, ids, values)
    counts = torch.bincount(ids, minlength=num_groups).to(values.dtype)
    return sums / counts[:, None]
