"""Experiment trackers (TensorBoard, Weights & Biases) through accelerate's tracker API.

``metrics.jsonl`` and ``traces.jsonl`` are tpflow's own record and are always written (``RunLogger``); the trackers
named in ``[log] trackers`` get the same epoch scalars, the evaluation sample grids and the resolved recipe as the
run's config. accelerate owns the tracker objects (``Accelerator(log_with=...)``, ``init_trackers``, ``log``,
each tracker's ``finish``), so a tracker accelerate adds later needs no code here beyond its name in ``LogSettings``.

Resuming: TensorBoard appends to ``run_dir/tensorboard/<project>``; W&B continues the same run, whose id is kept in
``run_dir/wandb_run_id`` (``resume="allow"``), so a resumed run is one W&B run, not two.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from tpflow.settings import LogSettings

WANDB_ID_FILE = "wandb_run_id"


def tracker_dir(run_dir: Path) -> Path:
    """accelerate's ``logging_dir`` for a run: TensorBoard writes ``<this>/<project>``."""
    return Path(run_dir) / "tensorboard"


class Trackers:
    """The trackers of one run, started on the main process (accelerate's tracker calls are main-process only).

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``log_with=settings.trackers`` and
            ``project_dir=run_dir, logging_dir=tracker_dir(run_dir)`` (``tpflow.distributed.make_accelerator``).
        settings: the recipe's ``[log]`` section.
        run_dir: the run directory (W&B writes ``run_dir/wandb``).
        config: the resolved recipe, stored as the run's config (flattened to ``section.key`` scalars).
        resume: continue the run's W&B run (its id in ``run_dir/wandb_run_id``) rather than start a new one.
    """

    def __init__(
        self, accelerator: Any, settings: LogSettings, run_dir: Path, config: dict[str, Any], resume: bool = False
    ) -> None:
        self.accelerator = accelerator
        self.settings = settings
        self.names = list(settings.trackers)
        if not self.names:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        init_kwargs: dict[str, dict[str, Any]] = {}
        if "wandb" in self.names:
            init_kwargs["wandb"] = {
                "dir": str(run_dir),
                "name": settings.run_name or run_dir.name,
                "id": _wandb_id(run_dir, resume),
                "resume": "allow",
            }
        accelerator.init_trackers(settings.project, config=flat_config(config), init_kwargs=init_kwargs)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """The finite numeric values of ``metrics`` at ``step`` (None and non-finite values are left out)."""
        if not self.names:
            return
        scalars = {}
        for key, value in metrics.items():
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                scalars[key] = value
        if scalars:
            self.accelerator.log(scalars, step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        """One image file (a sample grid) at ``step``, to every tracker that takes images."""
        if not (self.names and self.settings.images):
            return
        from PIL import Image

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({name: pixels[None]}, step=step, dataformats="NHWC")
            elif hasattr(tracker, "log_images"):
                tracker.log_images({name: [pixels]}, step=step)

    def close(self) -> None:
        """Flush and close every tracker. Not ``accelerator.end_training()``: that also destroys the process group,
        which the other processes (and a trainer's caller) may still use."""
        if self.names:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []
            self.names = []


def flat_config(data: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """A nested recipe as ``{"section.key": value}`` with scalar values (lists become strings), which both
    TensorBoard's hparams and W&B's config accept."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is not None:
            out[name] = str(value)
    return out


def _wandb_id(run_dir: Path, resume: bool) -> str:
    """The run's W&B id: on resume the one in ``run_dir/wandb_run_id``; else (or when none is there) a new one,
    written there."""
    path = run_dir / WANDB_ID_FILE
    if resume and path.is_file():
        text = path.read_text(encoding="utf-8").strip()
        if text.isalnum():
            return text
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id
