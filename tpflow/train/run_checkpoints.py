"""The trainer's checkpoints: writing one (unsharded, gathered, or each process's shards) and putting one back.

A mixin of ``Trainer`` (tpflow/train/trainer.py), which holds the state these methods read and set: the run dir,
the recipe, the backbone, the optimizer, the EMA, the processes, the epoch and the last evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tpflow.train.checkpoint import (
    Checkpoint,
    capture_rng_state,
    park_newer,
    restore_rng_state,
    save_checkpoint,
)
from tpflow.train.resume import restoring
from tpflow.train.run_logger import truncate_after
from tpflow.train.sharded_save import restore_sharded, save_sharded
from tpflow.train.sharding import GatheredBackbone, gathered_state


class RunCheckpoints:
    """``save`` and ``_restore`` of a Trainer (which also gives ``_named_trainable``, the adapters compared across
    processes before a save)."""

    run_dir: Path
    recipe: Any
    settings: Any
    backbone: Any
    optimizer: Any
    ema: Any
    dist: Any
    console: Any
    epoch: int
    last_eval: dict
    _saved: tuple[int, int] | None

    def save(self, collective: bool = True) -> Path | None:
        """Write a checkpoint of the current state (atomic, main process only); returns its directory there.

        With ``collective`` (every process calls it) the processes first check that their adapters are equal and
        wait for the write to finish."""
        if collective:
            self.dist.check_in_sync(self._named_trainable())
        path = None
        backbone, states = self.backbone, None
        if self.dist.sharded and self.settings.checkpoint_layout == "sharded":  # every process writes its shards
            path = save_sharded(
                self.run_dir,
                self.optimizer.global_step,
                backbone=self.backbone,
                optimizer_state=self.optimizer.state_dict(gather=False),
                ema_state=self.ema.state_dict(gather=False) if self.ema is not None else None,
                is_main=self.dist.is_main,
                processes=self.dist.world_size,
                **self._small_state(),
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
                **self._small_state(),
            )
        if path is not None:
            self.console.print(f"checkpoint: {path}")
        self._saved = (self.epoch, self.optimizer.global_step)
        if collective:
            self.dist.barrier()
        return path

    # ---- private -----------------------------------------------------------------------------------------------

    def _small_state(self) -> dict[str, Any]:
        """A checkpoint's RNG states, train state, recipe and how many to keep."""
        return {
            "rng_state": capture_rng_state(),
            # last_eval: a resumed run's metrics lines repeat it until its next eval, as the uninterrupted run's
            "train_state": {
                "epoch": self.epoch,
                "global_step": self.optimizer.global_step,
                "last_eval": self.last_eval,
            },
            "recipe": self.recipe.data,
            "keep_last": self.settings.keep_checkpoints,
        }

    def _states(self) -> tuple[dict, dict[str, torch.Tensor] | None]:
        """The optimizer's and the EMA's state for a checkpoint (gathered when sharded)."""
        return self.optimizer.state_dict(), self.ema.state_dict() if self.ema is not None else None

    def _restore(self, ckpt: Checkpoint | None) -> None:
        """Put a checkpoint's adapter, optimizer, EMA and RNG states in place (None: nothing to restore)."""
        if ckpt is None:
            return
        path = ckpt.path
        with restoring(path):  # a checkpoint that does not fit: one paragraph; a bug keeps its traceback
            if ckpt.layout is not None:  # a sharded checkpoint, read into this run's layout (weights in place)
                optimizer_state, ema_state = restore_sharded(ckpt, self.backbone)
            else:
                if not self.dist.sharded:  # sharded: loaded before sharding (_shard)
                    self.backbone.load_adapter(ckpt.adapter_dir)
                optimizer_state, ema_state = ckpt.optimizer_state, ckpt.ema_state
            self.optimizer.load_state_dict(optimizer_state)
            if self.ema is not None and ema_state is not None:
                self.ema.load_state_dict(ema_state)
            elif self.ema is not None:  # no EMA in the checkpoint: average from the restored adapter, not its init
                self.ema.reset()
            restore_rng_state(ckpt.rng_state)
            self.epoch = int(ckpt.train_state["epoch"])
        self.last_eval = dict(ckpt.train_state.get("last_eval") or {})
        if path.resolve().parent == (self.run_dir / "checkpoints").resolve():  # this run's own (not a warm start)
            self._saved = (self.epoch, self.optimizer.global_step)
        if self.dist.is_main:
            truncate_after(self.run_dir, self.epoch - 1)
            parked = park_newer(self.run_dir, self.optimizer.global_step)  # a rewind abandons the newer ones
            if parked:
                self.console.print(
                    f"[yellow]note:[/] resuming from an older checkpoint abandons the newer ones: "
                    f"{', '.join(p.name.removeprefix('abandoned-') for p in parked)} moved to "
                    f"{parked[0].parent}/abandoned-*, where --resume and tpflow eval no longer pick them.",
                    soft_wrap=True,
                    highlight=False,
                )
        self.dist.barrier()
        self.console.print(f"resumed from {path} (epoch {self.epoch}, step {self.optimizer.global_step})")
