"""Ctrl-C and SIGTERM during training: the run stops at the next safe point, keeps every finished epoch, and saves.

A process that stops where a signal finds it loses the epoch in progress at best: in the middle of an update the
weights are part-way between two epochs, a state no resume could continue exactly, so nothing could be saved, and
every epoch since the last checkpoint was lost (``train.save_every`` is 10 on the shapes recipes, 60 on Wan's).
SIGTERM, what ``kill``, Slurm and Kubernetes send first, ended the run with no message at all. On several processes,
a process that stops alone leaves the others waiting in their next collective (gloo: "Connection reset by peer", a
``.tmp-*`` folder and no checkpoint; NCCL would hang), and a sharded run's checkpoint needs every process.

So while :class:`StopRequest` is installed (``Trainer.fit``, on any number of processes), SIGINT and SIGTERM only
record the request, and the main process says, once, what will happen and what a second signal would keep. The
trainer asks :meth:`StopRequest.agreed` at its safe points, where the weights are a state to resume from (after each
rollout batch and scored batch, whose sampling leaves the weights as the epoch found them; before each epoch; after
an evaluation; before the final evaluation): on several processes one all-reduce of one number, the same answer on
every process, so they stop at the same point and write the checkpoint together. An update in progress runs to its
end first, so the epoch it completes is counted and saved; an evaluation in progress too (it changes no weight, and
a checkpoint written after it keeps its figures). A checkpoint being written is always finished (:meth:`holding`).

A signal within ``REPEAT_S`` of the first is the same request (Ctrl-C in a terminal reaches every process twice:
from the terminal, and from the launcher, which passes on what it gets; Slurm signals the launcher and its
processes alike). A later one stops at once (:class:`Stopped` with ``at_once``), writing nothing, as a second Ctrl-C
does, except that a checkpoint being written is finished first; the launcher waits ``tpflow.launch.STOP_WAIT_S`` for
its processes before it kills them. A signal that the process ignores (``SIG_IGN``: a background job of a
non-interactive shell starts with SIGINT ignored) stays ignored.

A stop raises :class:`Stopped` (a ``KeyboardInterrupt``), whose ``exit_status`` is 128 + the signal's number, the
shell's convention: 130 for SIGINT, 143 for SIGTERM (of both together, as one request or on several processes,
SIGTERM's); the launcher exits with it (``tpflow.launch``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

REPEAT_S = 2.0  # a signal this soon after the first one repeats it (the terminal's and the launcher's copies)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """How a message names the signal: "Ctrl-C" for SIGINT (what a user pressed), else its name ("SIGTERM")."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Stopped(KeyboardInterrupt):
    """The run stopped on ``signum``: at a safe point (it saved), or ``at_once`` on a repeated signal (it did not).
    A ``KeyboardInterrupt``, so whatever ends a run on Ctrl-C ends it on this too; ``exit_status`` is the one to
    leave with."""

    def __init__(self, signum: int, at_once: bool = False) -> None:
        super().__init__(signal_name(signum))
        self.signum, self.at_once = int(signum), at_once

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopRequest:
    """SIGINT and SIGTERM recorded, not raised, in the main thread between :meth:`install` and :meth:`remove`.

    ``notice(signum)`` gives the text the main process writes when the first signal comes: what the run does next
    and what a second signal would keep (on standard output, with one ``os.write``: a handler that printed through
    Python's buffered streams could land inside the program's own write to them and fail). It runs inside the signal
    handler, so it only reads attributes: no lock, no I/O."""

    def __init__(self, dist: Any, notice: Callable[[int], str] | None = None) -> None:
        self.dist, self.notice = dist, notice
        self.requested_at: float | None = None
        self.signum: int | None = None  # the first signal recorded; after agreed(), the one the processes stop on
        self.aborted: int | None = None  # a repeated signal that stopped the process at once
        self.saving = False  # a checkpoint is being written: even a repeated signal waits for it (see ``saving``)
        self._pending: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers are the main thread's alone; a run in another thread keeps Python's behaviour
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:
                self._previous[signum] = previous
                signal.signal(signum, self._on_signal)

    def remove(self) -> None:
        for signum, previous in self._previous.items():  # None: a handler not set from Python; the default then
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, previous if previous is not None else default)
        self._previous = {}

    def agreed(self) -> bool:
        """Whether any process was asked to stop (on several processes a collective: every process calls it at the
        same point). When so, ``signum`` is the signal to stop on, the same on every process."""
        local = float(self.signum or 0)
        value = self.dist.max(local) if self.dist.enabled else local
        if value > 0:
            self.signum = int(value)
        return value > 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """A checkpoint write: a repeated signal inside waits for its end, then stops the process at once."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise Stopped(signum, at_once=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at, self.signum = now, signum
            if self.dist.is_main:
                self._say(signum)
        elif now - self.requested_at <= REPEAT_S:  # the same request: SIGTERM wins (the system wants the run gone)
            self.signum = max(self.signum or 0, signum)
        else:
            self.aborted = signum
            if self.saving:
                self._pending = signum
            else:
                raise Stopped(signum, at_once=True)

    def _say(self, signum: int) -> None:
        text = f"{signal_name(signum)}: the run stops at the next safe point and saves.\n"
        with contextlib.suppress(Exception):  # a notice that fails to build never turns into an exception here
            text = self.notice(signum) if self.notice is not None else text
        with contextlib.suppress(OSError, ValueError):
            os.write(sys.stdout.fileno(), text.encode())
