"""The advantages of the probe's reference gradient: REINFORCE with a leave-one-out baseline per prompt.

For the trajectories of one prompt with final rewards R_1..R_G, A_n = R_n − (1/(G−1))·Σ_{m≠n} R_m. The baseline
does not depend on trajectory n's own sample, so Σ_n A_n ∇log π(τ_n) is an unbiased estimate of G·∇E[R] for the
score-function part of the gradient that every GRPO-family credit method estimates: no std normalisation (which
changes the objective) and no clipping. Given at every window step (the trajectory's score is the sum over its SDE
steps), ``tpflow.probe.gradient.first_step_gradient`` turns them into the reference gradient through the GRPO loss
code: on policy, −(1/rows)·Σ A ∇log π, a fixed positive scale of the estimate, which cosines do not see.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def leave_one_out_advantages(final_rewards: Tensor, groups: Sequence[Hashable], width: int) -> Tensor:
    """[N, width] float64: each trajectory's A_n (module docstring) repeated over the ``width`` window steps.

    Raises:
        ValueError: for a prompt with a single trajectory (it has no baseline from the others).
    """
    rewards = final_rewards.detach().double().cpu().reshape(-1)  # [N]
    if len(groups) != rewards.shape[0]:
        raise ValueError(f"{len(groups)} group keys for {rewards.shape[0]} rewards.")
    keys = {key: k for k, key in enumerate(dict.fromkeys(groups))}
    index = torch.tensor([keys[g] for g in groups], device="cpu")  # [N] group of each row
    totals = torch.zeros(len(keys), dtype=torch.float64, device="cpu").index_add_(0, index, rewards)
    counts = torch.bincount(index, minlength=len(keys)).double()
    if bool((counts < 2).any()):
        raise ValueError("a leave-one-out baseline needs at least 2 trajectories per prompt.")
    others = (totals[index] - rewards) / (counts[index] - 1)  # [N] mean of the prompt's other rewards
    return (rewards - others)[:, None].expand(-1, width).clone()
