"""Run logs: ``metrics.jsonl`` and ``traces.jsonl`` in the run dir, the trackers, a one-line epoch summary.

Each JSONL file is opened in append mode for every write and flushed line by line, so a killed run keeps what it
logged, and ``truncate_after`` (used on resume) may replace the files at any time without a stale handle. Non-finite
floats are written as ``null`` so that every line stays valid JSON. TensorBoard and W&B get the same scalars through
``tpflow.train.trackers`` (accelerate's tracker API), when the recipe's ``[log] trackers`` names them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpflow.train.trackers import Trackers

RESERVED = ("epoch", "step", "time")
_FILES = ("metrics.jsonl", "traces.jsonl")


class RunLogger:
    """Appends metrics and trajectory traces to the run dir, and sends the scalars and images to the trackers.

    Args:
        run_dir: the run directory (created if missing).
        trackers: the run's experiment trackers (``Trackers``), or None for the JSONL files alone.
    """

    def __init__(self, run_dir: Path, trackers: Trackers | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.traces_path = self.run_dir / "traces.jsonl"
        self.trackers = trackers

    def log(self, metrics: dict[str, float], step: int, epoch: int, untracked: Collection[str] = ()) -> None:
        """Append ``{"epoch", "step", "time", **metrics}`` to metrics.jsonl; send the scalars to the trackers, but
        for the names in ``untracked`` (figures sent already, at the step they belong to: see ``track``)."""
        clash = [k for k in metrics if k in RESERVED]
        if clash:
            raise ValueError(f"Metric names {clash} are reserved for the record's own fields {list(RESERVED)}.")
        record = {"epoch": epoch, "step": step, "time": time.time(), **metrics}
        _append(self.metrics_path, [record])
        self.track({"epoch": epoch, **{k: v for k, v in metrics.items() if k not in untracked}}, step)

    def track(self, metrics: dict[str, float], step: int) -> None:
        """Scalars for the trackers alone (an evaluation, at the step of the weights it evaluated)."""
        if self.trackers is not None:
            self.trackers.log(metrics, step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        """An image file already written (an evaluation grid) to the trackers that take images."""
        if self.trackers is not None:
            self.trackers.log_image(name, path, step)

    def log_traces(self, epoch: int, records: list[dict]) -> None:
        """Append one line per trajectory record (prompt, tag, trace, step_rewards, turning_points, delta, ...)."""
        _append(self.traces_path, [{"epoch": epoch, **r} for r in records])

    def close(self) -> None:
        """Flush and close the trackers (the JSONL files are never left open)."""
        if self.trackers is not None:
            self.trackers.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullLogger:
    """What processes other than the main one log to: nothing (the main process writes the gathered figures)."""

    def log(self, metrics: dict[str, float], step: int, epoch: int, untracked: Collection[str] = ()) -> None:
        pass

    def track(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_image(self, name: str, path: Path, step: int) -> None:
        pass

    def log_traces(self, epoch: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSONL file, skipping blank lines and lines cut short by a killed writer.

    A cut line is expected only at the end of a file; one elsewhere (a killed run that was resumed without
    ``truncate_after``), a line that is not UTF-8, nested too deeply to parse, or not a JSON object is skipped with a
    warning.
    """
    lines = Path(path).read_bytes().splitlines()
    records = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            warnings.warn(
                f"{path}, line {i + 1}: skipped, not UTF-8 text ({err.reason} at byte {err.start}).", stacklevel=2
            )
            continue
        except json.JSONDecodeError as err:
            if i != len(lines) - 1:
                warnings.warn(f"{path}, line {i + 1}: skipped, not valid JSON ({err}).", stacklevel=2)
            continue
        except RecursionError:
            warnings.warn(f"{path}, line {i + 1}: skipped, JSON nested too deeply.", stacklevel=2)
            continue
        if not isinstance(record, dict):
            warnings.warn(f"{path}, line {i + 1}: skipped, not a JSON object.", stacklevel=2)
            continue
        records.append(record)
    return records


def truncate_after(run_dir: Path, epoch: int) -> None:
    """Drop the lines of metrics.jsonl and traces.jsonl whose epoch is greater than ``epoch``, atomically.

    Used on resume: a run killed after logging epoch 5 but checkpointed at epoch 4 restarts from epoch 5 without
    duplicated lines. Each file is rewritten to a temp file, fsynced, then ``os.replace``d.
    """
    for name in _FILES:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        kept = [r for r in read_jsonl(path) if r.get("epoch", -1) <= epoch]
        tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(_dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def start_clean(run_dir: Path) -> bool:
    """A fresh start in a run dir that holds logs but no checkpoint (an attempt killed before its first one): remove
    its metrics, traces and TensorBoard events, so the new run's logs are its own. Returns whether there were any."""
    run_dir = Path(run_dir)
    stale = [run_dir / name for name in _FILES if (run_dir / name).exists()]
    events = run_dir / "tensorboard"
    for path in stale:
        path.unlink()
    if events.is_dir():
        shutil.rmtree(events)
        stale.append(events)
    return bool(stale)


def epoch_line(epoch: int, metrics: dict[str, Any]) -> str:
    """A compact summary: ``epoch   3 | reward 0.412 | eval@2 0.450 | tp/traj 0.31 | clip 0.02 | kl 1.2e-05 | 12.3 s``.

    Uses ``reward_mean``, ``eval_reward``, ``turning_points_per_traj``, ``clip_fraction``, ``kl`` and ``epoch_s``;
    missing (or None) ones are left out. ``eval@N``: the newest eval, made at the start of epoch N
    (``last_eval_epoch``) and repeated on each line until the next; plain ``eval`` when the epoch is not known.
    """
    at = metrics.get("last_eval_epoch")
    fields = [
        ("reward_mean", "reward {:.3f}"),
        ("eval_reward", ("eval {:.3f}" if at is None else f"eval@{int(at)} " + "{:.3f}")),
        ("turning_points_per_traj", "tp/traj {:.2f}"),
        ("clip_fraction", "clip {:.2f}"),
        ("kl", "kl {:.1e}"),
        ("epoch_s", "{:.1f} s"),
    ]
    parts = [f"epoch {epoch:3d}"]
    parts += [fmt.format(float(metrics[key])) for key, fmt in fields if metrics.get(key) is not None]
    if metrics.get("prompts_skipped"):  # the prompt policy's (tpflow.train.prompt_policy), shown when any
        parts.insert(-1 if "epoch_s" in metrics else len(parts), f"skipped {int(metrics['prompts_skipped'])}")
    return " | ".join(parts)


def fit_segments(segments: list[str], width: int, sep: str = " | ") -> str:
    """``segments`` joined by ``sep`` into lines of at most ``width`` columns, breaking only between segments (a
    value is never split across lines; a segment longer than a line gets a line of its own); continuation lines are
    indented by two spaces."""
    lines: list[str] = []
    for segment in segments:
        if lines and len(lines[-1]) + len(sep) + len(segment) <= width:
            lines[-1] += sep + segment
        else:
            lines.append(segment if not lines else "  " + segment)
    return "\n".join(lines)


def _append(path: Path, records: list[dict]) -> None:
    with open(path, "a+b") as f:  # end a line cut short by a killed writer, so that the new lines stay separate
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(_dumps(record) + "\n")
            f.flush()


def _dumps(record: dict) -> str:
    return json.dumps(jsonable(record), allow_nan=False)


def jsonable(value: Any) -> Any:
    """Any record to strict JSON values: tensors and NumPy values to lists or Python scalars, non-finite floats
    to None, tuples to lists, paths to strings."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # tensors, arrays, NumPy scalars
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
