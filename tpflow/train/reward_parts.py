"""Multi-reward advantages that normalise each reward on its own (``[reward] combine = "zscore_sum"``).

With several rewards, the reference sums their scores and normalises the sum within the group: a reward whose
scores spread widely decides the advantage's sign. Two of the rival methods' public code (docs/rewards.md names
them) normalise each reward within the group and sum the z-scores, A = Σ_m w_m · clip((R_m − mean_g) / (std_g +
eps)), so that every reward counts by its weight whatever its scale. Here each part's reward trace goes through the
run's credit assigner (its step rewards) and the optimizer's own ``advantages`` (its group statistics, eps and
clip), and the weighted advantages are added: the same path as a single reward's, once per part.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tpflow.interfaces import CreditAssigner, Optimizer, RewardModel, capability

if TYPE_CHECKING:
    from tpflow.train.scoring import ScoredBatch


def zscored_parts(reward: RewardModel) -> dict[str, float] | None:
    """The parts (detail key -> weight) whose advantages add up, when the reward asks for it (its ``zscored_parts``
    capability); None otherwise."""
    parts = capability(reward, "zscored_parts")
    return parts() if callable(parts) else None


def zscore_sum_advantages(
    parts: dict[str, float],
    credit: CreditAssigner,
    scored: Sequence[ScoredBatch],
    optimizer: Optimizer,
    groups: Sequence[Hashable],
    gather: Callable[[Tensor], Tensor],
) -> Tensor:
    """Σ_m weight_m · ``optimizer.advantages``(step rewards of part m): [N, W'] float64 over every process's rows.

    ``scored``: this process's rollout batches (their ``part_traces`` [n_b, W+1]), credited batch by batch as the
    combined trace is; ``gather``: every process's rows in process order (``Distributed.gather``)."""
    total: Tensor | None = None
    for key, weight in parts.items():
        local = torch.cat([credit(s.part_traces[key]).step_rewards for s in scored]).double().cpu()  # [n, W]
        advantages = optimizer.advantages(gather(local), groups)  # [N, W'] float64, the same on every process
        total = weight * advantages if total is None else total + weight * advantages
    assert total is not None, "a zscore_sum reward has at least one part"
    return total
