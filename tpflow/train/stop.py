"""Ctrl-C in a run of several processes: they stop together at a safe point, then save together.

A sharded run's checkpoint is written by every process (its shards, or the gathered state's collectives), and any
run's last collectives need every process: a process that stops where Ctrl-C finds it leaves the others waiting
(gloo: "Connection reset by peer", a ``.tmp-*`` folder and no checkpoint; NCCL would hang). So while
:class:`StopRequest` is installed, SIGINT only records the request. The trainer asks :meth:`StopRequest.agreed` at
its safe points, where the weights are a state to resume from (after each rollout batch and scored batch, whose
sampling leaves the weights as the epoch found them; before each epoch; before the final evaluation): one
all-reduce of one number, the same answer on every process, so they stop at the same point and write the checkpoint
together. An update in progress runs to its end first (its weights, part-way, are no state to resume from).

Ctrl-C in a terminal reaches every process twice (from the terminal, and from the launcher, which passes on what it
gets): a SIGINT within ``REPEAT_S`` of the first is the same request. A later one stops the process at once,
without saving (``KeyboardInterrupt``), as a second Ctrl-C does; so does the launcher, which waits
``tpflow.launch.STOP_WAIT_S`` for its processes before it kills them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

REPEAT_S = 2.0  # a SIGINT this soon after the first one repeats it (the terminal's and the launcher's copies)


NOTICE = (
    "Interrupted: the processes stop together at the next safe point (after this rollout batch, or after the update "
    "in progress) and save; Ctrl-C again to stop at once without saving.\n"
)


class StopRequest:
    """SIGINT recorded, not raised, in the main thread between :meth:`install` and :meth:`remove` (a no-op on one
    process, where Ctrl-C raises ``KeyboardInterrupt`` at once and the main process saves alone). The main process
    says what happens next when the first SIGINT comes (on standard output, with one ``os.write``: a handler that
    printed through Python's buffered streams could land inside the program's own write to them and fail)."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist
        self.requested_at: float | None = None
        self._installed, self._previous = False, None

    def install(self) -> None:
        if self.dist.enabled and threading.current_thread() is threading.main_thread():
            self._installed, self._previous = True, signal.signal(signal.SIGINT, self._on_sigint)

    def remove(self) -> None:
        if self._installed:  # None: a handler not set from Python; Python's own then
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False

    def agreed(self) -> bool:
        """Whether any process was asked to stop (a collective: every process calls it at the same point)."""
        return self.dist.enabled and self.dist.max(float(self.requested_at is not None)) > 0

    def _on_sigint(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at = now
            if self.dist.is_main:
                with contextlib.suppress(OSError, ValueError):
                    os.write(sys.stdout.fileno(), NOTICE.encode())
        elif now - self.requested_at > REPEAT_S:
            raise KeyboardInterrupt
