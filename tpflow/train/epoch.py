"""What passes between the stages of an epoch (docs/architecture.md, "An epoch").

    plan ─▶ sample + score ─▶ credit ─▶ gather ─▶ advantages ─▶ update ─▶ record
            Sampled             [Credit]   EpochRows   [N, W]

``Sampled`` is one process's rollout batches after scoring; ``EpochRows`` is every process's trajectories after the
gather, one row each in process order, which is what the advantages and the logs read. Each field is gathered on
its own, in its own dtype, so nothing is packed into one float tensor and sliced back by offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tpflow.distributed import Distributed
from tpflow.scoring.groups import group_key
from tpflow.train.prompt_sampler import RolloutBatch
from tpflow.train.scoring import ScoredBatch
from tpflow.types import Credit, PromptItem, Rollout


def prompt_groups(prompts: list[str], starts: list[int] | None = None) -> list[int]:
    """Group ids of N trajectories, in order of first appearance: equal texts (up to case and runs of whitespace,
    which the reference's CLIP-tokenizer round trip also folds) share an id (docs/algorithm.md §5).

    ``starts`` (with ``[rollout] same_noise``: each row's dataset item, whose copies share one z_0) splits a text's
    rows by their initial noise too. Two items with the same text start from different z_0, and a group that shares
    its start compares the copies of that start alone (one shared ODE prefix, or siblings of one ODE state); pooling
    two starts would mix them (docs/algorithm.md §5 item 9)."""
    keys = [group_key(p) for p in prompts]  # the key a group-relative reward groups its call's rows by too
    table: dict[object, int] = {}
    if starts is None:
        return [table.setdefault(k, len(table)) for k in keys]
    return [table.setdefault((k, s), len(table)) for k, s in zip(keys, starts, strict=True)]


@dataclass
class Sampled:
    """One process's epoch after sampling and scoring, batch by batch (the order of ``batches``)."""

    batches: list[RolloutBatch]  # this process's rollout batches
    rollouts: list[Rollout]  # [B] transitions for the update (completions dropped: they are scored already)
    scored: list[ScoredBatch]  # [B] reward traces [n_b, W+1] and details
    seconds: float  # sampling + scoring wall time
    wait_s: float = 0.0  # of which waiting for the scoring worker after the last rollout (not overlapped)

    @property
    def num_rows(self) -> int:
        return sum(len(b.items) for b in self.batches)

    def reward_details(self, dist: Distributed) -> dict[str, float]:
        """``reward_<name>``: the mean of each reward detail over the final images of every process (one
        collective; a detail some process lacks is averaged over those that have it)."""
        scored = self.scored
        details = {name: torch.cat([s.details[name] for s in scored]).double() for name in scored[0].details}
        local = {name: (float(values.sum()), values.numel()) for name, values in details.items()}
        merged = dist.gather_objects([local])  # whatever details each process has
        out = {}
        for name in sorted({name for part in merged for name in part}):
            total, count = (sum(x) for x in zip(*(part[name] for part in merged if name in part), strict=True))
            out[f"reward_{name}"] = total / count
        return out


@dataclass
class EpochRows:
    """Every trajectory of the epoch, over all processes, in process order (rank 0's rows first)."""

    trace: Tensor  # [N, W+1] float32 reward trace R_0..R_W (NaN where nothing was scored)
    step_rewards: Tensor  # [N, W] float64 credit of each window step
    turning: Tensor  # [N, W] bool turning points
    items: Tensor  # [N] int64 dataset item of each trajectory
    batches: Tensor  # [N] int64 rollout batch index within the epoch
    rows: Tensor  # [N] int64 row within its rollout batch

    @property
    def good_turning(self) -> Tensor:
        """[N, W] bool turning points of trajectories whose reward rose over the window (Δ > 0)."""
        return self.turning & (self.trace[:, -1] > self.trace[:, 0])[:, None]

    def metrics(self, turning_points: bool = True) -> dict[str, float]:
        """Reward statistics of the epoch's trajectories (every process), and their turning-point statistics when
        the credit marks turning points (``turning_points``; an outcome run's would be a meaningless 0)."""
        out = {"reward_mean": float(self.trace[:, -1].mean()), "reward_std": float(self.trace[:, -1].std())}
        if turning_points:
            good = self.good_turning
            out.update(
                turning_points_per_traj=float(self.turning.sum(1).float().mean()),
                good_turning_points=float(good.sum()),
                bad_turning_points=float((self.turning & ~good).sum()),
            )
        return out

    def records(self, items: list[PromptItem], groups: list[int], advantages: Tensor) -> list[dict]:
        """One traces.jsonl record per trajectory (``inspect-trajectory --run`` reads them); ``items`` is the
        training split the ``items`` column indexes."""
        good = self.good_turning
        keys = zip(self.items.tolist(), self.batches.tolist(), self.rows.tolist(), strict=True)
        return [
            {
                "prompt": items[item].prompt,
                "tag": items[item].metadata.get("tag"),
                "group": groups[k],
                "item": item,
                "batch": index,
                "row": row,
                "trace": self.trace[k].tolist(),
                "step_rewards": self.step_rewards[k].tolist(),
                "advantages": advantages[k].tolist(),
                "turning_points": self.turning[k].int().tolist(),
                "good_turning_points": good[k].int().tolist(),
            }
            for k, (item, index, row) in enumerate(keys)
        ]

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


STEP_COUNTS = ("optimizer_steps", "skipped_steps")  # every process takes, or skips, the same steps


def reduction(name: str) -> str:
    """How an update metric combines over processes, by the naming convention of ``Optimizer.update``'s metrics
    (no optimizer's names are known here): counts of rows (``*_trained``, ``nonfinite_losses``) are added; maxima
    (a name with ``max``, e.g. ``ratio_max_deviation``) and the shared step counts take the largest; anything else
    is a mean."""
    if name.endswith("_trained") or name == "nonfinite_losses":
        return "sum"
    if "max" in name.split("_") or name in STEP_COUNTS:
        return "max"
    return "mean"


def combine_update_metrics(per_process: list[dict[str, float]]) -> dict[str, float]:
    """The update metrics of every process as one dict: sums, maxima, or means over the processes that have them.

    A mean is weighted by each process's ``rows_trained`` when every process reports it (and they trained any): a
    process that trained fewer rows (its zero-advantage rows dropped, say) weighs less, so the mean is the one a
    single process training every row would report. Otherwise each process counts once."""
    names = sorted({name for metrics in per_process for name in metrics})
    combined = {}
    for name in names:
        have = [m for m in per_process if name in m]
        values = [m[name] for m in have]
        weights = [float(m.get("rows_trained", math.nan)) for m in have]
        if reduction(name) == "sum":
            combined[name] = float(sum(values))
        elif reduction(name) == "max":
            combined[name] = float(max(values))
        elif all(math.isfinite(w) for w in weights) and sum(weights) > 0:
            combined[name] = float(sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights))
        else:
            combined[name] = float(sum(values) / len(values))
    return combined
