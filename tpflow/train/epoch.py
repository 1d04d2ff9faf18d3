"""What passes between the stages of an epoch (docs/architecture.md, "An epoch").

    plan ─▶ sample + score ─▶ credit ─▶ gather ─▶ advantages ─▶ update ─▶ record
            Sampled             [Credit]   EpochRows   [N, W]

``Sampled`` is one process's rollout batches after scoring; ``EpochRows`` is every process's trajectories after the
gather, one row each in process order, which is what the advantages and the logs read. Each field is gathered on
its own, in its own dtype, so nothing is packed into one float tensor and sliced back by offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tpflow.distributed import Distributed
from tpflow.train.prompt_sampler import RolloutBatch
from tpflow.train.scoring import ScoredBatch
from tpflow.types import Credit, Rollout


@dataclass
class Sampled:
    """One process's epoch after sampling and scoring, batch by batch (the order of ``batches``)."""

    batches: list[RolloutBatch]  # this process's rollout batches
    rollouts: list[Rollout]  # [B] transitions for the update (completions dropped: they are scored already)
    scored: list[ScoredBatch]  # [B] reward traces [n_b, W+1] and details
    seconds: float  # sampling + scoring wall time

    @property
    def num_rows(self) -> int:
        return sum(len(b.items) for b in self.batches)


@dataclass
class EpochRows:
    """Every trajectory of the epoch, over all processes, in process order (rank 0's rows first)."""

    trace: Tensor  # [N, W+1] float32 reward trace R_0..R_W (NaN where nothing was scored)
    step_rewards: Tensor  # [N, W] float64 credit of each window step
    turning: Tensor  # [N, W] bool turning points
    items: Tensor  # [N] int64 dataset item of each trajectory
    batches: Tensor  # [N] int64 rollout batch index within the epoch
    rows: Tensor  # [N] int64 row within its rollout batch

    @classmethod
    def local(cls, sampled: Sampled, credits: list[Credit]) -> EpochRows:
        """This process's rows, before the gather."""
        keys = [(i, b.index, k) for b in sampled.batches for k, i in enumerate(b.items)]
        key = torch.tensor(keys, dtype=torch.int64, device="cpu").reshape(-1, 3)  # [n, 3] host bookkeeping
        return cls(
            trace=torch.cat([s.trace for s in sampled.scored]).float(),
            step_rewards=torch.cat([c.step_rewards for c in credits]).double().cpu(),
            turning=torch.cat([c.turning_points for c in credits]).bool().cpu(),
            items=key[:, 0],
            batches=key[:, 1],
            rows=key[:, 2],
        )

    def gather(self, dist: Distributed) -> EpochRows:
        """Every process's rows, field by field (bool travels as uint8, which every backend carries)."""
        return EpochRows(
            trace=dist.gather(self.trace),
            step_rewards=dist.gather(self.step_rewards),
            turning=dist.gather(self.turning.to(torch.uint8)).bool(),
            items=dist.gather(self.items),
            batches=dist.gather(self.batches),
            rows=dist.gather(self.rows),
        )
