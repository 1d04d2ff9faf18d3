"""What a stopped run says, and whether it saves (``tpflow.train.stop`` decides when it stops).

Two moments: the first SIGINT or SIGTERM (``stop_notice``, from the signal handler: where the run will stop, what
it will save, what a second signal would keep instead) and the stop itself (``interrupted``: which state is saved,
if any, and what ``--resume`` then does). Both read only a ``RunPoint``, the run's position, so the trainer keeps
the acting (saving) and these functions the wording.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from tpflow.train.stop import REPEAT_S, StopRequest, signal_name

Save = Literal["together", "main"] | None  # every process writes at a safe point, the main one alone, or none


@dataclass(frozen=True)
class RunPoint:
    """Where a run is when a signal comes."""

    epoch: int  # the next epoch to run (the one in progress)
    epochs: int  # the run's last epoch + 1
    step: int  # optimizer steps taken
    phase: str  # the progress bar's phase ("epoch 3: sampling", "eval at epoch 2: ...")
    saved: tuple[int, int] | None  # (epoch, step) of the checkpoint last written or resumed from
    weights_ahead: bool  # between an epoch's update and the count of that epoch: no state to resume from


def stop_notice(signum: int, at: RunPoint, stop: StopRequest | None) -> str:
    """What the first SIGINT or SIGTERM says (``StopRequest``; from its handler: attributes only): where the run
    stops, what it saves, and what a second signal would keep instead."""
    name, epoch, step, phase = signal_name(signum), at.epoch, at.step, at.phase
    held = at.saved is not None and at.saved[1] == step  # a stop here writes nothing (interrupted)
    keep = f"checkpoint {step:08d} already holds that state" if held else f"saving epoch {epoch}'s starting state"
    kept = at.saved
    if stop is not None and stop.saving:
        what, kept = "finishing the checkpoint being written, then stopping", (epoch, step)
    elif at.weights_ahead:
        then = f"starts at epoch {epoch + 1}" if epoch + 1 < at.epochs else "makes the final evaluation"
        what = f"finishing epoch {epoch}'s update, then saving; --resume {then}"
    elif phase.startswith("eval") and epoch >= at.epochs:
        what = "finishing the final evaluation; the run then saves and ends as it would have"
    elif phase.startswith("eval"):
        kept_eval = "it is made again on --resume" if held else "its figures saved with it"
        what = f"finishing the evaluation at epoch {epoch}, then stopping: {keep} ({kept_eval})"
    elif phase.endswith("updating"):  # the update is counted: the next safe point is the next epoch's start
        what = f"stopping before epoch {epoch}: {keep}"
    else:
        what = f"stopping after this rollout batch: {keep}; --resume samples epoch {epoch} again"
    keeps = f"keeps only checkpoint {kept[1]:08d} (epoch {kept[0]})" if kept else "keeps nothing (none written yet)"
    again = "Ctrl-C again" if signum == signal.SIGINT else f"A second {name}"
    at_once = f"{again} ({REPEAT_S:g} s or more after this one) stops at once and {keeps}"
    return f"Interrupted ({name}): {what}. {at_once}.\n"


def interrupted(
    at: RunPoint, stop: StopRequest | None, stopping: bool, sharded: bool, any_saved: bool
) -> tuple[str, Save]:
    """The line a stopped run prints and which save follows it. At a safe point (``stopping``: every process
    stopped there) the processes save together; a repeated signal (``Stopped.at_once``) writes nothing. A
    ``KeyboardInterrupt`` raised anywhere else (no signal handler of ours: another thread, a library) saves from the
    main process alone, unless the weights are part-way or the run is sharded. ``any_saved``: the run dir holds a
    checkpoint (this run's or an earlier attempt's)."""
    after = "--resume continues from the newest one" if any_saved else "none was saved before, so the run starts again"
    name = signal_name(stop.signum) if stop is not None and stop.signum else "Ctrl-C"
    if stop is not None and stop.aborted is not None:  # a repeated signal: at once, nothing more written
        kept = f"--resume continues from checkpoint {at.saved[1]:08d} (epoch {at.saved[0]})" if at.saved else after
        return f"[yellow]Stopped at once ({signal_name(stop.aborted)} again): nothing more is saved; {kept}.[/]", None
    if at.weights_ahead:  # updated (part-way, or wholly but not yet counted): not a state to resume from
        return (
            f"[yellow]Interrupted during epoch {at.epoch}'s update: no checkpoint is written (it would mix two "
            f"weight states); {after}.[/]",
            None,
        )
    if at.saved is not None and at.saved[1] == at.step:
        # No optimizer step since that checkpoint: rewriting it would change a written step's content (the newer
        # eval figures, the RNG state), and resuming from it repeats the same epochs exactly.
        return (
            f"[yellow]Interrupted ({name}): checkpoint {at.step:08d} (epoch {at.saved[0]}) already holds these "
            "weights; --resume continues from it.[/]",
            None,
        )
    if stopping:  # every process stopped at the same safe point: they write it together
        return f"[yellow]Interrupted ({name}): saving epoch {at.epoch}; --resume continues here.[/]", "together"
    if sharded:  # stopped where no handler of ours ran: the others may be anywhere
        return (
            "[yellow]Stopped at once: a sharded run's checkpoint is written by every process together, so none is "
            f"written; {after}.[/]",
            None,
        )
    return f"[yellow]Interrupted: saving epoch {at.epoch}; --resume continues here.[/]", "main"
