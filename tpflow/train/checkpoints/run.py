"""A run's checkpoints: writing one (unsharded, gathered, or each process's shards) and putting one back.

The trainer holds one ``RunCheckpoints`` (``Trainer.checkpoints``), built from the components a checkpoint holds
the state of (the backbone's adapter, the optimizer, the EMA, the prompt policy) and where it writes them; the
trainer passes the epoch and the last evaluation to each ``save`` and takes them back from ``restore``. ``saved``
remembers the checkpoint the run last wrote or resumed from: what a stop or the end of the run still has to write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tpflow.distributed import Distributed
from tpflow.interfaces import Backbone, Optimizer
from tpflow.recipe import Recipe
from tpflow.train.checkpoints.format import (
    Checkpoint,
    capture_rng_state,
    park_newer,
    restore_rng_state,
    save_checkpoint,
)
from tpflow.train.checkpoints.resume import restoring
from tpflow.train.checkpoints.sharded import restore_sharded, save_sharded
from tpflow.train.curriculum import AbilityMatched
from tpflow.train.ema import EMA
from tpflow.train.prompt_policy import PromptPolicy
from tpflow.train.replay import ReplayBuffer
from tpflow.train.run_logger import truncate_after
from tpflow.train.sharding import GatheredBackbone, gathered_state


def named_trainable(backbone: Backbone) -> list[tuple[str, torch.Tensor]]:
    """The trained tensors by position: what the processes compare (``Distributed.check_in_sync``)."""
    return [(str(k), p) for k, p in enumerate(backbone.trainable_parameters())]


class RunCheckpoints:
    """``save`` and ``restore`` of one run's state; ``saved``: (epoch, global_step) of the checkpoint last written
    or resumed from, None before the first."""

    def __init__(
        self,
        run_dir: Path,
        recipe: Recipe,
        backbone: Backbone,
        optimizer: Optimizer,
        ema: EMA | None,
        dist: Distributed,
        console: Console,
        prompts: PromptPolicy | AbilityMatched | None = None,
        replay: ReplayBuffer | None = None,
    ) -> None:
        self.run_dir, self.recipe, self.settings = run_dir, recipe, recipe.train
        self.backbone, self.optimizer, self.ema = backbone, optimizer, ema
        self.prompts = prompts  # the prompt sampler's policy: the prompts it set aside (tpflow.train.prompt_policy)
        self.replay = replay  # the replay buffer's trajectories (tpflow.train.replay)
        self.dist, self.console = dist, console
        self.saved: tuple[int, int] | None = None

    def save(self, epoch: int, last_eval: dict[str, float], collective: bool = True) -> Path | None:
        """Write a checkpoint of the current state, ``epoch`` the next to run (atomic, main process only); returns
        its directory there.

        With ``collective`` (every process calls it) the processes first check that their adapters are equal and
        wait for the write to finish."""
        if collective:
            self.dist.check_in_sync(named_trainable(self.backbone))
            self._check_prompts_agree(epoch)
            self._check_replay_agrees(epoch)
        path = None
        backbone: Backbone | GatheredBackbone | None = self.backbone
        states = None
        if self.dist.sharded and self.settings.checkpoint_layout == "sharded":  # every process writes its shards
            path = save_sharded(
                self.run_dir,
                self.optimizer.global_step,
                backbone=self.backbone,
                optimizer_state=self.optimizer.state_dict(gather=False),  # an AdamWLoop's: this process's shards
                ema_state=self.ema.state_dict(gather=False) if self.ema is not None else None,
                is_main=self.dist.is_main,
                processes=self.dist.world_size,
                **self._small_state(epoch, last_eval),
            )
            backbone = None  # fmt: skip
        elif self.dist.sharded:  # gathered into full tensors by every process (collectives), written by the main one
            backbone = GatheredBackbone(self.backbone, gathered_state(self.backbone))
            states = self._states()
        if self.dist.is_main and backbone is not None:
            optimizer_state, ema_state = states or self._states()
            path = save_checkpoint(
                self.run_dir,
                self.optimizer.global_step,
                backbone=backbone,
                optimizer_state=optimizer_state,
                ema_state=ema_state,
                **self._small_state(epoch, last_eval),
            )
        if path is not None:
            self.console.print(f"checkpoint: {path}")
        self.saved = (epoch, self.optimizer.global_step)
        if collective:
            self.dist.barrier()
        return path

    def restore(self, ckpt: Checkpoint | None) -> tuple[int, dict[str, float]]:
        """Put a checkpoint's adapter, optimizer, EMA and RNG states in place; returns the epoch it continues at and
        the last evaluation's figures it holds (None, a fresh start: epoch 0, no evaluation, nothing restored). A
        sharded run loads an unsharded checkpoint's adapter before it shards (``tpflow.train.components``), so here
        only a sharded checkpoint's weights, or an unsharded run's, load."""
        if ckpt is None:
            return 0, {}
        path = ckpt.path
        with restoring(path):  # a checkpoint that does not fit: one paragraph; a bug keeps its traceback
            if ckpt.layout is not None:  # a sharded checkpoint, read into this run's layout (weights in place)
                optimizer_state, ema_state = restore_sharded(ckpt, self.backbone)
            else:
                if not self.dist.sharded:  # sharded: loaded before sharding
                    self.backbone.load_adapter(ckpt.adapter_dir)
                optimizer_state, ema_state = ckpt.optimizer_state, ckpt.ema_state
            self.optimizer.load_state_dict(optimizer_state)
            if self.ema is not None and ema_state is not None:
                self.ema.load_state_dict(ema_state)
            elif self.ema is not None:  # no EMA in the checkpoint: average from the restored adapter, not its init
                self.ema.reset()
            restore_rng_state(ckpt.rng_state)
            epoch = int(ckpt.train_state["epoch"])
            if self.prompts is not None:  # a checkpoint older than the policy's state: nothing set aside
                self.prompts.load_state_dict(ckpt.train_state.get("prompts_set_aside") or [])
            if self.replay is not None:  # a checkpoint without a buffer: an empty one
                self.replay.load_state_dict(ckpt.replay_state or {})
        last_eval = dict(ckpt.train_state.get("last_eval") or {})
        if path.resolve().parent == (self.run_dir / "checkpoints").resolve():  # this run's own (not a warm start)
            self.saved = (epoch, self.optimizer.global_step)
        if self.dist.is_main:
            truncate_after(self.run_dir, epoch - 1)
            self._park_newer()
        self.dist.barrier()
        self.console.print(f"resumed from {path} (epoch {epoch}, step {self.optimizer.global_step})")
        return epoch, last_eval

    # ---- private -----------------------------------------------------------------------------------------------

    def _park_newer(self) -> None:
        """A rewind abandons the run's checkpoints newer than the one resumed, and says so."""
        parked = park_newer(self.run_dir, self.optimizer.global_step)
        if parked:
            self.console.print(
                f"[yellow]note:[/] resuming from an older checkpoint abandons the newer ones: "
                f"{', '.join(p.name.removeprefix('abandoned-') for p in parked)} moved to "
                f"{parked[0].parent}/abandoned-*, where --resume and tpflow eval no longer pick them.",
                soft_wrap=True,
                highlight=False,
            )

    def _check_prompts_agree(self, epoch: int) -> None:
        """Every process set aside the same prompts (each decides from the same gathered rows): else a bug, and the
        processes would plan different epochs."""
        if self.prompts is None or not self.prompts.has_state or not self.dist.enabled:  # uniform: nothing to compare
            return
        states = self.dist.gather_objects([self.prompts.state_dict(epoch)])
        if any(state != states[0] for state in states):
            raise RuntimeError(f"the processes' prompt policies set aside different prompts before epoch {epoch}")

    def _check_replay_agrees(self, epoch: int) -> None:
        """Every process holds the same replay buffer (the same gathered rows admitted, the same forgotten): else a
        bug, and the processes would replay different rows."""
        if self.replay is None or not self.replay.enabled or not self.dist.enabled:
            return
        digests = self.dist.gather_objects([self.replay.digest(epoch)])
        if any(digest != digests[0] for digest in digests):
            raise RuntimeError(f"the processes' replay buffers differ before epoch {epoch}")

    def _small_state(self, epoch: int, last_eval: dict[str, float]) -> dict[str, Any]:
        """A checkpoint's RNG states, train state (with the prompts the policy set aside), recipe and how many to
        keep."""
        train_state: dict[str, Any] = {
            "epoch": epoch,
            "global_step": self.optimizer.global_step,
            "last_eval": last_eval,
        }
        if self.prompts is not None and self.prompts.has_state:  # uniform: the checkpoint as before, byte for byte
            train_state["prompts_set_aside"] = self.prompts.state_dict(epoch)
        return {
            "rng_state": capture_rng_state(),
            # last_eval: a resumed run's metrics lines repeat it until its next eval, as the uninterrupted run's
            "train_state": train_state,
            "recipe": self.recipe.data,
            "keep_last": self.settings.keep_checkpoints,
            # the replay buffer's rows (replay.safetensors), only with replay: the checkpoint as before otherwise
            "replay_state": self.replay.state_dict(epoch) if self.replay is not None and self.replay.enabled else None,
        }

    def _states(self) -> tuple[dict, dict[str, torch.Tensor] | None]:
        """The optimizer's and the EMA's state for a checkpoint (gathered when sharded)."""
        return self.optimizer.state_dict(), self.ema.state_dict() if self.ema is not None else None
