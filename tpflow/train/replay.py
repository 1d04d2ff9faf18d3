"""Replayed trajectories: a stage between the rollout and the update (``[replay]``: tpflow.replay_settings;
OP-GRPO, arXiv 2604.04142; docs/algorithm.md §10.12).

Each epoch, once its advantages are known (``ReplayBuffer.mix``, before the update):

1. the buffer forgets what this epoch may not draw: trajectories admitted more than ``max_age`` epochs ago, and
   past ``capacity`` the oldest (then the lower admission score, then the later row);
2. the draw: ``rows`` of the rest (uniformly, seeded by (seed, epoch)), or all of them, in stored order, dealt
   over the processes in order; each process's share is appended to its batch with the advantages [W] stored at
   admission, marked ``Rollout.replayed`` for the optimizer, which corrects the off-policy shift
   (``tpflow.optim.replay_weights``);
3. admission: every trajectory of the epoch whose advantage, averaged over its window steps (its score), is at least
   ``min_advantage`` is stored, with its transitions, its behaviour log-probabilities, its conditioning and its
   advantages. It is drawn from the next epoch on, never in its own.

Every process holds the same buffer. The admitted rows (a few of the epoch's, not all) are gathered, so each process
stores the same rows in the same order, draws the same ones and takes its share; a checkpoint, written by the main
process, holds the whole buffer, and resumes on any number of processes. The buffer lives in host memory; its rows
join the batch on the rollout's device. A replayed row has no prompt group of the epoch (its group id is -1).

The buffer is part of exact resume: ``state_dict(epoch)`` holds what epoch ``epoch`` may draw from (what an epoch
cut short admitted is left out; it admits it again when it runs), as tensors for the checkpoint's
``replay.safetensors``, and a resumed run draws and replays what the uninterrupted run did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import torch
from torch import Tensor

from tpflow.distributed import Distributed
from tpflow.errors import UserError
from tpflow.replay_settings import ReplaySettings
from tpflow.types import Conditioning, Rollout

STORED = ("latents", "next_latents", "log_probs", "sigmas", "final")  # the Rollout fields a replayed row keeps
COND = "cond."  # prefix of the conditioning tensors' keys in the buffer


class ReplayBuffer:
    """The buffer and its rules (module docstring). ``rows``: key -> [R, ...] host tensors, one row per admitted
    trajectory in admission order; besides the ``STORED`` fields and the conditioning, ``trained`` [R, W] bool,
    ``advantages`` [R, W] float64, ``epoch`` [R] int64 (admitted in), ``row`` [R] int64 (its row among the epoch's
    rows of every process), ``score`` [R] float64 (its mean advantage). Empty: no keys."""

    def __init__(self, settings: ReplaySettings, seed: int) -> None:
        self.settings, self.seed = settings, seed  # seed: [train] seed, of the draws
        self.rows: dict[str, Tensor] = {}

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def __len__(self) -> int:
        return int(self.rows["epoch"].shape[0]) if self.rows else 0

    def live(self, epoch: int) -> Tensor:
        """[m] host long: the stored rows epoch ``epoch`` may draw, in stored order (the module docstring's step 1)."""
        if not self.rows:
            return torch.zeros(0, dtype=torch.long, device="cpu")
        admitted, score = self.rows["epoch"].tolist(), self.rows["score"].tolist()
        young = [j for j, e in enumerate(admitted) if 1 <= epoch - e <= self.settings.max_age]
        ranked = sorted(young, key=lambda j: (-admitted[j], -score[j], j))[: self.settings.capacity]
        return torch.tensor(sorted(ranked), dtype=torch.long, device="cpu")

    def mix(self, epoch: int, batch: Rollout, advantages: Tensor, dist: Distributed) -> tuple[Rollout, Tensor, dict]:
        """This process's batch (its ``n`` rows of the epoch's, every process holding as many) and advantages with the
        rows it replays appended, and the stage's metrics. ``advantages``: [N, W] float64 of every process's rows in
        process order. Without replay, the batch as it is and its slice of ``advantages``."""
        n, rank = len(batch), dist.rank
        local = advantages[rank * n : (rank + 1) * n]  # [n, W]
        if not self.enabled:
            return batch, local, {}
        if self.rows:  # rows of this run's shapes (a checkpoint of other settings: one paragraph)
            self._check_fits(batch)
        self._keep(self.live(epoch))
        drawn = self._draw(epoch)  # [k] stored rows, every process's
        admitted = self._admit(epoch, batch, advantages, dist)
        k, world = len(drawn), dist.world_size
        share = drawn[rank * k // world : (rank + 1) * k // world]  # this process's, in order
        metrics = {"replay_drawn": float(k), "replay_admitted": float(admitted), "replay_held": float(len(self))}
        if not len(share):
            return batch, local, metrics
        mixed = Rollout.cat([batch, self._rollout(share, batch)])
        replayed = torch.arange(n + len(share), device="cpu") >= n  # [n + k_r] host: the appended rows
        mixed = dataclasses.replace(mixed, cost=batch.cost, replayed=replayed)  # the rollout's cost is the epoch's
        stored = self.rows["advantages"][share].to(local.device, local.dtype)  # [k_r, W]
        return mixed, torch.cat([local, stored]), metrics

    def state_dict(self, epoch: int) -> dict[str, Tensor]:
        """What a checkpoint whose next epoch is ``epoch`` holds: the rows that epoch may draw (contiguous host
        tensors; empty when none)."""
        keep = self.live(epoch)
        return {key: value[keep].contiguous() for key, value in self.rows.items()} if len(keep) else {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Put back ``state_dict``'s tensors (a checkpoint without them: an empty buffer)."""
        self.rows = {key: value.clone() for key, value in state.items()}

    def digest(self, epoch: int) -> str:
        """A hash of which rows ``state_dict(epoch)`` holds (their epoch, row and score): what the processes compare
        before a collective checkpoint."""
        state = self.state_dict(epoch)
        parts = [state[key].numpy().tobytes() for key in ("epoch", "row", "score") if key in state]
        return hashlib.sha256(b"|".join(parts)).hexdigest()

    # ---- private -----------------------------------------------------------------------------------------------

    def _keep(self, rows: Tensor) -> None:
        self.rows = {key: value[rows] for key, value in self.rows.items()} if len(rows) else {}

    def _check_fits(self, batch: Rollout) -> None:
        """The stored rows are of this run's window, latent and conditioning (a checkpoint resumed with another
        window_size, resolution or backbone holds rows this batch cannot take): else one paragraph."""
        stored = {key.removeprefix(COND): value.shape[1:] for key, value in self.rows.items() if key.startswith(COND)}
        fresh = {key: value.shape[1:] for key, value in batch.cond.tensors.items()}
        if self.rows["latents"].shape[1:] != batch.latents.shape[1:] or stored != fresh:
            raise UserError(
                f"The replay buffer holds trajectories of shape {tuple(self.rows['latents'].shape[1:])} (window "
                f"steps, latent) and this run samples {tuple(batch.latents.shape[1:])}, or their conditioning "
                "differs: the checkpoint was written with another [rollout] window_size, resolution or backbone. "
                "Resume with the checkpoint's settings, or start a new run."
            )

    def _draw(self, epoch: int) -> Tensor:
        """[k] the stored rows the epoch replays (every row kept by ``_keep``, or ``rows`` of them)."""
        held, wanted = len(self), self.settings.rows
        if wanted is None or wanted >= held:
            return torch.arange(held, dtype=torch.long, device="cpu")
        picked = random.Random(f"{self.seed}/{epoch}/replay").sample(range(held), wanted)
        return torch.tensor(sorted(picked), dtype=torch.long, device="cpu")

    def _admit(self, epoch: int, batch: Rollout, advantages: Tensor, dist: Distributed) -> int:
        """Store the epoch's rows whose score reaches ``min_advantage`` (each process gives its own, gathered
        in process order); returns how many."""
        n, rank = len(batch), dist.rank
        score = advantages.double().cpu().mean(1)  # [N] every process's rows
        chosen = (score >= self.settings.min_advantage).nonzero().squeeze(1)  # [a] rows of the epoch
        mine = chosen[(chosen >= rank * n) & (chosen < (rank + 1) * n)] - rank * n  # [a_r] this process's rows
        at = mine.to(batch.device)
        shape = (len(mine), batch.log_probs.shape[1])  # [a_r, W]: a batch without a mask trains every step
        trained = batch.trained[at].cpu() if batch.trained is not None else torch.ones(shape, device="cpu")
        local = {name: getattr(batch, name)[at].detach().cpu() for name in STORED}
        local.update({COND + key: value[at].detach().cpu() for key, value in batch.cond.tensors.items()})
        local["trained"] = trained.to(torch.uint8)  # bool travels as uint8 (EpochRows.gather)
        new = {key: dist.gather(value) for key, value in local.items()}
        new["trained"] = new["trained"].bool()
        new.update(
            advantages=advantages[chosen].double().cpu(),
            epoch=torch.full((len(chosen),), epoch, dtype=torch.long, device="cpu"),
            row=chosen.clone(),
            score=score[chosen],
        )
        self.rows = {key: torch.cat([self.rows[key], value]) for key, value in new.items()} if self.rows else new
        return len(chosen)

    def _rollout(self, rows: Tensor, batch: Rollout) -> Rollout:
        """The stored ``rows`` ([k] host) as a rollout on ``batch``'s devices, its noise level, guidance and shared
        conditioning (a replayed row was sampled under the same recipe)."""
        take = {key: value[rows] for key, value in self.rows.items()}
        trained = take["trained"]
        cond = {key.removeprefix(COND): value for key, value in take.items() if key.startswith(COND)}
        device = batch.log_probs.device
        return Rollout(
            **{name: take[name].to(getattr(batch, name).device) for name in STORED},
            noise_level=batch.noise_level,
            guidance=batch.guidance,
            cond=Conditioning({k: v.to(batch.cond.tensors[k].device) for k, v in cond.items()}, batch.cond.extras),
            completions=None,
            cost=batch.cost,
            trained=None if batch.trained is None and bool(trained.all()) else trained.to(device),
            groups=None if batch.groups is None else torch.full((len(rows),), -1, dtype=torch.long, device="cpu"),
        )
