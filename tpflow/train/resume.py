"""Which checkpoint a run resumes from, decided before any model is built.

``tpflow train`` without ``--resume`` refuses a run dir that holds checkpoints and starts the logs of a dead attempt
(one that wrote none) afresh; bare ``--resume`` continues only from the run dir's own checkpoints (a newest one that
links elsewhere is refused); ``--resume PATH`` names any checkpoint. The stored recipe is compared with this one:
what the checkpoint's adapter cannot follow is refused, every other change is listed and applies from here on.
The trainer then puts the states in place (``Trainer._restore``).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tpflow.errors import UserError
from tpflow.recipe import FIXED_ON_RESUME, Recipe, recipe_changes
from tpflow.train.checkpoint import Checkpoint, CheckpointError, find_checkpoint, load_checkpoint
from tpflow.train.run_logger import start_clean


def checkpoint_to_resume(
    run_dir: Path, resume: bool | Path, recipe: Recipe, console: Console, is_main: bool = True
) -> Checkpoint | None:
    """The checkpoint ``resume`` names, verified and read (small files, CPU tensors), with the recipe changes
    checked against it; None for a fresh start (whose run dir must hold no checkpoint). Runs before any model is
    built, so a refused resume costs no weight loading. ``is_main``: this process tidies a dead attempt's logs."""
    existing, _ = find_checkpoint(run_dir) if run_dir.exists() else (None, [])
    if not resume:
        if existing is not None:
            raise UserError(
                f"Run dir {run_dir} already holds checkpoint {existing.name}. Continue it with --resume, "
                "or pick another directory with --run-dir (or `--set train.run_dir=...`)."
            )
        if is_main and start_clean(run_dir):
            console.print(
                f"[yellow]note:[/] {run_dir} held the logs of an attempt that wrote no checkpoint; "
                "this run starts them afresh."
            )
        return None
    where = run_dir if resume is True else Path(resume)
    path, warnings = find_checkpoint(where)
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if path is None:
        raise UserError(f"No valid checkpoint to resume from in {where}.")
    own = (run_dir / "checkpoints").resolve()  # where save() writes, through a linked folder too
    if resume is True and not (path.resolve().is_relative_to(own) or path.resolve() == run_dir.resolve()):
        raise CheckpointError(
            f"The newest checkpoint of {run_dir}, {path}, links to {path.resolve()}, outside the run's "
            "checkpoints: --resume continues a run only from its own checkpoints. To start from another run's "
            f"checkpoint, name it: --resume {path.resolve()}."
        )
    ckpt = load_checkpoint(path)
    report_changes(ckpt, recipe, console)
    return ckpt


def report_changes(ckpt: Checkpoint, recipe: Recipe, console: Console) -> None:
    """Resuming with a recipe that differs from the checkpoint's: refuse what the checkpoint's adapter cannot
    follow (another model, another LoRA shape); say what else changed, which applies from here on (the learning
    rate and AdamW settings go into the optimizer's parameter groups, see GRPO.load_state_dict)."""
    changes, path = recipe_changes(ckpt.recipe, recipe), ckpt.path
    fixed = [(k, a, b) for k, a, b in changes if k in FIXED_ON_RESUME]
    if fixed:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in fixed)
        raise UserError(
            f"Cannot resume {path} with this recipe: {listed}. The checkpoint's adapter belongs to the model and "
            "LoRA shape it was trained with; resume with the recipe's original values, or start a new run dir."
        )
    shown = [(k, a, b) for k, a, b in changes if k != "train.epochs"]  # more epochs is what resuming is for
    if shown:
        listed = "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in shown)
        console.print(
            f"[yellow]warning:[/] resuming with a recipe that differs from the checkpoint's: {escape(listed)}. "
            f"The new values apply from epoch {ckpt.train_state.get('epoch')} on and are what later checkpoints "
            "record.",
            soft_wrap=True,
            highlight=False,
        )
