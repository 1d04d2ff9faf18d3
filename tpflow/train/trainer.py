"""The TP-GRPO / Flow-GRPO training loop: ``tpflow train RECIPE [--resume]``.

One epoch (DESIGN.md §1, ALGORITHM.md §6.1):

1. draw ``prompts_per_epoch`` training prompts, G copies each, shuffled into rollout batches;
2. per rollout batch: draw the SDE window, roll out (main trajectory, ODE baseline and completions, batched per
   step), and hand the latents to the background scoring worker (decode + reward) while the next batch samples;
3. per rollout batch: the credit assigner turns the reward trace [n, W+1] into step rewards [n, W];
4. advantages per prompt and per window step over the whole epoch; the GRPO update; the EMA.

Every ``eval.every`` epochs (epoch 0 included) the EMA weights (when enabled) sample the held-out prompts by ODE.
Checkpoints are written every ``train.save_every`` epochs, at the end and on Ctrl-C. Randomness is derived from
(seed, epoch), so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from tpflow.errors import UserError
from tpflow.optim.advantages import group_advantages
from tpflow.recipe import Recipe
from tpflow.rollout import draw_window, rollout_from_settings, sample_ode
from tpflow.train.allocator import keep_freed_memory
from tpflow.train.checkpoint import (
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from tpflow.train.ema import EMA
from tpflow.train.run_logger import RunLogger, epoch_line, truncate_after
from tpflow.train.samples import save_grid
from tpflow.train.scoring import ScoringWorker
from tpflow.types import PromptItem, Rollout

MAX_NONFINITE_EPOCHS = 3  # consecutive epochs with non-finite losses before the run stops


class Trainer:
    """Builds every component of a recipe and runs its epochs; see the module docstring."""

    def __init__(
        self,
        recipe: Recipe,
        run_dir: Path | None = None,
        resume: bool | Path = False,
        console: Console | None = None,
    ) -> None:
        from accelerate import Accelerator

        self.recipe = recipe
        self.settings = t = recipe.train
        stem = recipe.path.stem if recipe.path else "run"
        self.run_dir = Path(run_dir) if run_dir else Path(t.run_dir.format(recipe=stem))
        self.console = console or Console()
        cpu = not torch.cuda.is_available()
        if cpu:
            keep_freed_memory()  # batched rollouts on CPU: avoid a page fault per 4 KiB of every big tensor
        self.accelerator = Accelerator(cpu=cpu, mixed_precision="no" if cpu else t.mixed_precision)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        self.backbone = recipe.build("backbone")
        self.sampler = recipe.build("sampler")
        self.reward = recipe.build("reward")
        self.credit = recipe.build("credit")
        self.optimizer = recipe.build("optimizer")
        dataset = recipe.build("dataset")
        self.train_items: list[PromptItem] = list(dataset.split("train"))
        test = list(dataset.split("test")) if "test" in dataset.splits else self.train_items
        self.test_items = test[: recipe.eval.num_prompts] if recipe.eval.num_prompts else test
        self.optimizer.bind(self.backbone, self.accelerator)
        params = self.backbone.trainable_parameters()
        self.ema = EMA(params, t.ema_decay, t.ema_every) if t.ema else None
        self.epoch = 0  # the next epoch to run
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self.nonfinite_epochs = 0
        self._resume(resume)
        self.logger = RunLogger(self.run_dir)

    # ---- public ------------------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Run the remaining epochs; returns the last epoch's metrics (with the last eval's)."""
        t, e = self.settings, self.recipe.eval
        self.console.print(
            f"[bold]tpflow train[/] {self.recipe.path or ''} -> {self.run_dir} | epochs {self.epoch}..{t.epochs - 1}"
            f" | credit {self.recipe.credit.name} | {len(self.backbone.trainable_parameters())} trainable tensors"
        )
        metrics: dict[str, Any] = {}
        last_eval: dict[str, float] = {}
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not self.console.is_terminal,
        )
        self._task = progress.add_task("starting", total=None)
        self._progress = progress
        try:
            progress.start()
            for epoch in range(self.epoch, t.epochs):
                if e.every and epoch % e.every == 0:
                    last_eval = self.evaluate(epoch)
                metrics = {**self.train_epoch(epoch), **last_eval}
                self.logger.log(metrics, step=self.optimizer.global_step, epoch=epoch)
                self.console.print(epoch_line(epoch, metrics))
                self.epoch = epoch + 1
                if t.save_every and self.epoch % t.save_every == 0 and self.epoch < t.epochs:
                    self.save()
            if e.every:
                last_eval = self.evaluate(t.epochs)
                self.logger.log(last_eval, step=self.optimizer.global_step, epoch=t.epochs)
                metrics.update(last_eval)
            self.save()
        except KeyboardInterrupt:
            self.console.print(f"[yellow]Interrupted: saving epoch {self.epoch} so that --resume continues here.[/]")
            self.save()
            raise
        finally:
            progress.stop()
            self.logger.close()
        return metrics

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Sample, score, assign credit, update: one epoch. Returns its metrics."""
        t, r = self.settings, self.recipe.rollout
        start = time.perf_counter()
        rng = random.Random(f"{t.seed}/{epoch}")
        generator = torch.Generator().manual_seed(t.seed * 100_003 + epoch)
        chosen = _draw(self.train_items, t.prompts_per_epoch, rng)
        order = [p for p in range(len(chosen)) for _ in range(t.group_size)]
        rng.shuffle(order)
        completions = r.completions if self.credit.needs_completions else None
        worker = ScoringWorker(self.backbone.decode, self.reward, chunk=r.max_batch or 256)
        batches, jobs = [], []
        self._phase(f"epoch {epoch}: sampling", -(-len(order) // t.rollout_batch))
        try:
            for lo in range(0, len(order), t.rollout_batch):
                idx = order[lo : lo + t.rollout_batch]
                items = [chosen[p] for p in idx]
                window = draw_window(r.num_steps, r.window_size, r.window_range, rng)
                cond = self.backbone.encode([it.prompt for it in items])
                with self.accelerator.autocast():
                    out = rollout_from_settings(
                        self.backbone, self.sampler, cond, idx, window, r, completions, generator
                    )
                prompts, metadata = [i.prompt for i in items], [i.metadata for i in items]
                jobs.append(worker.submit(out.final, out.completions, prompts, metadata, r.window_size))
                batches.append((out, idx))
                self._advance()
            self._phase(f"epoch {epoch}: scoring", len(jobs))
            scored = []
            for job in jobs:
                scored.append(job.result())
                self._advance()
        finally:
            worker.close()
        sample_s = time.perf_counter() - start
        credits = [self.credit(s.trace) for s in scored]
        step_rewards = torch.cat([c.step_rewards for c in credits])  # [N, W]
        turning = torch.cat([c.turning_points for c in credits])  # [N, W]
        trace = torch.cat([s.trace for s in scored])  # [N, W+1]
        groups = [p for _, idx in batches for p in idx]
        global_std = getattr(self.optimizer.options, "global_std", False)
        advantages = group_advantages(step_rewards, groups, global_std=global_std)
        batch = Rollout.cat([out for out, _ in batches])
        update_start = time.perf_counter()
        self._phase(f"epoch {epoch}: updating", None)
        steps_before = self.optimizer.global_step
        with self.accelerator.autocast():
            update = self.optimizer.update(self.backbone, self.sampler, batch, advantages)
        if self.ema is not None:
            for step in range(steps_before, self.optimizer.global_step):
                self.ema.step(step)
        self._check_finite(update)
        delta = trace[:, -1] - trace[:, 0]
        good = turning & (delta > 0)[:, None]
        records = [
            {
                "prompt": chosen[p].prompt,
                "tag": chosen[p].metadata.get("tag"),
                "group": p,
                "trace": trace[n].tolist(),
                "step_rewards": step_rewards[n].tolist(),
                "turning_points": turning[n].int().tolist(),
                "good_turning_points": good[n].int().tolist(),
            }
            for n, p in enumerate(groups)
        ]
        self.logger.log_traces(epoch, records)
        metrics = {
            "reward_mean": float(trace[:, -1].mean()),
            "reward_std": float(trace[:, -1].std()),
            "turning_points_per_traj": float(turning.sum(1).float().mean()),
            "good_turning_points": float(good.sum()),
            "bad_turning_points": float((turning & ~good).sum()),
            "nfe_per_traj": batch.cost.nfe,
            "model_s": batch.cost.model_s,
            "decode_s": sum(s.decode_s for s in scored),
            "reward_s": sum(s.reward_s for s in scored),
            "sample_s": sample_s,
            "update_s": time.perf_counter() - update_start,
            **update,
        }
        if completions is not None:
            metrics["baseline_reward_mean"] = float(trace[:, 0].mean())
        for name in scored[0].details:
            metrics[f"reward_{name}"] = float(torch.cat([s.details[name] for s in scored]).mean())
        metrics["epoch_s"] = time.perf_counter() - start
        return metrics

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        """ODE samples of the held-out prompts (EMA weights when enabled): mean reward and per-tag accuracy."""
        e = self.recipe.eval
        items = self.test_items
        self._phase(f"eval at epoch {epoch}: sampling {len(items)} images", None)
        generator = torch.Generator().manual_seed(self.settings.seed + 12_345)  # the same noise at every eval
        z0 = self.backbone.initial_noise(len(items), generator)
        cond = self.backbone.encode([it.prompt for it in items])
        swap = self.ema.swapped() if self.ema is not None else contextlib.nullcontext()
        with swap, self.accelerator.autocast():
            latents = sample_ode(self.backbone, cond, z0, self.backbone.sigmas(e.num_steps), e.guidance, e.batch_size)
        images = torch.cat([self.backbone.decode(part) for part in latents.split(e.batch_size)])
        out = self.reward(images, [it.prompt for it in items], [it.metadata for it in items])
        metrics = {"eval_reward": float(out.scores.float().mean())}
        for name, values in out.details.items():
            metrics[f"eval_{name}"] = float(values.float().mean())
        tags = [it.metadata.get("tag") for it in items]
        if "strict" in out.details and all(tags):
            per_tag: dict[str, list[float]] = defaultdict(list)
            for tag, ok in zip(tags, out.details["strict"].tolist(), strict=True):
                per_tag[tag].append(ok)
            for tag, oks in sorted(per_tag.items()):
                metrics[f"eval_acc_{tag}"] = sum(oks) / len(oks)
        save_grid(images[:64], self.run_dir / "samples" / f"eval_{epoch:04d}.png")
        return metrics

    def save(self) -> Path:
        """Write a checkpoint of the current state (atomic); returns its directory."""
        path = save_checkpoint(
            self.run_dir,
            self.optimizer.global_step,
            backbone=self.backbone,
            optimizer_state=self.optimizer.state_dict(),
            ema_state=self.ema.state_dict() if self.ema is not None else None,
            rng_state=capture_rng_state(),
            train_state={"epoch": self.epoch, "global_step": self.optimizer.global_step},
            recipe=self.recipe.data,
        )
        self.console.print(f"checkpoint: {path}")
        return path

    # ---- private -----------------------------------------------------------------------------------------------

    def _phase(self, description: str, total: int | None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description, total=total, completed=0)

    def _advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def _resume(self, resume: bool | Path) -> None:
        existing, _ = find_checkpoint(self.run_dir) if self.run_dir.exists() else (None, [])
        if not resume:
            if existing is not None:
                raise UserError(
                    f"Run dir {self.run_dir} already holds checkpoint {existing.name}. Continue it with --resume, "
                    "or pick another directory with --run-dir (or `--set train.run_dir=...`)."
                )
            return
        where = self.run_dir if resume is True else Path(resume)
        path, warnings = find_checkpoint(where)
        for warning in warnings:
            self.console.print(f"[yellow]warning:[/] {warning}")
        if path is None:
            raise UserError(f"No valid checkpoint to resume from in {where}.")
        ckpt = load_checkpoint(path)
        self.backbone.load_adapter(ckpt.adapter_dir)
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        if self.ema is not None and ckpt.ema_state is not None:
            self.ema.load_state_dict(ckpt.ema_state)
        restore_rng_state(ckpt.rng_state)
        self.epoch = int(ckpt.train_state["epoch"])
        truncate_after(self.run_dir, self.epoch - 1)
        self.console.print(f"resumed from {path} (epoch {self.epoch}, step {self.optimizer.global_step})")

    def _check_finite(self, update: dict[str, float]) -> None:
        if update.get("nonfinite_losses", 0) > 0:
            self.nonfinite_epochs += 1
            self.console.print(f"[yellow]warning:[/] {int(update['nonfinite_losses'])} non-finite losses skipped.")
            if self.nonfinite_epochs >= MAX_NONFINITE_EPOCHS:
                raise UserError(
                    f"Non-finite losses in {MAX_NONFINITE_EPOCHS} epochs in a row: the run stops. Lower "
                    "optimizer.learning_rate or raise optimizer.clip_range, then resume from the last checkpoint."
                )
        else:
            self.nonfinite_epochs = 0


def _draw(items: list[PromptItem], k: int, rng: random.Random) -> list[PromptItem]:
    """k distinct items when the split has that many, else k draws with repetition."""
    return rng.sample(items, k) if k <= len(items) else rng.choices(items, k=k)
