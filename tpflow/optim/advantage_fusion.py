"""Cross-level advantage fusion (``[optimizer] advantage_fusion = "running-reward"``; docs/algorithm.md §10.10).

AdaGRPO (Bu et al., arXiv 2606.06828; code Bujiazi/GRPO-Series at d0ddaa4, ``compute_ema_adv`` and
``compute_loss`` in ``src/method_adagrpo.py``) adds to each image's group-relative advantage a *global* one, which
places its reward against the running mean μ and variance v of the rewards the policy's ODE samples reach (the
``ability-matched`` prompt policy's running values, ``tpflow.train.curriculum``). Per group and window step i, over
the group's rewards r:

    z = (r − μ) / (sqrt(max(v, 1e-8)) + 1e-8)
    z⁺ / Σ z⁺ and z⁻ / Σ |z⁻|        (the positive and negative parts normalised by their sums)
    z − mean(z)                      (instead, when either sum is below 1e-6: all on one side of μ)
    clamp(·, −clip, +clip)           (clip: the optimizer's adv_clip_max)

and the advantage is the group's own (``group_advantages``, clamped on its own) plus this. One departure: a group
whose rewards at step i are all equal gets exactly 0 (the code's z − mean(z) is 0 up to an ulp), as
``group_advantages`` zeroes constant groups, so the all-zero-trajectory filter still sees them.

Where μ and v come from, one way: the prompt policy owns a :class:`RunningReward` and writes it when it plans an
epoch (after its anchors are scored); the trainer hands that object to the optimizer once, at build
(``tpflow.train.prompt_policy.build_prompt_policy``), and the optimizer only reads it in ``advantages``. A checkpoint
holds μ and v in the policy's state; nothing of them is in the optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tpflow.optim.advantages import _constant_groups_zeroed, _group_ids

VAR_FLOOR = 1e-8  # the code's max(ema_var, 1e-8) before the square root
STD_EPS = 1e-8  # added to the std, as the code's (ema_std + 1e-8)
SUM_FLOOR = 1e-6  # below it a side's sum counts as empty (the code's sum_pos < 1e-6 or sum_neg < 1e-6)
# The credits whose step rewards are rewards of whole images, on the scale of the anchors' rewards: 'outcome' (every
# step the final reward) and 'branch' (each step its own child's completion, AdaGRPO's per-step groups).
IMAGE_REWARD_CREDITS = ("outcome", "branch")


@dataclass
class RunningReward:
    """The running mean and variance of the anchors' rewards; None before the first epoch's anchors."""

    mean: float | None = None
    var: float | None = None


def fused_advantages(step_rewards: Tensor, groups: Sequence[Hashable], running: RunningReward, clip: float) -> Tensor:
    """The global part [N, W] float64 (module docstring) of step rewards [N, W] in their prompt ``groups`` against
    ``running``'s μ and v, each group and column on its own."""
    if running.mean is None or running.var is None:
        raise RuntimeError("advantage_fusion reads the prompt policy's running reward, and none was set")
    rewards = step_rewards.detach().to(torch.float64)  # [N, W]
    if rewards.shape[0] == 0:
        return rewards.clone()
    ids = _group_ids(list(groups.tolist() if isinstance(groups, Tensor) else groups), rewards.device)  # [N]
    count, width = int(ids.max()) + 1, rewards.shape[1]
    z = (rewards - running.mean) / (math.sqrt(max(running.var, VAR_FLOOR)) + STD_EPS)  # [N, W]

    def per_group(values: Tensor) -> Tensor:  # [count, W] sums of ``values`` [N, W] over each group's rows
        return values.new_zeros(count, width).index_add_(0, ids, values)

    positive, negative = per_group(z.clamp_min(0)), per_group((-z).clamp_min(0))  # [count, W] Σ z⁺, Σ |z⁻|
    sizes = torch.bincount(ids, minlength=count).to(z.dtype)[:, None]  # [count, 1]
    centred = z - (per_group(z) / sizes)[ids]  # [N, W] z − mean(z) of the row's group
    one_sided = ((positive < SUM_FLOOR) | (negative < SUM_FLOOR))[ids]  # [N, W]
    scaled = torch.where(z > 0, z / positive[ids].clamp_min(SUM_FLOOR), z / negative[ids].clamp_min(SUM_FLOOR))
    fused = torch.where(one_sided, centred, scaled)
    return _constant_groups_zeroed(rewards, fused, ids, count).clamp(-clip, clip)  # a constant group: exactly 0


def with_fusion(own: Tensor, step_rewards: Tensor, groups: Sequence[Hashable], running: RunningReward, options: Any):
    """``own`` [N, W] float64, the group advantages, plus the global part when ``options.advantage_fusion`` is on
    (clamped on its own to ``options.adv_clip_max``; the sum is not clamped again, as in the code)."""
    if options.advantage_fusion == "none":
        return own
    return own + fused_advantages(step_rewards, groups, running, options.adv_clip_max)


def fusion_problems(options: Any, settings: dict[str, Any]) -> list[str]:
    """The sentences refusing ``advantage_fusion`` where it cannot be right (before anything loads): without the
    policy that keeps μ and v, with step rewards that are not image rewards, with rewards normalised part by part."""
    if options.advantage_fusion == "none":
        return []
    problems, option = [], f'[optimizer] advantage_fusion = "{options.advantage_fusion}"'
    policy = settings["train"].prompt_policy
    if policy != "ability-matched":
        problems.append(
            f"{option} places each reward against the running mean and variance of the rewards of the policy's ODE "
            f"samples, which only the prompt policy 'ability-matched' keeps (it scores them to choose the prompts), "
            f'and [train] prompt_policy is {policy!r}: set prompt_policy = "ability-matched" (AdaGRPO uses both) or '
            "drop advantage_fusion."
        )
    credit = settings.get("credit")
    if credit is not None and credit.name not in IMAGE_REWARD_CREDITS:
        problems.append(
            f"{option} compares step rewards with the running mean of image rewards, and credit {credit.name!r} gives "
            "each step a reward of another kind (a difference or a share of the final reward), on another scale: "
            'use [credit] name = "outcome" (every step the final reward) or "branch" (each step its child\'s).'
        )
    reward = settings.get("reward")
    if reward is not None and getattr(reward.options, "combine", None) == "zscore_sum":
        problems.append(
            f'{option} with [reward] combine = "zscore_sum": each part\'s advantages are computed apart and the '
            "running mean is of the combined reward, so no part's rewards could be compared with it. Use combine = "
            '"sum" or drop advantage_fusion.'
        )
    return problems
