"""``tpflow export``: a trained adapter (or the merged transformer) in the form inference code loads.

The checkpoint holds the recipe it was trained with, so the backbone is rebuilt from it (its base weights must be
reachable as they were for training), the adapter loaded, and, by default, the EMA weights swapped in: the paper
evaluates and ships the EMA. Output (beside ``tpflow_export.json`` and the run's ``recipe.json``, which ``tpflow eval``
reads):

* default: the adapter as ``save_adapter`` writes it; for SD3 / FLUX that is ``pytorch_lora_weights.safetensors``,
  read by ``pipe.load_lora_weights(DIR)``;
* ``--merge``: ``DIR/transformer/`` with the adapter merged into the weights, read by
  ``SD3Transformer2DModel.from_pretrained(DIR / "transformer")`` (or the FLUX class) and passed to the pipeline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tpflow.errors import UserError


def export(source: Path, out: Path, merge: bool = False, ema: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Export the newest valid checkpoint under ``source`` (a run dir or a checkpoint dir) into ``out``.

    ``out`` must not exist or be an empty folder, unless ``overwrite`` (then the files the export writes replace
    theirs; other files stay). Returns a summary (checkpoint path, step, whether EMA weights were used, what was
    written, and ``skipped``: the newer checkpoints passed over, each with why).
    """
    from tpflow.evaluation.targets import EXPORT_MANIFEST, EXPORT_RECIPE, apply_ema
    from tpflow.recipe import validate_recipe
    from tpflow.train.checkpoints.format import load_checkpoint

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder; choose another --out.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(
            f"--out {out} already exists and is not empty; the export would overwrite the files in it. Choose "
            "another --out, or pass --overwrite to write into it (the export's files are replaced, others stay)."
        )
    path, notes = _checkpoint_of(Path(source))
    ckpt = load_checkpoint(path)
    recipe = validate_recipe(ckpt.recipe, where=f"the recipe stored in {path}")
    backbone = recipe.build("backbone")
    if merge and not hasattr(backbone, "save_merged"):
        raise UserError(
            f"The backbone {recipe.backbone.name!r} cannot write a merged model; export its adapter (without --merge)."
        )
    ckpt.load_weights(backbone)  # an adapter folder, or a sharded run's shards
    used_ema = False
    ema_state = ckpt.full_ema() if ema else None
    if ema_state is not None:
        apply_ema(backbone, ema_state, path)
        used_ema = True
    out.mkdir(parents=True, exist_ok=True)
    before = _stamps(out)
    if merge:
        backbone.save_merged(out / "transformer")
        written = out / "transformer"
    else:
        backbone.save_adapter(out)
        written = out
    summary = {
        "checkpoint": str(path),
        "step": ckpt.step,
        "ema": used_ema,
        "merged": merge,
        "backbone": recipe.backbone.name,
        "written": str(written),
    }
    (out / EXPORT_MANIFEST).write_text(json.dumps(summary, indent=2))
    # The recipe beside the adapter: `tpflow eval OUT` rebuilds the model it belongs to from it.
    (out / EXPORT_RECIPE).write_text(json.dumps(ckpt.recipe, indent=2, sort_keys=True))
    _readable_as_umask_allows(out, before)
    return {**summary, "skipped": notes}  # newer checkpoints passed over, with why: the command warns of each


def _checkpoint_of(source: Path) -> tuple[Path, list[str]]:
    """The newest valid checkpoint under ``source`` and what newer ones were skipped; a UserError (one paragraph,
    no warning before it) when there is none: no such folder, a run stopped before its first save, or none valid."""
    from tpflow.evaluation.targets import nothing_saved
    from tpflow.train.checkpoints.format import find_checkpoint

    if not source.is_dir():
        what = "not a folder" if source.exists() else "no such folder"
        raise UserError(
            f"No valid checkpoint in {source}: {what}. Pass a run dir (runs/NAME: its newest valid checkpoint) or a "
            "checkpoint dir (runs/NAME/checkpoints/STEP)."
        )
    started = nothing_saved(source)
    if started is not None:
        raise UserError(started)
    path, notes = find_checkpoint(source)
    if path is None:
        why = f" ({'; '.join(notes)})" if notes else ""
        raise UserError(f"No valid checkpoint in {source}{why}: pass a run dir or a checkpoints/<step> dir.")
    return path, notes


def _stamps(folder: Path) -> dict[Path, int]:
    """Every file under ``folder`` with its modification time (ns): what an export then writes is what changed."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def _readable_as_umask_allows(folder: Path, before: dict[Path, int]) -> None:
    """Give the files the export wrote the mode the user's umask gives any new file (0644 under the usual 022).
    safetensors' writer creates its files 0600, so on a shared cluster a colleague could not load an export."""
    mask = os.umask(0)
    os.umask(mask)
    for path, stamp in _stamps(folder).items():
        if before.get(path) != stamp:
            path.chmod(0o666 & ~mask)
