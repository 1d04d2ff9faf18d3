"""Stage 2 of an epoch: roll out each local batch and score it in the background (docs/architecture.md, "An epoch").

Apart from the trainer because it is the part of an epoch with the most moving pieces (the text encoding of the
epoch's prompts, the SDE window and noise of each batch, the optimizer's sampling policy, the completions the credit
assigner reads, the overlap of sampling with decoding and scoring) and none of its bookkeeping (checkpoints, logs,
the run lock). Randomness comes from each batch's seed only, so what it samples does not depend on the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from tpflow.devices import cpu_generator
from tpflow.interfaces import Backbone, CreditAssigner, Optimizer, RewardModel, RolloutPlan, Sampler, capability
from tpflow.plans import WindowPlan
from tpflow.precision import Precision
from tpflow.rollout import rollout_from_settings
from tpflow.rollout.retain import Retain
from tpflow.rollout.reweight import Reweight
from tpflow.scoring.call import recipe_policy
from tpflow.settings import RolloutSettings, TrainSettings
from tpflow.sources import encode_unique, group_text
from tpflow.train.epoch import Sampled
from tpflow.train.lockstep import Lockstep
from tpflow.train.prompt_sampler import EpochPlan, RolloutBatch, noise_seed
from tpflow.train.scoring import ScoredBatch, ScoringWorker
from tpflow.types import PromptItem, Rollout

Phase = Callable[[str, "int | None"], None]  # the progress bar: a stage's description and its number of steps


@dataclass(kw_only=True)
class EpochSampler:
    """What sampling an epoch needs, built once per run by the trainer (``tpflow.train.components``), by name."""

    backbone: Backbone
    sampler: Sampler
    reward: RewardModel
    optimizer: Optimizer
    credit: CreditAssigner
    precision: Precision  # the autocast region of each rollout batch
    items: list[PromptItem]  # the training split, indexed by the epoch plan
    train: TrainSettings
    rollout: RolloutSettings
    plan: RolloutPlan = dataclasses.field(default_factory=WindowPlan)  # each batch's windows and trained steps
    lockstep: Lockstep | None = None  # a sharded run's: each batch's forwards padded to every process's count

    def __call__(
        self, plan: EpochPlan, batches: Sequence[RolloutBatch], phase: Phase, advance: Callable[[], None]
    ) -> Sampled:
        """Roll out each local batch of the epoch's ``plan`` (its windows and noise from its seed) and score it in the
        background worker. The text encoders run once, on every distinct prompt of the whole plan (all processes
        alike, so the embeddings do not depend on the number of processes); each rollout batch indexes its rows."""
        train, rollout, epoch = self.train, self.rollout, plan.epoch
        start = time.perf_counter()
        phase(f"epoch {epoch}: sampling", len(batches))  # the text encoding below is part of it
        z0_seeds = {i: noise_seed(train, epoch, i) for b in batches for i in b.items} if rollout.same_noise else None
        keep = self._kept()
        # every distinct (instruction, sources) pair of the plan, encoded once (tpflow.sources)
        encoded, text_row = encode_unique(self.backbone, [self.items[i] for b in plan.batches for i in b.items])
        worker = ScoringWorker(self.backbone.decode, self.reward, chunk=train.score_batch, policy=recipe_policy(train))
        rollouts, jobs, first_row = [], [], 0
        try:
            for b in batches:
                items = [self.items[i] for i in b.items]
                # the plan: each trajectory's SDE window and the steps the update trains, from the batch's seed
                window = self.plan.plan(rollout, len(items), epoch, b.seed, train.seed)
                generator = cpu_generator(b.seed)  # noise drawn on the CPU, moved to the model (tpflow.devices)
                cond = encoded.index([text_row[group_text(it)] for it in items])
                # sampling_policy: the weights that collect the data (GRPO: the live adapter; NFT: its old policy)
                # (the swap happens outside the autocast region: tpflow.precision)
                padded = self.lockstep.batch() if self.lockstep is not None else contextlib.nullcontext()
                with self.optimizer.sampling_policy(), self.precision.autocast(), padded:
                    out = rollout_from_settings(
                        self.backbone,
                        self.sampler,
                        cond,
                        list(b.items),
                        window,
                        rollout,
                        completions=keep.completions,
                        generator=generator,
                        group_seeds=z0_seeds,
                        transitions=keep.transitions,
                        store_means=keep.store_means,
                        retain=None if keep.retain is None else keep.retain.for_batch(first_row),
                    )
                first_row += len(items)
                prompts, metadata = [i.prompt for i in items], [i.metadata for i in items]
                # traces [n, W + 1] of the plan's W (a truncated window holds fewer than [rollout] window_size)
                jobs.append(worker.submit(out.final, out.completions, prompts, metadata, window.size))
                # scored already (the update needs no completions); its rows in the epoch key the update's draws
                rollouts.append(dataclasses.replace(out, completions=None, epoch_rows=plan.epoch_rows(b)))
                advance()
            scored, wait_s = _collect(jobs, epoch, phase, advance)
            if capability(self.optimizer, "reads_reward_details"):  # the final samples' reward parts, per row
                rollouts = [_with_details(r, s) for r, s in zip(rollouts, scored, strict=True)]
        finally:
            worker.close()
        return Sampled(list(batches), rollouts, scored, time.perf_counter() - start, wait_s)

    def _kept(self) -> Kept:
        """What the rollouts keep: what the optimizer consumes (``Optimizer.consumes``), and completions only when
        the credit assigner reads them; final samples need neither stored transitions nor completions."""
        transitions = self.optimizer.consumes == "transitions"
        completions = self.rollout.completions if self.credit.needs_completions and transitions else None
        store_means = transitions and capability(self.optimizer, "needs_old_means")  # e.g. GRPO's RatioNorm
        retain = capability(self.optimizer, "retain") if transitions else None  # a recompute-free update's graphs
        if retain is not None:  # per-trajectory gradients suffice where every step of a trajectory gets one reward
            retain = retain.for_credit(capability(self.credit, "same_reward_every_step"))
        return Kept(transitions, completions, bool(store_means), retain)


@dataclass(frozen=True)
class Kept:
    """What each rollout of an epoch keeps for the update and the credit assigner (nothing else is stored)."""

    transitions: bool  # the SDE window's steps and old log-probs (an optimizer that consumes transitions)
    completions: Literal["ode", "x0"] | None  # the ODE completions the credit assigner reads, or none
    store_means: bool  # each step's transition mean (RatioNorm)
    retain: Retain | Reweight | None  # the graphs or gradients a recompute-free update reuses (per batch: for_batch)


def _with_details(rollout: Rollout, scored: ScoredBatch) -> Rollout:
    """``rollout`` with its final samples' reward details (``Rollout.reward_details``: [n] float32 on the CPU)."""
    return dataclasses.replace(rollout, reward_details={k: v.float().cpu() for k, v in scored.details.items()})


def _collect(
    jobs: list[Future[ScoredBatch]], epoch: int, phase: Phase, advance: Callable[[], None]
) -> tuple[list[ScoredBatch], float]:
    """The scoring worker's results in batch order, and the seconds waited for them after the last rollout (the
    scoring tail: decode + reward the sampling did not hide)."""
    phase(f"epoch {epoch}: scoring", len(jobs))
    wait_start = time.perf_counter()
    scored = []
    for job in jobs:
        scored.append(job.result())
        advance()
    return scored, time.perf_counter() - wait_start
