"""What ``tpflow train`` shows between epoch lines: a bar on a terminal, timed lines in a log file.

On a terminal the phase (sampling, scoring, updating, eval) runs on a transient rich bar. Without one (nohup, a
SLURM log, a pipe) rich draws nothing, and an epoch of a large model was minutes of silence that looks like a hang;
so a background thread prints the phase, its count and its seconds every ``interval_s`` seconds, as ``tpflow
sweep`` prints a line per finished run. Short phases print nothing: the epoch line follows them anyway.
"""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class PhaseProgress:
    """``phase(description, total)`` starts a phase, ``advance()`` counts one unit of it; ``start``/``stop`` bracket
    the run. Silent on every process but the main one (``enabled``)."""

    def __init__(self, console: Console, enabled: bool, interval_s: float) -> None:
        self.console, self.interval_s = console, interval_s
        on_terminal = console.is_terminal
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True,
                            disable=not (on_terminal and enabled))  # fmt: skip
        self.task = self.bar.add_task("starting", total=None)
        self.lines = enabled and not on_terminal and interval_s > 0
        self.description, self.total, self.done = "starting", None, 0  # the phase the lines report
        self.since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(self, description: str, total: int | None) -> None:
        self.bar.update(self.task, description=description, total=total, completed=0)
        with self._lock:
            self.description, self.total, self.done, self.since = description, total, 0, time.monotonic()

    def advance(self) -> None:
        self.bar.advance(self.task)
        with self._lock:
            self.done += 1

    def start(self) -> None:
        self.bar.start()
        if self.lines and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._print_lines, name="tpflow-phase-lines", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.bar.stop()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def line(self) -> str:
        """The line a log gets now: ``HH:MM:SS epoch 3: sampling 5/12, 41 s``."""
        with self._lock:
            count = f" {self.done}/{self.total}" if self.total else ""
            seconds = time.monotonic() - self.since
            return f"{time.strftime('%H:%M:%S')} {self.description}{count}, {seconds:.0f} s"

    def _print_lines(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.console.print(self.line(), highlight=False, soft_wrap=True)
