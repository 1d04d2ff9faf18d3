"""Atomic, verifiable checkpoints: ``run_dir/checkpoints/<step:08d>/``.

A checkpoint is written into ``checkpoints/.tmp-<step>-<pid>/`` (adapter, optimizer, EMA, RNG states, train state,
recipe), every file is fsynced, ``manifest.json`` (size and sha256 of every file) is written last, and only then is
the directory renamed to its final name; the ``checkpoints`` folder is then fsynced before anything older is pruned
(a power cut cannot lose the new checkpoint and the pruned ones both). A crash or a full disk therefore never leaves
a half-written ``<step>`` directory, and a checkpoint damaged later (truncated copy, flipped bytes) fails its manifest
check: ``find_checkpoint`` reports it and falls back to the previous one. Pruning renames a checkpoint out of the
step-numbered names before deleting it, so a kill mid-prune leaves a ``.pruned-*`` folder (removed at the next start),
never a half-deleted ``<step>``; and a resume prunes as its save would have (``prune_checkpoints``), so a prune that a
kill interrupted is completed even when the resumed run has nothing left to train. Everything is read back with
``torch.load(weights_only=True)``, safetensors or JSON; no arbitrary object is ever unpickled. A sharded run's
checkpoint holds ``shards/`` (every process's own safetensors file) and ``layout.json`` in place of the adapter
folder (``tpflow.train.checkpoints.shards``), under the same manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import Tensor

from tpflow.errors import UserError
from tpflow.train.checkpoints.files import (
    MANIFEST,
    _fsync_dir,
    _install,
    _numbered,
    _seal,
    _sync,
    _tidy,
    _verify,
    _write,
)


class CheckpointError(UserError):
    """A checkpoint that cannot be written, or one that is missing, truncated or corrupted."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint, loaded onto the CPU."""

    path: Path
    step: int
    adapter_dir: Path  # pass to Backbone.load_adapter
    optimizer_state: dict
    ema_state: dict[str, Tensor] | None
    rng_state: dict
    train_state: dict  # epoch, global_step, ...
    recipe: dict
    # a sharded checkpoint's layout.json (tpflow.train.checkpoints.shards): its weights, moments and EMA are in
    # shards/, and optimizer_state holds markers in their place; None for the unsharded format
    layout: dict | None = None
    # the replay buffer's rows (replay.safetensors; tpflow.train.replay), None where the run replays nothing
    replay_state: dict[str, Tensor] | None = None

    def load_weights(self, backbone: Any) -> None:
        """The trained weights (adapter, or a full fine-tune's transformer) into ``backbone``, whichever format."""
        if self.layout is None:
            backbone.load_adapter(self.adapter_dir)
        else:
            from tpflow.train.checkpoints.shards import load_weights

            try:
                load_weights(backbone, self.path, self.layout)
            except CheckpointError:
                raise
            except UserError as exc:  # its own sentence, named
                raise CheckpointError(f"Cannot load the weights of checkpoint {self.path}: {exc}") from None

    def full_ema(self) -> dict[str, Tensor] | None:
        """The EMA as whole CPU tensors (a sharded checkpoint's read from its shards), None if the run kept none."""
        if self.layout is None:
            return self.ema_state
        from tpflow.train.checkpoints.shards import full_ema

        return full_ema(self.path, self.layout)


def capture_rng_state() -> dict:
    """The global RNG states (Python, NumPy, torch CPU, CUDA when present), in a form ``save_checkpoint`` stores."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``, for a state read back by ``load_checkpoint``; UserError when it lacks one
    of the states ``capture_rng_state`` always writes."""
    missing = [key for key in ("python", "numpy", "torch") if not isinstance(state, dict) or key not in state]
    if missing:
        raise UserError(f"its RNG state (rng.pt) lacks {', '.join(map(repr, missing))}.")
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # Per GPU; a run resumed on fewer or more GPUs restores those present (tpflow draws its noise on the CPU, so
        # the trajectories do not depend on these states: tpflow/devices.py).
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    backbone: Any,
    optimizer_state: dict,
    ema_state: dict[str, Tensor] | None,
    rng_state: dict,
    train_state: dict,
    recipe: dict,
    keep_last: int = 3,
    staged: Path | None = None,
    layout: bytes | None = None,
    replay_state: dict[str, Tensor] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/<step:08d>/`` atomically, then keep only the newest ``keep_last`` valid ones
    (``keep_last = 0``: keep them all; ``train.keep_checkpoints``).

    ``rng_state`` may nest dicts, lists and tuples of None, bool, int, float, str, tensors and NumPy arrays or
    scalars (converted to tensors / Python scalars so that ``weights_only`` loading accepts them; tuples stay tuples).
    An existing checkpoint of the same step is replaced (old moved aside, new renamed in, old deleted). Checkpoints
    of later steps (from an abandoned run) are never pruned, nor is the one just written.

    A sharded checkpoint (tpflow.train.checkpoints.shards): ``staged`` is the folder from :func:`stage_checkpoint`
    into which every process has written its shards, ``layout`` the bytes of its ``layout.json``, ``backbone`` None
    (no adapter folder: the weights are among the shards).

    Raises:
        CheckpointError: on an I/O error (disk full, permissions); the temp dir is removed, older checkpoints intact.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0: keep every checkpoint), got {keep_last}.")
    root = Path(run_dir) / "checkpoints"
    final = root / f"{step:08d}"
    tmp = staged if staged is not None else root / f".tmp-{step}-{os.getpid()}"
    # Serialize the small parts before touching the disk: a bad value raises here and leaves nothing behind.
    small = _small_files(rng_state, train_state, recipe, ema_state)
    if replay_state:  # the replay buffer's rows: written and sealed with the rest, atomically
        small["replay.safetensors"] = safetensors.torch.save(replay_state)
    if layout is not None:
        small["layout.json"] = layout
    try:
        if staged is None:
            stage_checkpoint(run_dir, step)
        if backbone is not None:
            backbone.save_adapter(tmp / "adapter")
        with open(tmp / "optimizer.pt", "wb") as f:
            torch.save(optimizer_state, f)
            _sync(f)
        for name, data in small.items():
            _write(tmp / name, data)
        _seal(tmp, step)
        _install(tmp, final)  # renamed in and the folder fsynced: durable before any older one is pruned
    except (OSError, SafetensorError) as err:  # safetensors reports I/O errors (a full disk) as its own type
        shutil.rmtree(tmp, ignore_errors=True)
        previous, _ = find_checkpoint(Path(run_dir))
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "there is no previous checkpoint"
        raise CheckpointError(
            f"Could not save checkpoint {final.name} in run dir {run_dir}: {err}. Nothing partial was left behind and "
            f"{kept}; free some disk space (or fix the permissions) and resume with `tpflow train RECIPE --resume`."
        ) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(run_dir, step, keep_last)
    return final


def stage_checkpoint(run_dir: Path, step: int) -> Path:
    """Create (empty) the temp folder ``save_checkpoint`` writes checkpoint ``step`` into, after removing the temp
    folders of dead writers. A sharded save stages it on the main process, every process writes its shards into it,
    then the main process's ``save_checkpoint(staged=...)`` completes, seals and installs it."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp-{step}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    _tidy(root)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _small_files(
    rng_state: dict, train_state: dict, recipe: dict, ema_state: dict[str, Tensor] | None
) -> dict[str, bytes]:
    """The checkpoint's files other than the adapter and the optimizer, as bytes (file name -> contents): made in
    memory first, so that a value that cannot be stored raises before ``save_checkpoint`` writes anything."""
    small = {
        "rng.pt": _torch_bytes(_plain(rng_state)),
        "state.json": json.dumps(train_state, indent=2, sort_keys=True).encode(),
        "recipe.json": json.dumps(recipe, indent=2, sort_keys=True).encode(),
    }
    if ema_state is not None:
        small["ema.safetensors"] = safetensors.torch.save(
            {k: v.detach().cpu().contiguous() for k, v in ema_state.items()}
        )
    return small


def prune_checkpoints(run_dir: Path, step: int, keep_last: int) -> None:
    """Keep checkpoint ``step`` and the newest ``keep_last - 1`` valid ones before it; delete the older or invalid
    ones before it (``keep_last = 0``: delete none). Later steps are never touched (a rewind parks them instead).

    ``save_checkpoint`` calls it after each save, and a resume from one of the run's own checkpoints calls it too
    (``tpflow.train.checkpoints.resume``): a kill while the final save pruned would otherwise leave the old
    checkpoints for good, since a finished run that resumes saves nothing and so never prunes again. Crash-safe:
    each checkpoint to delete is first renamed to ``.pruned-<step>-<pid>`` (atomic, and no longer a step number, so
    never picked to resume from), the folder is fsynced, and only then is it deleted; a kill during the deletion
    leaves a ``.pruned-*`` folder that the next start removes (``_tidy``)."""
    if keep_last <= 0:  # 0: keep every checkpoint (a negative value is refused by save_checkpoint and the recipe)
        return
    root = Path(run_dir) / "checkpoints"
    kept, doomed = 1, []
    for s, p in reversed(_numbered(root)):
        if s >= step:
            continue
        if kept < keep_last and _verify(p) is None:
            kept += 1
        else:
            doomed.append(p)
    marked = []
    for p in doomed:
        target = root / f".pruned-{p.name}-{os.getpid()}"
        with contextlib.suppress(OSError):  # gone already (another tidy): nothing to delete
            os.rename(p, target)
            marked.append(target)
    if marked:
        _fsync_dir(root)
    for p in marked:
        shutil.rmtree(p, ignore_errors=True)


def park_newer(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoints of ``run_dir`` newer than ``step`` to ``checkpoints/abandoned-<step>/``; returns where.

    A run resumed from an older checkpoint (a rewind) abandons the newer ones: left in place, a later bare
    ``--resume`` or ``tpflow eval RUN`` would pick them. Parked under a name that is not a step number, they are
    ignored by both (and never pruned) but kept for the user to inspect or delete. Valid or not, every newer one moves.
    """
    root = Path(run_dir) / "checkpoints"
    parked = []
    for s, path in _numbered(root):
        if s <= step:
            continue
        target, n = root / f"abandoned-{path.name}", 1
        while target.exists():  # rewound past the same step twice
            n += 1
            target = root / f"abandoned-{path.name}-{n}"
        os.rename(path, target)
        parked.append(target)
    if parked:
        _fsync_dir(root)
    return parked


def find_checkpoint(path: Path) -> tuple[Path | None, list[str]]:
    """The newest valid checkpoint under a run dir (or the given checkpoint dir itself), and what was skipped.

    Returns:
        ``(checkpoint dir or None, warnings)``: one human-readable warning per newer checkpoint that was skipped.
    """
    path = Path(path)
    if not path.is_dir():
        return None, [f"no checkpoint: {path} is not a directory"]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if root.name != "checkpoints":  # a checkpoint dir itself, or a run dir that has none yet
        if not ((path / MANIFEST).exists() or path.name.isdigit()):
            return None, []
        reason = _verify(path)
        return (None, [f"checkpoint {path.name} {reason}"]) if reason else (path, [])
    _tidy(root)
    skipped = []
    for _, candidate in reversed(_numbered(root)):
        reason = _verify(candidate)
        if reason is None:
            return candidate, [f"checkpoint {name} {why}; using {candidate.name}" for name, why in skipped]
        skipped.append((candidate.name, reason))
    return None, [f"checkpoint {name} {why}; no older valid checkpoint" for name, why in skipped]


def load_checkpoint(path: Path) -> Checkpoint:
    """Verify and load a checkpoint directory (tensors on the CPU).

    Raises:
        CheckpointError: if the directory is not a checkpoint, or is incomplete, truncated or corrupted.
    """
    path = Path(path)
    reason = _verify(path)
    if reason:
        raise CheckpointError(
            f"Cannot load checkpoint {path}: it {reason}. Pass a run dir to resume from its newest "
            "valid checkpoint instead."
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        ema, replay = path / "ema.safetensors", path / "replay.safetensors"
        from tpflow.train.checkpoints.shards import read_layout

        ckpt = Checkpoint(
            path=path,
            step=int(manifest["step"]),
            adapter_dir=path / "adapter",
            optimizer_state=torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True),
            ema_state=safetensors.torch.load_file(ema) if ema.exists() else None,
            rng_state=torch.load(path / "rng.pt", map_location="cpu", weights_only=True),
            train_state=json.loads((path / "state.json").read_text()),
            recipe=json.loads((path / "recipe.json").read_text()),
            layout=read_layout(path),
            replay_state=safetensors.torch.load_file(replay) if replay.exists() else None,
        )
    except Exception as err:  # a file that passed its checksum but does not parse: written by something else
        raise CheckpointError(f"Cannot load checkpoint {path}: {type(err).__name__}: {err}") from err
    state = ckpt.train_state
    bad = [
        f"{key} = {state[key]!r}" if key in state else f"no {key}"
        for key in ("epoch", "global_step")
        if isinstance(state, dict) and (key in state or key == "epoch")  # the epoch to resume at is required
        and (not isinstance(state.get(key), int) or isinstance(state[key], bool) or state[key] < 0)
    ]  # fmt: skip
    if not isinstance(state, dict) or bad:
        what = ", ".join(bad) if bad else f"a {type(state).__name__}, not an object"
        raise CheckpointError(
            f"Cannot load checkpoint {path}: its state.json holds {what}; epoch and global_step must be whole numbers "
            ">= 0. The checkpoint was not written by tpflow (or was edited); resume from another one."
        )
    return ckpt


def _plain(obj: Any) -> Any:
    """``obj`` with NumPy arrays/scalars turned into tensors/Python scalars; TypeError for anything else unusual."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str, Tensor)):
        return obj
    raise TypeError(f"RNG state entry of type {type(obj).__name__} cannot be stored safely; pass tensors or lists.")


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
