"""One writer per run directory: an advisory lock on ``run_dir/.lock`` held while a trainer may write there.

``tpflow train`` takes the lock before any weights load (the main process only, under a multi-process launch) and
keeps it until ``fit`` returns. A second ``tpflow train`` on the same directory meets a ``UserError`` naming the
process and host that hold it, instead of interleaving its epochs with the first run's in ``metrics.jsonl`` and
racing it for the checkpoints. The lock is ``fcntl.flock`` on an open file: the operating system drops it when the
holder exits or is killed, so a crashed run never leaves it stuck; the PID and host written into the file are only
for the message. (``flock`` is local to one machine; two machines writing one run dir on a shared file system are
not detected. Without ``fcntl``, on Windows, no lock is taken.)
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from tpflow.errors import UserError

LOCK_FILE = ".lock"


class RunDirLock:
    """The lock of one run directory; ``acquire`` creates the directory (and its parents) when missing."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise UserError saying who holds it (or why the directory is unusable)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return self
        if self._fd is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(
                f"The run dir {self.run_dir} is not usable: {exc.strerror or exc} ({exc.filename or self.path}). "
                "Pick a writable directory with --run-dir."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise UserError(
                f"The run dir {self.run_dir} is in use by another tpflow train ({holder}); two runs writing one "
                "directory would interleave their metrics and checkpoints. Wait for it to finish (or stop it), or "
                "pick another directory with --run-dir."
            ) from None
        try:
            os.ftruncate(fd, 0)
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError as exc:  # a full disk: the lock itself still holds
            os.close(fd)
            raise UserError(f"Cannot write the run dir lock {self.path}: {exc.strerror or exc}.") from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; its content is stale from now on)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not isinstance(info, dict) or "pid" not in info:
        return "holder unknown"
    started = info.get("started")
    since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, float) else ""
    return f"PID {info.get('pid')} on host {info.get('host', '?')}{since}"
