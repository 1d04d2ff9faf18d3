"""The files of a checkpoint on disk: writing and syncing them, the manifest that seals a checkpoint and the check of
it, installing a finished checkpoint under its step number, and tidying what a killed writer left behind. The
durability half of ``tpflow.train.checkpoints.format`` (its module docstring says why each step is there)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
REQUIRED = ("optimizer.pt", "rng.pt", "state.json", "recipe.json")


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        _sync(f)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _verify(path: Path) -> str | None:
    """None if ``path`` is a complete, intact checkpoint, else why not (``"is truncated (...)"``)."""
    if not (path / MANIFEST).is_file():
        return "has no manifest (an interrupted or foreign save)"
    try:
        files = {
            name: (int(e["size"]), str(e["sha256"]))
            for name, e in json.loads((path / MANIFEST).read_text())["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"has an unreadable manifest ({type(err).__name__}: {err})"
    weights = any(n.startswith("adapter/") for n in files) or (
        "layout.json" in files and any(n.startswith("shards/") for n in files)  # a sharded checkpoint's
    )
    missing = [n for n in REQUIRED if n not in files] + ([] if weights else ["adapter/"])
    if missing:
        return f"is incomplete (manifest lacks {', '.join(missing)})"
    for name, (expected_size, sha256) in files.items():
        file = path / name
        if not file.is_file():
            return f"is incomplete ({name} is missing)"
        size = file.stat().st_size
        if size != expected_size:
            kind = "truncated" if size < expected_size else "corrupted"
            return f"is {kind} ({name}: size {size} != {expected_size})"
        if _digest(file)["sha256"] != sha256:
            return f"is corrupted ({name}: sha256 mismatch)"
    return None


def _seal(tmp: Path, step: int) -> None:
    """Fsync every file under ``tmp``, then write the manifest (size and sha256 of each) and fsync the folders: the
    manifest is the last thing written, so a checkpoint that has one was complete on disk."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:  # files written by save_adapter; ours are synced already (cheap to repeat)
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    digests = {p.relative_to(tmp).as_posix(): _digest(p) for p in files}
    manifest = {"step": step, "created": time.time(), "files": digests}
    _write(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
    for d in [*sorted({p.parent for p in files}), tmp]:
        _fsync_dir(d)


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def _install(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` and fsync their folder, so the new name is on disk before anything is deleted; an
    existing ``final`` is moved aside first and deleted only once replaced."""
    if not final.exists():
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        return
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether another process with this id runs (our own leftovers are stale: one save at a time per process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return pid != os.getpid()


def _tidy(root: Path) -> None:
    """Remove temp dirs and half-pruned checkpoints of dead writers; put back a checkpoint moved aside by a replace
    that did not finish."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        kind, _, rest = p.name.partition("-")
        name, _, pid = rest.rpartition("-")
        if kind not in (".tmp", ".old", ".pruned") or not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if kind == ".old" and not (root / name).exists():
                os.rename(p, root / name)
            else:
                shutil.rmtree(p)
