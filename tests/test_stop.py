"""Ctrl-C and SIGTERM (tpflow.train.stop): recorded, not raised, until the processes agree to stop together; its repeat
from the launcher is the same request; a later one stops at once. The runs it serves are tested in
tests/test_interrupt.py (1 process) and tests/test_distributed_train.py (2)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tpflow.train.stop import REPEAT_S, StopRequest

pytestmark = pytest.mark.usefixtures("sigint_not_ignored")  # a background suite ignores SIGINT


class TwoProcesses:
    """A stand-in for ``tpflow.distributed.Distributed`` on 2 processes, whose other process was not asked to stop."""

    enabled, is_main = True, False

    def max(self, value: float) -> float:
        return max(value, 0.0)


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # the handler runs in this thread, between two bytecodes


def test_ctrl_c_is_recorded_until_the_processes_agree_and_a_later_one_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(TwoProcesses())
    stop.install()
    try:
        assert not stop.agreed()
        _sigint()  # no KeyboardInterrupt: recorded
        assert stop.agreed()
        _sigint()  # the launcher's copy of the same Ctrl-C
        stop.requested_at -= REPEAT_S + 1  # a second Ctrl-C, later
        with pytest.raises(KeyboardInterrupt):
            _sigint()
    finally:
        stop.remove()
    assert signal.getsignal(signal.SIGINT) is before


def test_one_process_records_sigint_and_sigterm_too_and_an_ignored_signal_stays_ignored():
    """One process stops at a safe point as several do (it used to raise KeyboardInterrupt wherever Ctrl-C landed,
    and SIGTERM killed it): no collective, the signal to exit with kept. A signal the process ignores (a background
    job's SIGINT) stays ignored."""

    class OneProcess(TwoProcesses):
        enabled, is_main = False, True

        def max(self, value: float) -> float:
            raise AssertionError("no collective on one process")

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest(OneProcess(), notice=lambda signum: "")
    stop.install()
    try:
        assert not stop.agreed()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # else the signal would end pytest
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not the default's death
        time.sleep(0.01)
        _sigint()  # the same request: SIGTERM's status is kept
        assert stop.agreed() and stop.signum == signal.SIGTERM
    finally:
        stop.remove()
    assert {s: signal.getsignal(s) for s in before} == before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopRequest(OneProcess())
        stop.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        stop.remove()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])
