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
from collections.abc import Callable
from dataclasses import dataclass

from tpflow.devices import cpu_generator
from tpflow.interfaces import Backbone, CreditAssigner, Optimizer, RewardModel, RolloutPlan, Sampler, capability
from tpflow.plans import WindowPlan
from tpflow.precision import Precision
from tpflow.rollout import rollout_from_settings
from tpflow.scoring.call import recipe_policy
from tpflow.settings import RolloutSettings, TrainSettings
from tpflow.train.epoch import Sampled
from tpflow.train.lockstep import Lockstep
from tpflow.train.prompt_sampler import RolloutBatch, noise_seed, plan_epoch
from tpflow.train.scoring import ScoringWorker
from tpflow.types import PromptItem

Phase = Callable[[str, "int | None"], None]  # the progress bar: a stage's description and its number of steps


@dataclass
class EpochSampler:
    """What sampling an epoch needs, built once per run by the trainer."""

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

    def __call__(self, epoch: int, batches: list[RolloutBatch], phase: Phase, advance: Callable[[], None]) -> Sampled:
        """Roll out each local batch (its plan and noise from its seed) and score it in the background worker."""
        train, rollout = self.train, self.rollout
        start = time.perf_counter()
        phase(f"epoch {epoch}: sampling", len(batches))  # the text encoding below is part of it
        z0_seeds = {i: noise_seed(train, epoch, i) for b in batches for i in b.items} if rollout.same_noise else None
        # The rollout produces what the optimizer consumes (Optimizer.consumes), and completions only when the
        # credit assigner reads them: final samples need neither stored transitions nor completions.
        transitions = self.optimizer.consumes == "transitions"
        completions = rollout.completions if self.credit.needs_completions and transitions else None
        store_means = transitions and capability(self.optimizer, "needs_old_means")  # e.g. GRPO's RatioNorm
        retain = capability(self.optimizer, "retain") if transitions else None  # a recompute-free update's graphs
        if retain is not None:  # per-trajectory gradients suffice where every step of a trajectory gets one reward
            retain = retain.for_credit(capability(self.credit, "same_reward_every_step"))
        # The text encoders run once per epoch, on every distinct prompt of the epoch's plan (all processes alike,
        # so the embeddings do not depend on the number of processes); each rollout batch indexes its rows.
        plan = plan_epoch(len(self.items), train, epoch)
        texts = sorted({self.items[i].prompt for b in plan.batches for i in b.items})
        encoded, text_row = self.backbone.encode(texts), {text: k for k, text in enumerate(texts)}
        worker = ScoringWorker(self.backbone.decode, self.reward, chunk=train.score_batch, policy=recipe_policy(train))
        rollouts, jobs, first_row = [], [], 0
        try:
            for b in batches:
                items = [self.items[i] for i in b.items]
                # the plan: each trajectory's SDE window and the steps the update trains, from the batch's seed
                window = self.plan.plan(rollout, len(items), epoch, b.seed, train.seed)
                generator = cpu_generator(b.seed)  # noise drawn on the CPU, moved to the model (tpflow.devices)
                cond = encoded.index([text_row[it.prompt] for it in items])
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
                        completions,
                        generator,
                        z0_seeds,
                        transitions,
                        store_means,
                        None if retain is None else retain.for_batch(first_row),
                    )
                first_row += len(items)
                prompts, metadata = [i.prompt for i in items], [i.metadata for i in items]
                # traces [n, W + 1] of the plan's W (a truncated window holds fewer than [rollout] window_size)
                jobs.append(worker.submit(out.final, out.completions, prompts, metadata, window.size))
                rollouts.append(dataclasses.replace(out, completions=None))  # scored already; the update needs none
                advance()
            phase(f"epoch {epoch}: scoring", len(jobs))
            wait_start = time.perf_counter()  # the scoring tail: decode + reward the sampling did not hide
            scored = []
            for job in jobs:
                scored.append(job.result())
                advance()
            wait_s = time.perf_counter() - wait_start
        finally:
            worker.close()
        return Sampled(list(batches), rollouts, scored, time.perf_counter() - start, wait_s)
