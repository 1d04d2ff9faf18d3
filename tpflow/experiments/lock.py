"""Pre-registration by construction: the experiment file as it was when the first run began, and every amendment.

The sweep's first call writes ``<out>/registration.json``: the file's SHA-256 and text, its git commit when it is in
a repository, the time. Every later call compares the file with it. A changed file is refused (exit 2) unless the
change is declared with ``--amend "reason"``, which records the reason, the time, the new hash and the runs that
existed then; ``tpflow compare`` prints every amendment. So what the evidence sections of docs/results.md did by
discipline (a protocol commit before the runs, amendments recorded with the runs that existed), the tool does.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from tpflow.errors import UserError

NAME = "registration.json"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _git_commit(path: Path) -> str | None:
    """The commit of the repository holding ``path`` when the file is tracked and unchanged there, else None."""
    try:
        folder = path.resolve().parent
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", path.name],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or dirty.returncode != 0 or dirty.stdout.strip():
        return None
    return head.stdout.strip()


def uncommitted_warning(experiment_path: Path, record: dict) -> str | None:
    """A sentence when the registration holds no commit: the runs are then tied to the file's text, not to the code
    that made them (a reviewer cannot check out the protocol); None when it has one."""
    if record.get("git_commit"):
        return None
    path = Path(experiment_path)
    folder = str(path.resolve().parent)
    try:
        inside = subprocess.run(["git", "-C", folder, "rev-parse", "--git-dir"], capture_output=True, timeout=10)
        last = subprocess.run(["git", "-C", folder, "log", "-1", "--format=%H", "--", path.name], capture_output=True,
                              timeout=10)  # fmt: skip
        committed = bool(last.stdout.strip())
        why = ("is not in a git repository" if inside.returncode != 0 else "is not committed" if not committed
               else "had uncommitted changes")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        why = "could not be looked up in git (no git on this machine)"
    return (
        f"{path} {why} when it was registered ({record['registered']}), so registration.json records its text "
        "and hash but no git commit: the runs are not tied to the code that made them. Commit the experiment "
        "file and the code before the first run (a new out folder registers afresh)."
    )


def _write(path: Path, data: dict) -> None:
    """Atomically: a temporary file in the folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".registration.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read(out: Path) -> dict | None:
    path = Path(out) / NAME
    return json.loads(path.read_text()) if path.exists() else None


def register(experiment_path: Path, out: Path, existing_runs: list[str], amend: str | None = None) -> dict:
    """Record the experiment file before the first run, or check it against the record; ``amend`` declares a change
    (recorded with ``existing_runs``, the runs that exist now). Returns the record. UserError for an undeclared
    change, or for ``--amend`` with nothing changed."""
    text = Path(experiment_path).read_text()
    record = read(out)
    now = time.strftime("%Y-%m-%d %H:%M:%S %z")
    if record is None:
        record = {"sha256": _sha(text), "text": text, "git_commit": _git_commit(Path(experiment_path)),
                  "registered": now, "amendments": []}  # fmt: skip
        _write(Path(out) / NAME, record)
        return record
    if record["sha256"] == _sha(text):
        if amend:
            raise UserError(f"--amend {amend!r}: {experiment_path} has not changed since it was registered, so there "
                            "is nothing to amend. Drop --amend.")  # fmt: skip
        return record
    if not amend:
        raise UserError(
            f"{experiment_path} changed after its runs began (registered {record['registered']}, "
            f"{len(existing_runs)} runs exist in {out}). A pre-registered experiment is not edited silently: revert "
            'the change, or declare it with --amend "why", which records it with the runs that exist now.'
        )
    record["amendments"].append({"time": now, "reason": amend, "sha256": _sha(text), "text": text,
                                 "runs_existing": sorted(existing_runs)})  # fmt: skip
    record["sha256"] = _sha(text)
    _write(Path(out) / NAME, record)
    return record
