"""Which checkpoint a run resumes from, decided before any model is built.

``tpflow train`` without ``--resume`` refuses a run dir that holds checkpoints and starts the logs of a dead attempt
(one that wrote none) afresh; bare ``--resume`` continues only from the run dir's own checkpoints (a newest one that
links elsewhere is refused); ``--resume PATH`` names any checkpoint. The stored recipe is compared with this one:
what the checkpoint's adapter cannot follow is refused, every other change is listed and applies from here on.
The trainer then puts the states in place (``RunCheckpoints.restore``), inside ``restoring``: a checkpoint that does
not fit the model or optimizer built from this recipe is one paragraph (CheckpointError), any other exception is a
bug and propagates with its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from safetensors import SafetensorError

from tpflow.errors import UserError
from tpflow.recipe import FIXED_ON_RESUME, Recipe, recipe_changes
from tpflow.train.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    prune_checkpoints,
)
from tpflow.train.run_logger import start_clean


def checkpoint_to_resume(
    run_dir: Path, resume: bool | Path, recipe: Recipe, console: Console, is_main: bool = True
) -> Checkpoint | None:
    """The checkpoint ``resume`` names, verified and read (small files, CPU tensors), with the recipe changes
    checked against it; None for a fresh start (whose run dir must hold no checkpoint). Runs before any model is
    built, so a refused resume costs no weight loading. ``is_main``: this process tidies a dead attempt's logs, and
    prunes the run's checkpoints older than the one resumed to ``train.keep_checkpoints``, as its save did (a save
    killed while it pruned is completed here, also for a finished run, which saves nothing more)."""
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
    if is_main and path.resolve().parent == own:  # the run's own checkpoint (not a warm start from another run's)
        prune_checkpoints(run_dir, ckpt.step, recipe.train.keep_checkpoints)  # completes a prune a kill interrupted
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
    epochs = [(a, b) for k, a, b in changes if k == "train.epochs"]
    if epochs:  # more epochs is what resuming is for: said in one line, not warned
        console.print(f"note: train.epochs {epochs[0][0]} in the run, {epochs[0][1]} now: the resumed run trains "
                      f"to epoch {epochs[0][1]}.", soft_wrap=True, highlight=False)  # fmt: skip
    shown = [(k, a, b) for k, a, b in changes if k != "train.epochs"]
    if shown:
        listed = "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in shown)
        console.print(
            f"[yellow]warning:[/] resuming with a recipe that differs from the checkpoint's: {escape(listed)}. "
            f"The new values apply from epoch {ckpt.train_state.get('epoch')} on and are what later checkpoints "
            "record.",
            soft_wrap=True,
            highlight=False,
        )


# What torch says when a state dict belongs to another model or optimizer: nn.Module.load_state_dict (peft's
# set_peft_model_state_dict too) on a shape mismatch or missing keys, Optimizer.load_state_dict on other groups.
_MISFIT = (
    "Error(s) in loading state_dict",
    "size mismatch for",
    "different number of parameter groups",
    "doesn't match the size of optimizer's group",
)


@contextlib.contextmanager
def restoring(path: Path) -> Iterator[None]:
    """Around putting checkpoint ``path``'s states into the built components: a component's UserError (a changed
    LoRA rank, a key the state lacks) or torch's refusal of a state dict that does not fit becomes one CheckpointError
    paragraph; any other exception is a bug in tpflow or a plugin (an OOM, an AttributeError) and propagates as it
    is, with its traceback and a note naming the checkpoint."""
    try:
        yield
    except UserError as exc:  # the component's own message
        raise CheckpointError(f"Cannot resume from checkpoint {path}: {exc}") from None
    except Exception as exc:
        if not does_not_fit(exc):
            exc.add_note(
                f"tpflow: raised while restoring checkpoint {path}. This is a bug in tpflow or a plugin, not a "
                "checkpoint that does not fit the recipe: please report it with this traceback."
            )
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"Cannot resume from checkpoint {path}: it does not fit this recipe's model and optimizer "
            f"({type(exc).__name__}: {reason[:300]}). Resume from a checkpoint this recipe wrote."
        ) from None


def does_not_fit(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's (or safetensors') refusal of state that belongs to another model or optimizer,
    rather than a bug."""
    if isinstance(exc, SafetensorError):  # an adapter file that is not one (re-signed by hand)
        return True
    return isinstance(exc, (RuntimeError, ValueError)) and any(text in str(exc) for text in _MISFIT)


def train_command(recipe: Recipe, run_dir: Path, resume: bool, extra: Sequence[str] = ()) -> str:
    """The ``tpflow train`` command line that runs ``recipe`` as it was started, every ``--set`` included (a
    dropped ``--epochs`` would resume to the file's epoch count), into ``run_dir``; ``--resume`` to continue it.
    ``extra``: more arguments (``--num-processes N``)."""
    import shlex

    sets = [arg for value in recipe.overrides for arg in ("--set", value)]
    resuming = ["--resume"] if resume else []
    where = str(recipe.path) if recipe.path is not None else "RECIPE"
    return shlex.join(["tpflow", "train", where, *sets, *extra, *resuming, "--run-dir", str(run_dir)])


def continue_hint(recipe: Recipe, run_dir: Path, extra: Sequence[str] = ()) -> str:
    """What to run after an interruption: resume from the newest checkpoint, or, when none was written yet, the
    command that starts the run again (the trainer tidies a dead attempt's logs)."""
    saved = run_dir.exists() and find_checkpoint(run_dir)[0] is not None
    if saved:
        return f"Resume with: {train_command(recipe, run_dir, True, extra)}"
    return (f"Nothing was saved yet (no checkpoint in {run_dir}); start the run again with: "
            f"{train_command(recipe, run_dir, False, extra)}")  # fmt: skip
