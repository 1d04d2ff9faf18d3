"""What a kill leaves of a run, made in the test's process from a finished run's copy, and the metrics two runs must
share.

A run killed after its first checkpoint leaves that checkpoint and logs that run past it (the epochs it finished
after the checkpoint). A copy of an uninterrupted run with its later checkpoints deleted is that state exactly,
without a process to kill: the tests of each optimizer's, gate's and prompt policy's resume start from it, and a
real SIGKILL is tested once (tests/test_nft_train.py).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tpflow.train.run_logger import read_jsonl

TIMING = ("_s", "time")  # metric names that measure wall time: never compared


def checkpoints(run: Path) -> list[Path]:
    """The run's installed checkpoints, oldest first (a writer's ``.tmp-*`` leftovers are not among them)."""
    found = (p for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))
    return sorted(found, key=lambda p: int(re.sub(r"\D", "", p.name)))


def what_a_kill_leaves(run: Path, into: Path, keep: int = 1) -> list[Path]:
    """A copy of ``run`` at ``into`` as a kill after its first ``keep`` checkpoints leaves it: the later checkpoints
    deleted, the logs kept whole. Returns every checkpoint the run had written (in ``into``), oldest first."""
    shutil.copytree(run, into)
    written = checkpoints(into)
    for later in written[keep:]:
        shutil.rmtree(later)
    return written


def comparable_metrics(run: Path) -> list[dict]:
    """The run's metrics.jsonl rows without their timings: what a resumed run must log exactly as the straight one."""
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in read_jsonl(run / "metrics.jsonl")]
