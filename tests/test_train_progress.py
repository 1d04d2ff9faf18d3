"""``tpflow train``'s phase lines without a terminal (tpflow.train.progress): a log file gets the phase, its count
and its seconds at a steady interval; a terminal gets the bar and no lines. The command's own lines:
tests/test_train.py::test_resuming_with_other_epochs_says_so."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from tpflow.train.progress import PhaseProgress

LINE = re.compile(r"^\d\d:\d\d:\d\d epoch 0: sampling 2/4, \d+ s$", re.MULTILINE)


def run_phase(console: Console, enabled: bool, interval_s: float) -> None:
    progress = PhaseProgress(console, enabled, interval_s)
    progress.start()
    try:
        progress.phase("epoch 0: sampling", 4)
        progress.advance()
        progress.advance()
        time.sleep(0.3)
    finally:
        progress.stop()


def test_without_a_terminal_the_phase_is_printed_at_an_interval():
    out = io.StringIO()
    run_phase(Console(file=out, force_terminal=False, width=200), enabled=True, interval_s=0.05)
    assert len(LINE.findall(out.getvalue())) >= 2  # steady: several lines over one long phase


def test_no_lines_at_interval_zero_on_other_processes_or_on_a_terminal():
    for console, enabled, interval in (
        (Console(file=io.StringIO(), force_terminal=False), True, 0.0),  # [log] progress_lines_s = 0
        (Console(file=io.StringIO(), force_terminal=False), False, 0.05),  # not the main process
        (Console(file=io.StringIO(), force_terminal=True), True, 0.05),  # a terminal: the bar shows it
    ):
        run_phase(console, enabled, interval)
        assert not LINE.search(console.file.getvalue())
