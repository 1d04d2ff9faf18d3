"""The distributed prompt sampler: which prompts an epoch samples, in which rollout batches, on which process.

docs/algorithm.md §6.3 (the reference's ``DistributedKRepeatSampler``): a sampling round draws m prompts, repeats each
G times, shuffles the copies and cuts them into rollout batches of B; the copies of one prompt may land in different
batches and on different processes, and advantages are computed only after every process's rewards are gathered
(``tpflow.distributed``), so groups stay whole.

tpflow plans the epoch as a list of *global* rollout batches that does not depend on the number of processes P:

* round r of epoch e draws ``prompts_per_round`` prompts (distinct when the split has enough) from a generator seeded
  by (seed, e, r); every process computes the same plan, nothing is communicated;
* global batch j goes to process ``j mod P`` (so a round of P·B trajectories is one batch per process, exactly the
  reference's split when ``prompts_per_round · G = P · B``);
* batch j carries its own seed for its window draw and its noise.

So a run on 1 process and a run on 8 sample the very same trajectories from the same weights, and a checkpoint
resumes on any P that divides the number of batches. ``prompts_per_round = None`` makes the whole epoch one round
(``prompts_per_epoch`` distinct prompts, all copies shuffled together).

Which prompts a round may draw is the sampler's policy (``train.prompt_policy``, ``tpflow.train.prompt_policy``): it
hands ``plan_epoch`` the items set aside for the epoch; a round draws the others, and draws set-aside ones back only
when the others are too few (the floor: every round still has its ``prompts_per_round`` prompts, so the epoch's
batches and their split over the processes never change). With nothing set aside the draw is the uniform one, bitwise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.settings import TrainSettings
from tpflow.types import BatchLayout


@dataclass(frozen=True)
class RolloutBatch:
    """One global rollout batch of an epoch."""

    index: int  # j, position in the epoch (0-based, over all processes)
    items: tuple[int, ...]  # [B] dataset item index of each trajectory (groups are formed by prompt text)
    seed: int  # seeds this batch's window draw and noise (independent of the process that runs it)


@dataclass(frozen=True)
class EpochPlan:
    """All rollout batches of one epoch, in global order."""

    epoch: int
    batches: tuple[RolloutBatch, ...]
    refilled: int = 0  # draws of set-aside items that filled rounds the other items could not (the policy's floor)

    def local(self, rank: int, world_size: int) -> tuple[RolloutBatch, ...]:
        """The batches process ``rank`` of ``world_size`` samples: j ≡ rank (mod world_size)."""
        return self.batches[rank::world_size]

    @property
    def num_trajectories(self) -> int:
        return sum(len(b.items) for b in self.batches)

    def epoch_rows(self, batch: RolloutBatch) -> Tensor:
        """[len(batch.items)] long on the CPU: the rows of ``batch`` (one of ``batches``) in the epoch's global
        order, which no process count changes (``Rollout.epoch_rows``)."""
        first = sum(len(b.items) for b in self.batches[: batch.index])
        return torch.arange(first, first + len(batch.items), dtype=torch.long, device="cpu")


def plan_epoch(
    num_items: int,
    train: TrainSettings,
    epoch: int,
    aside: frozenset[int] = frozenset(),
    chosen: Sequence[Sequence[int]] | None = None,
) -> EpochPlan:
    """The epoch's rollout batches for a training split of ``num_items`` prompts (see the module docstring);
    ``aside``: the items the prompt policy sets aside for this epoch; ``chosen``: the items of each round when the
    policy chose them itself (``tpflow.train.curriculum``), shuffled and batched as a drawn round is."""
    if num_items < 1:
        raise UserError("The training split is empty: the dataset has no prompts to sample.")
    per_round = train.prompts_per_round or train.prompts_per_epoch
    batches: list[RolloutBatch] = []
    refilled = 0
    for r in range(train.prompts_per_epoch // per_round):
        rng = random.Random(f"{train.seed}/{epoch}/round/{r}")
        if chosen is not None:  # the policy's choice: only shuffled and batched here
            drawn = list(chosen[r])
        else:
            drawn = _draw_around(num_items, per_round, rng, aside) if aside else _draw(num_items, per_round, rng)
        refilled += sum(item in aside for item in drawn)
        copies = [item for item in drawn for _ in range(train.group_size)]
        rng.shuffle(copies)
        for lo in range(0, len(copies), train.rollout_batch):
            j = len(batches)
            seed = random.Random(f"{train.seed}/{epoch}/batch/{j}").getrandbits(63)
            batches.append(RolloutBatch(j, tuple(copies[lo : lo + train.rollout_batch]), seed))
    return EpochPlan(epoch, tuple(batches), refilled)


def check_layout(train: TrainSettings, world_size: int) -> None:
    """Raise a UserError unless ``world_size`` processes can share every epoch equally (full, equal batches)."""
    if world_size == 1:
        return
    per_round = train.prompts_per_round or train.prompts_per_epoch
    trajectories = per_round * train.group_size
    full = trajectories % train.rollout_batch == 0
    batches = train.prompts_per_epoch * train.group_size // train.rollout_batch
    if not full or batches % world_size:
        divisors = [p for p in range(1, batches + 1) if batches % p == 0] if full else []
        raise UserError(
            f"{world_size} processes cannot share the epoch equally: an epoch has "
            f"{train.prompts_per_epoch} prompts x {train.group_size} copies = "
            f"{train.prompts_per_epoch * train.group_size} trajectories in rollout batches of "
            f"{train.rollout_batch}, so every round must split into whole batches and the number of batches "
            f"({batches if full else 'not whole'}) must be a multiple of the process count. "
            + (f"Process counts that work: {divisors}. " if divisors else "")
            + "Change train.prompts_per_epoch, train.prompts_per_round or train.rollout_batch "
            "(docs/distributed.md, 'How the recipe's batch sizes map to GPUs')."
        )
    anchors = train.prompts_per_epoch * train.prompt_candidates  # the ability-matched policy's ODE samples an epoch
    if train.shard == "fsdp" and train.prompt_policy == "ability-matched" and anchors % world_size:
        raise UserError(
            f'[train] shard = "fsdp" with prompt_policy = "ability-matched": an epoch samples {anchors} anchors '
            f"(prompts_per_epoch {train.prompts_per_epoch} × prompt_candidates {train.prompt_candidates}), which "
            f"{world_size} processes cannot share equally, and a sharded model needs every process to run as many "
            f"forward passes. Choose prompt_candidates so that the anchors are a multiple of {world_size}."
        )


def noise_seed(train: TrainSettings, epoch: int, item: int) -> int:
    """Seed of the initial noise shared by every copy of ``item`` in ``epoch`` (``rollout.same_noise``)."""
    return random.Random(f"{train.seed}/{epoch}/z0/{item}").getrandbits(63)


def _draw(num_items: int, k: int, rng: random.Random) -> list[int]:
    """k distinct item indices when the split has that many, else k draws with repetition."""
    return rng.sample(range(num_items), k) if k <= num_items else rng.choices(range(num_items), k=k)


def _draw_around(num_items: int, k: int, rng: random.Random, aside: frozenset[int]) -> list[int]:
    """k distinct items, none set aside when enough others remain; else every other item and set-aside ones drawn
    back to fill the round (the floor); a split smaller than a round draws with repetition from all, as ``_draw``."""
    others = [i for i in range(num_items) if i not in aside]
    if k <= len(others):
        return rng.sample(others, k)
    if k <= num_items:
        back = sorted(i for i in aside if i < num_items)
        return others + rng.sample(back, k - len(others))
    return rng.choices(range(num_items), k=k)


def layout_line(plan: EpochPlan, layout: BatchLayout | None, processes: int, replayed: int = 0) -> str:
    """How an epoch is shared, printed when a run starts on several processes: batches, trajectories and optimizer
    steps per process (``layout``: the optimizer's ``batch_layout()``, None when it has no micro-batches;
    ``replayed``: the trajectories the update appends from the replay buffer, over every process)."""
    mine = plan.local(0, processes)
    n = sum(len(b.items) for b in mine)
    line = (
        f"{processes} processes: each samples {len(mine)} of the epoch's {len(plan.batches)} rollout batches "
        f"({n} of {plan.num_trajectories} trajectories)"
    )
    if replayed:
        share = -(-replayed // processes)  # the largest share: k/P rounded up (tpflow.train.replay deals them)
        line += f" and its update replays up to {share} of the buffer's {replayed} drawn"
        n += share
    if layout is not None:
        micro, accumulation = layout.micro_batch_size, layout.accumulation
        steps = math.ceil(math.ceil(n / micro) / accumulation)
        line += (
            f"; up to {steps} optimizer steps per epoch, each averaging {micro * accumulation * processes} "
            f"trajectories ({micro} x {accumulation} accumulation x {processes} processes)"
        )
    return line
