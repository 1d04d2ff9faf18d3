"""Ctrl-C on several processes (tpflow.train.stop): recorded, not raised, until the processes agree to stop together;
its repeat from the launcher is the same request; a later one stops at once. The 2-process run it serves is tested in
tests/test_distributed_train.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tpflow.train.stop import REPEAT_S, StopRequest


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


def test_one_process_keeps_ctrl_c_as_it_is():
    class OneProcess(TwoProcesses):
        enabled = False

    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest(OneProcess())
    stop.install()
    assert signal.getsignal(signal.SIGINT) is before and not stop.agreed()
    stop.remove()
