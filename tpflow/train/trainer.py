"""The training loop of every method (GRPO and its variants, DiffusionNFT, AWM, DGPO): ``tpflow train RECIPE``.

One epoch (docs/architecture.md, "An epoch"; docs/algorithm.md §6.1):

1. plan the epoch's rollout batches: ``prompts_per_epoch`` training prompts, G copies each, shuffled into batches
   that are dealt to the processes (``prompt_sampler``; one process runs them all), planned once;
2. per local rollout batch: draw the SDE window, roll out (main trajectory, ODE baseline and completions, batched per
   step; only what the optimizer consumes, under its sampling policy), and hand the latents to the background
   scoring worker (decode + reward) while the next batch samples;
3. per rollout batch: the credit assigner turns the reward trace [n, W+1] into step rewards [n, W];
4. gather every process's step rewards and prompt keys; advantages per prompt and per window step over the whole
   epoch, sliced back to each process; the optimizer's update (whichever ``tpflow.optim`` method the recipe names;
   gradients averaged over the processes); the EMA.

Every ``eval.every`` epochs (epoch 0 included) the EMA weights (when enabled) sample the held-out prompts by ODE.
Checkpoints (``tpflow.train.checkpoints``, held as ``Trainer.checkpoints``) are written every ``train.save_every``
epochs, at the end and on Ctrl-C or SIGTERM, by the main process only (as are the logs; a sharded run's by every
process); a signal stops the run at the next safe point, after the update in progress, so no finished epoch is lost
(``tpflow.train.stop``). Randomness is derived from (seed, epoch, rollout batch), so a resumed run continues exactly
as an uninterrupted one, and the trajectories an epoch samples do not depend on the number of processes
(docs/distributed.md). The components are built once, before anything runs (``tpflow.train.components``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from tpflow.devices import resolve_device
from tpflow.distributed import Distributed, make_accelerator
from tpflow.errors import UserError
from tpflow.interfaces import RewardModel, capability
from tpflow.precision import Precision
from tpflow.preflight import check_machine
from tpflow.recipe import Recipe
from tpflow.scoring.call import recipe_policy
from tpflow.scoring.watched import build_watched, guard_lines, with_watched
from tpflow.sources import group_text
from tpflow.train.allocator import keep_freed_memory
from tpflow.train.checkpoints.format import find_checkpoint
from tpflow.train.checkpoints.resume import checkpoint_to_resume, train_command
from tpflow.train.checkpoints.run import RunCheckpoints, named_trainable
from tpflow.train.components import build_components
from tpflow.train.diversity import Embedder, build_embedder
from tpflow.train.ema import EMA
from tpflow.train.epoch import EpochRows, Sampled, combine_update_metrics, prompt_groups
from tpflow.train.evaluation import eval_seed, evaluate
from tpflow.train.out_of_memory import out_of_memory_message
from tpflow.train.progress import PhaseProgress
from tpflow.train.prompt_policy import build_prompt_policy
from tpflow.train.prompt_sampler import EpochPlan, check_layout, layout_line, plan_epoch
from tpflow.train.replay import ReplayBuffer
from tpflow.train.reward_parts import zscore_sum_advantages, zscored_parts
from tpflow.train.run_lock import RunDirLock
from tpflow.train.run_logger import NullLogger, RunLogger, epoch_line, fit_segments
from tpflow.train.sharding import equal_eval_shares
from tpflow.train.stop import Stopped, StopRequest
from tpflow.train.stop_notices import RunPoint, interrupted, stop_notice
from tpflow.train.trackers import Trackers, tracker_dir
from tpflow.types import Rollout

MAX_NONFINITE_EPOCHS = 3  # consecutive epochs with non-finite losses before the run stops


def _unlock_on_error(init: Any) -> Any:
    """A Trainer whose construction fails drops its run dir lock at once (not when it is garbage-collected)."""

    @functools.wraps(init)
    def wrapper(self: Trainer, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "run_lock", None) is not None:
                self.run_lock.release()
            raise

    return wrapper


class Trainer:
    """Builds every component of a recipe and runs its epochs; see the module docstring. Its checkpoints are
    ``self.checkpoints`` (``RunCheckpoints``)."""

    @_unlock_on_error
    def __init__(
        self,
        recipe: Recipe,
        run_dir: Path | None = None,
        resume: bool | Path = False,
        console: Console | None = None,
    ) -> None:
        self.recipe = recipe
        self.settings = train = recipe.train
        stem = recipe.path.stem if recipe.path else "run"
        self.run_dir = Path(run_dir) if run_dir else Path(train.run_dir.format(recipe=stem))
        self.console = console or Console()
        # devices, files, weights, prompts, run dir: a UserError before anything loads; else what was found
        self.machine = check_machine(recipe, self.run_dir)
        # The accelerator follows the backbone's device (a CPU backbone on a GPU machine gets no CUDA autocast);
        # a device this machine lacks is a UserError here, before anything loads. Mixed precision is tpflow's own,
        # on every device (tpflow.precision): the accelerator runs the processes and the trackers only.
        device = resolve_device(getattr(recipe.backbone.options, "device", None))
        cpu = device.type != "cuda"
        if cpu:
            keep_freed_memory()  # batched rollouts on CPU: avoid a page fault per 4 KiB of every big tensor
        self.precision = Precision(train.mixed_precision, device)
        self.accelerator = make_accelerator(
            cpu=cpu, mixed_precision="no", log_with=recipe.log.trackers, logging_dir=tracker_dir(self.run_dir)
        )
        self.dist = Distributed(self.accelerator)
        self.run_lock = RunDirLock(self.run_dir)  # one writer per run dir (tpflow.train.run_lock), held until fit ends
        if self.dist.is_main:
            self.run_lock.acquire()
        else:
            self.console = Console(quiet=True)  # one process reports; every process raises its own errors
        check_layout(train, self.dist.world_size)
        # the checkpoint to resume, verified and compared with the recipe before any weights load (checkpoints.resume)
        checkpoint = checkpoint_to_resume(self.run_dir, resume, self.recipe, self.console, self.dist.is_main)
        for line in self.machine.lines():  # every check passed: where each weight comes from, before any loads
            self.console.print(escape(line), style="yellow" if line.startswith("warning:") else "dim", soft_wrap=True)
        parts = build_components(recipe, self.dist, self.accelerator, self.precision, self.console, checkpoint)
        self.backbone, self.sampler, self.optimizer = parts.backbone, parts.sampler, parts.optimizer
        self.credit, self.lockstep, self.epoch_sampler = parts.credit, parts.lockstep, parts.epoch_sampler
        self.train_items, self.test_items, self.eval_split = parts.train_items, parts.test_items, parts.eval_split
        if self.dist.sharded and recipe.eval.every:  # each process's eval forwards must match the others'
            equal_eval_shares(len(self.test_items) * recipe.eval.images_per_prompt, self.dist.world_size)
        params = self.backbone.trainable_parameters()
        self.ema = EMA(params, train.ema_decay, train.ema_every) if train.ema else None
        self.epoch = 0  # the next epoch to run
        self.last_eval: dict[str, float] = {}  # the newest eval's figures and epoch, repeated on each epoch's line
        self._first_eval: dict[str, float] = {}  # the first eval this process made: the guard's second reference
        self._progress: PhaseProgress | None = None
        self._description = ""  # the phase the progress bar shows
        self.nonfinite_epochs = 0
        self._weights_ahead = False  # True from an epoch's update until self.epoch counts it
        self._stop: StopRequest | None = None  # while fit runs: Ctrl-C recorded, for the processes to stop together
        self._stopping = False  # True once they did (tpflow.train.stop)
        self.prompts = build_prompt_policy(train, [group_text(i) for i in self.train_items], self)  # which it draws
        self.replay = ReplayBuffer(recipe.replay, train.seed)  # replayed trajectories (train.replay)
        self.checkpoints = RunCheckpoints(self.run_dir, recipe, self.backbone, self.optimizer, self.ema, self.dist,
                                          self.console, self.prompts, self.replay)  # fmt: skip
        self.epoch, self.last_eval = self.checkpoints.restore(checkpoint)  # a fresh start's: 0, {}
        self.dist.check_in_sync(named_trainable(self.backbone))
        self.logger = self._open_logger(bool(resume))

    def _open_logger(self, resume: bool) -> RunLogger | NullLogger:
        """The run's logs and trackers, written by the main process (continued on ``resume``)."""
        if not self.dist.is_main:
            return NullLogger()
        return RunLogger(
            self.run_dir, Trackers(self.accelerator, self.recipe.log, self.run_dir, self.recipe.data, resume)
        )

    # ---- public ------------------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Run the remaining epochs; returns the last epoch's metrics (with the last eval's). A run resumed after
        it finished says so and does nothing. SIGINT and SIGTERM stop it at the next safe point, with every
        finished epoch saved (``tpflow.train.stop``)."""
        progress = PhaseProgress(self.console, self.dist.is_main, self.recipe.log.progress_lines_s)
        self._progress = progress
        if self.dist.is_main:
            self.run_lock.acquire()  # a no-op unless an earlier fit released it
        self._stop, self._stopping = StopRequest(self.dist, self._stop_notice), False
        try:
            if self._finished():
                return self._finished_already()
            self._stop.install()
            self._print_header()
            progress.start()
            return self._run_epochs()
        except torch.cuda.OutOfMemoryError as exc:  # one paragraph naming the phase's batch setting, no checkpoint
            saved = self.checkpoints.saved is not None or find_checkpoint(self.run_dir)[0] is not None
            command = train_command(self.recipe, self.run_dir, resume=saved)  # every --set of the run included
            layout = self.optimizer.batch_layout()
            raise UserError(out_of_memory_message(self._description, exc, command, layout, saved)) from None
        except KeyboardInterrupt:
            self._interrupted()
            raise
        finally:
            self._stop.remove()
            self._stop = None
            progress.stop()
            self.logger.close()
            self.run_lock.release()

    def _run_epochs(self) -> dict[str, Any]:
        """``fit``'s loop: each epoch (its evaluation first, when due), the checkpoints, the final evaluation."""
        train, evaluation = self.settings, self.recipe.eval
        metrics: dict[str, Any] = {}
        for epoch in range(self.epoch, train.epochs):
            self._stop_point()
            due = evaluation.every and epoch % evaluation.every == 0 and (epoch or evaluation.at_start)
            if due and self.last_eval.get("last_eval_epoch") != epoch:  # not done before a stop that saved it
                # last_eval_epoch: which eval the repeated eval_* figures of the next lines are (eval@N)
                self.last_eval = {**self.evaluate(epoch), "last_eval_epoch": epoch}
                self._stop_point()
            metrics = {**self.train_epoch(epoch), **self.last_eval}
            self.epoch, self._weights_ahead = epoch + 1, False
            # metrics.jsonl repeats the last eval on each epoch's line; the trackers got it at its own step
            self.logger.log(metrics, step=self.optimizer.global_step, epoch=epoch, untracked=self.last_eval)
            self.console.print(epoch_line(epoch, metrics))
            if train.save_every and self.epoch % train.save_every == 0 and self.epoch < train.epochs:
                self._save()
        self._stop_point()
        if evaluation.every:
            self.last_eval = {**self.evaluate(train.epochs), "last_eval_epoch": train.epochs}
            final = self.last_eval
            self.logger.log(final, step=self.optimizer.global_step, epoch=train.epochs, untracked=final)
            metrics.update(final)
        # with the final figures, also over the same step's checkpoint (saved by a stop before the final evaluation)
        if evaluation.every or self.checkpoints.saved != (self.epoch, self.optimizer.global_step):
            self._save()
        return metrics

    def _finished(self) -> bool:
        """Resumed from the run's last checkpoint, written after its last epoch and its final evaluation."""
        final = not self.recipe.eval.every or self.last_eval.get("last_eval_epoch") == self.settings.epochs
        done = (self.epoch, self.optimizer.global_step)
        return self.epoch >= self.settings.epochs and final and self.checkpoints.saved == done

    def _finished_already(self) -> dict[str, Any]:
        """``--resume`` of a finished run: say so and do nothing (it used to evaluate again, 56 s for 96 clips).
        The final evaluation's metrics line, which resuming drops with every line past the checkpoint's epoch
        (``truncate_after``), is written back as it was; the trackers have it already."""
        epochs, step = self.settings.epochs, self.optimizer.global_step
        if self.last_eval.get("last_eval_epoch") == epochs:
            self.logger.log(self.last_eval, step=step, epoch=epochs, untracked=self.last_eval)
        final = ", its final evaluation logged" if self.recipe.eval.every else ""
        self.console.print(
            f"The run is finished: all {self.epoch} epochs trained{final}, checkpoint {step:08d}; nothing to do. "
            f"To train on, resume with more epochs (--epochs N, N > {self.epoch}).",
            soft_wrap=True,
            highlight=False,
        )
        return dict(self.last_eval)

    def _save(self) -> None:
        """``checkpoints.save`` with every process, finished even if a signal comes during it
        (``StopRequest.holding``)."""
        with self._stop.holding() if self._stop is not None else contextlib.nullcontext():
            self.checkpoints.save(self.epoch, self.last_eval)

    def _stop_point(self) -> None:
        """A state to resume from, on every process at once (``tpflow.train.stop``): if any process got SIGINT or
        SIGTERM, all stop here (``Stopped``) and save together."""
        if self._stop is not None and self._stop.agreed():
            self._stopping = True
            raise Stopped(self._stop.signum or signal.SIGINT)

    def _print_header(self) -> None:
        """The run's first line (recipe, run dir, epochs, credit, adapter, device) and, on several processes, how an
        epoch's rows fall over them."""
        header = [
            f"tpflow train {self.recipe.path or ''} -> {self.run_dir}",
            f"epochs {self.epoch}..{self.settings.epochs - 1}",
            f"credit {self.recipe.credit.name}",
            f"{len(self.backbone.trainable_parameters())} trainable tensors"
            + (f", FSDP-sharded over {self.dist.world_size}" if self.dist.sharded else ""),
            f"device {self.machine.device}",
        ]  # at 80 columns the line breaks between these, never inside a value
        self.console.print(escape(fit_segments(header, self.console.width)), soft_wrap=True, highlight=False)
        if self.dist.enabled:  # the batches' layout, whichever prompts the policy picks (it samples nothing here)
            plan, layout = plan_epoch(len(self.train_items), self.settings, self.epoch), self.optimizer.batch_layout()
            self.console.print(layout_line(plan, layout, self.dist.world_size, self.recipe.replay.drawn))

    def _point(self) -> RunPoint:
        """Where the run is, for what a stop says (``tpflow.train.stop_notices``; attributes only)."""
        return RunPoint(
            epoch=self.epoch,
            epochs=self.settings.epochs,
            step=self.optimizer.global_step,
            phase=self._description,
            saved=self.checkpoints.saved,
            weights_ahead=self._weights_ahead,
        )

    def _stop_notice(self, signum: int) -> str:
        """What the first SIGINT or SIGTERM says (``StopRequest``; from its handler)."""
        return stop_notice(signum, self._point(), self._stop)

    def _interrupted(self) -> None:
        """Stopped: save the state if it is one to resume from (every process at a safe point, the main one alone
        after a ``KeyboardInterrupt`` raised elsewhere) and say what --resume will do (``stop_notices``)."""
        any_saved = self.checkpoints.saved is not None or find_checkpoint(self.run_dir)[0] is not None
        line, save = interrupted(self._point(), self._stop, self._stopping, self.dist.sharded, any_saved)
        self.console.print(line)
        if save == "together":
            self._save()
        elif save == "main" and self.dist.is_main:  # the other processes may be stopped anywhere: no collective
            self.checkpoints.save(self.epoch, self.last_eval, collective=False)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch, stage by stage (docs/architecture.md, "An epoch"); returns its metrics over every process."""
        start = time.perf_counter()
        plan = self.prompts.plan(epoch)  # every process's batches, planned once (around the prompts set aside)
        sampled = self._sample_and_score(plan)  # this process's rollouts and reward traces [n_b, W+1], batch by batch
        credits = [self.credit(s.trace) for s in sampled.scored]  # per rollout batch: balancing stays within one
        rows = EpochRows.local(sampled, credits).gather(self.dist)  # [N] trajectories of every process
        # The prompt group is the prompt's text, as in the reference (docs/algorithm.md §5): two dataset items with the
        # same text (the shapes train split repeats its 93 texts) are one group, on every process alike; unless the
        # copies share z_0 (same_noise), when a group is also one item's noise (``prompt_groups``).
        items = rows.items.tolist()
        starts = items if self.recipe.rollout.same_noise else None
        groups = prompt_groups([group_text(self.train_items[i]) for i in items], starts)  # [N] ints
        parts = zscored_parts(self.reward)  # several rewards, each normalised on its own (tpflow.train.reward_parts)
        advantages = (  # [N, W] float64, the same everywhere
            zscore_sum_advantages(parts, self.credit, sampled.scored, self.optimizer, groups, self.dist.gather)
            if parts
            else self.optimizer.advantages(rows.step_rewards, groups)
        )
        n, rank = sampled.num_rows, self.dist.rank
        local_groups = torch.tensor(groups[rank * n : (rank + 1) * n], dtype=torch.long, device="cpu")  # [n] host
        batch = dataclasses.replace(Rollout.cat(sampled.rollouts), groups=local_groups)
        sampled.rollouts.clear()  # the update holds the concatenated copy only
        update_start = time.perf_counter()
        batch, local, replay = self.replay.mix(epoch, batch, advantages, self.dist)  # + replayed rows, if any
        update = {**self._update(epoch, batch, local), **replay}
        update_s = time.perf_counter() - update_start
        if self.dist.is_main:
            self.logger.log_traces(epoch, rows.records(self.train_items, groups, advantages))
        metrics = {
            **rows.metrics(capability(self.credit, "marks_turning_points")),
            "nfe_per_traj": batch.cost.nfe + self.prompts.nfe_per_traj(plan),  # the prompt policy's samples too
            "model_s": batch.cost.model_s,
            "decode_s": sum(s.decode_s for s in sampled.scored),
            "reward_s": sum(s.reward_s for s in sampled.scored),
            "sample_s": sampled.seconds,
            "score_wait_s": sampled.wait_s,
            "update_s": update_s,
            **update,
            **self.prompts.observe(plan, items, groups, rows.trace[:, -1]),  # sets aside what the epoch solved
        }
        if self.credit.needs_completions and not capability(self.epoch_sampler.plan, "branches"):
            # column 0 is the pure-ODE baseline R_0; a branching plan's column 0 is its first child, no baseline
            metrics["baseline_reward_mean"] = float(rows.trace[:, 0].mean())
        metrics.update(sampled.reward_details(self.dist))
        metrics["epoch_s"] = time.perf_counter() - start
        return metrics

    def _sample_and_score(self, plan: EpochPlan) -> Sampled:
        """Roll out and score this process's batches of the epoch's plan (``tpflow.train.sampling``)."""
        batches = plan.local(self.dist.rank, self.dist.world_size)
        return self.epoch_sampler(plan, batches, self._phase, self._advance)

    def _update(self, epoch: int, batch: Rollout, advantages: torch.Tensor) -> dict[str, float]:
        """The optimizer's pass over this process's trajectories, the EMA, and the finiteness check.

        No autocast region around it: the optimizer opens one per loss (``Optimizer.bind``'s precision), so no cast
        outlives the weight changes of its steps, of the EMA or of an old-policy swap (``tpflow.precision``)."""
        self._phase(f"epoch {epoch}: updating", None)
        self._weights_ahead = True  # until fit() counts the epoch as done
        on_step = self.ema.step if self.ema is not None else None  # right after each optimizer step taken
        update = self.optimizer.update(self.backbone, self.sampler, batch, advantages, on_step=on_step)
        update = combine_update_metrics(self.dist.gather_objects([update]))
        self._check_finite(update)
        return update

    @property
    def reward(self) -> RewardModel:
        """The run's reward model, held by the epoch sampler; replacing it here (a wrapper, a probe) replaces it for
        training and evaluation alike."""
        return self.epoch_sampler.reward

    @reward.setter
    def reward(self, model: RewardModel) -> None:
        self.epoch_sampler.reward = model

    def _eval_reward(self) -> RewardModel:
        """The trained reward (whichever the run holds now), with the watched ones of ``[eval] rewards`` beside it
        (built at the first eval)."""
        if getattr(self, "_watched", None) is None:
            self._watched = build_watched(self.recipe.eval)
        return with_watched(self.reward, self.recipe.eval, self._watched)

    def _diversity_embedding(self) -> Embedder | None:
        """The embedding of ``[eval] diversity`` (tpflow.train.diversity), built at the first eval; None without."""
        spec = self.recipe.eval.diversity
        if spec is not None and getattr(self, "_embed", None) is None:
            self._embed = build_embedder(spec)
        return None if spec is None else self._embed

    def evaluate(self, epoch: int) -> dict[str, float]:
        """ODE samples of the held-out prompts (EMA weights when enabled): mean reward and per-tag accuracy
        (``tpflow.train.evaluation``)."""
        samples = len(self.test_items) * self.recipe.eval.images_per_prompt
        self._phase(f"eval at epoch {epoch}: sampling {samples} {self._sample_noun()}", None)
        swap = self.ema.swapped() if self.ema is not None else contextlib.nullcontext()
        grid = self.run_dir / "samples" / f"eval_{epoch:04d}.png"
        with swap:
            metrics = evaluate(
                self.backbone,
                self._eval_reward(),
                self.test_items,
                self.recipe.eval,
                seed=eval_seed(self.settings.seed, self.recipe.eval.seed),  # the same noise at every eval
                dist=self.dist,
                autocast=self.precision.autocast,
                grid=grid,
                policy=recipe_policy(self.settings, self.recipe.eval),
                embed=self._diversity_embedding(),
            )
        if self.eval_split != "test":
            metrics["eval_on_train_split"] = 1.0  # no held-out prompts (warned at the start)
        for warning in guard_lines(self._first_eval, self.last_eval, metrics) if self.dist.is_main else []:
            self.console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
        self._first_eval = self._first_eval or {**metrics, "last_eval_epoch": epoch}  # this process's first
        self.logger.track(metrics, step=self.optimizer.global_step)  # the step of the weights evaluated
        self.logger.log_image("eval_samples", grid, step=self.optimizer.global_step)
        return metrics

    def _sample_noun(self) -> str:
        """What the eval's progress line counts: clips for a video backbone, whose one sample's latents have a frame
        axis (``latent_shape``: (F, C, H, W) or (C, F, h, w), against an image's (C, H, W)), else images."""
        shape = capability(self.backbone, "latent_shape")
        return "clips" if callable(shape) and len(shape()) == 4 else "images"

    def _phase(self, description: str, total: int | None) -> None:
        self._description = description  # what an out-of-memory error names
        if self._progress is not None:
            self._progress.phase(description, total)

    def _advance(self) -> None:
        """After each rollout batch and each scored batch (the same number on every process): a safe point."""
        if self._progress is not None:
            self._progress.advance()
        self._stop_point()

    def _check_finite(self, update: dict[str, float]) -> None:
        if update.get("nonfinite_losses", 0) > 0:
            self.nonfinite_epochs += 1
            rows = int(update["nonfinite_losses"])  # rows, as rows_trained counts them (tpflow.optim.loop)
            self.console.print(f"[yellow]warning:[/] non-finite losses skipped ({rows} rows).")
            if self.nonfinite_epochs >= MAX_NONFINITE_EPOCHS:
                raise UserError(
                    f"Non-finite losses in {MAX_NONFINITE_EPOCHS} epochs in a row: the run stops. Lower "
                    "optimizer.learning_rate (or another of the optimizer's step sizes: `tpflow components "
                    "optimizer` lists them), then resume from the last checkpoint."
                )
        else:
            self.nonfinite_epochs = 0
