"""A sharded run's checkpoint written and read back (``checkpoint_layout = "sharded"``): the collective steps around
``tpflow.train.checkpoints.format`` (staging, sealing, installing) and ``tpflow.train.checkpoints.shards`` (the
shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from tpflow.shards import is_sharded
from tpflow.train.checkpoints.format import CheckpointError, save_checkpoint, stage_checkpoint
from tpflow.train.checkpoints.shards import (
    MARK,
    SHARDS,
    empty,
    fill,
    markers,
    matching,
    read,
    split,
    stored,
    trained_named,
    write,
    write_layout,
)


def save_sharded(run_dir: Path, step: int, *, backbone: Any, optimizer_state: dict, ema_state: dict | None,
                 is_main: bool, processes: int, **small: Any) -> Path | None:  # fmt: skip
    """Write checkpoint ``step`` of a sharded run (every process calls it): the main process stages the temp folder,
    every process writes its shards of the weights, moments and EMA into it, then the main process writes the small
    files and seals and installs it as ``save_checkpoint`` does (``small``: its ``rng_state``, ``train_state``,
    ``recipe``, ``keep_last``). Returns the checkpoint's folder on the main process, None on the others.

    ``optimizer_state`` and ``ema_state``: the optimizer's and the EMA's ``state_dict(gather=False)``."""
    import shutil

    import torch.distributed as dist

    box = [str(stage_checkpoint(run_dir, step)) if is_main else None]
    dist.broadcast_object_list(box, src=0)  # where the main process staged it (its pid is in the name)
    tmp = Path(box[0])
    named = trained_named(backbone)
    model = {name: f"model.{name}" for name in named}
    skeleton, tensors = split(optimizer_state, "optimizer")
    ema_skeleton, ema_tensors = split(ema_state, "ema") if ema_state is not None else ({}, {})
    ema = {name: marker[MARK] for name, marker in ema_skeleton.items()} if ema_state is not None else None
    try:
        write(tmp / SHARDS, {**{model[n]: p.detach() for n, p in named.items()}, **tensors, **ema_tensors})
    except Exception as err:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"Could not write the shards of checkpoint {step:08d} in run dir {run_dir}: {type(err).__name__}: "
            f"{str(err).strip()[:300]}. Nothing partial was left behind; free some disk space (or fix the "
            "permissions) and resume with `tpflow train RECIPE --resume`."
        ) from err
    if not is_main:
        return None
    layout = write_layout(model, ema, processes)
    return save_checkpoint(run_dir, step, backbone=None, optimizer_state=skeleton, ema_state=None, staged=tmp,
                           layout=layout, **small)  # fmt: skip


def restore_sharded(ckpt: Any, backbone: Any) -> tuple[dict, dict[str, Tensor] | None]:
    """Read a sharded checkpoint into a run of any layout: its weights into ``backbone`` in place, and the optimizer's
    and the EMA's states with their tensors read into the run's layout (sharded over its processes as its
    parameters are, or whole), ready for their ``load_state_dict``. One collective read when the run is sharded."""
    layout = ckpt.layout
    shards = Path(ckpt.path) / SHARDS
    meta = stored(shards)  # the safetensors headers, read once
    named = matching(backbone, layout, meta)
    mesh = next((p.device_mesh for p in named.values() if is_sharded(p)), None)
    ema = layout.get("ema") or {}
    tensors = empty(meta, [*markers(ckpt.optimizer_state), *ema.values()], mesh)
    read(shards, {**{layout["model"][n]: p for n, p in named.items()}, **tensors}, meta)
    return fill(ckpt.optimizer_state, tensors), ({n: tensors[k] for n, k in ema.items()} if ema else None)
