"""DTensors (FSDP2's sharded parameters and states) gathered into full tensors and full tensors sharded back.

Low in the package (optimizers, the EMA and the precision use them): ``tpflow.train.sharding`` shards the model;
these move the states that live beside its parameters between the sharded and the unsharded (checkpoint) form.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(value: Any) -> Any:
    """A DTensor gathered into a plain tensor (a collective: every process calls it, in the same order); containers
    of them converted item by item; anything else as it is."""
    if is_sharded(value):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def gathered_to_host(value: Any) -> Any:
    """For a checkpoint: each DTensor gathered into a full tensor and moved to the host at once (the device holds one
    gathered tensor at a time), kept by the main process only (``None`` on the others, which only take part in the
    collectives: the whole state lives in one host's memory, not in every process's); containers item by item in
    the same order on every process; anything else as it is."""
    import torch.distributed as dist

    if is_sharded(value):
        whole = value.full_tensor().cpu()
        return whole if dist.get_rank() == 0 else None
    if isinstance(value, dict):
        return {k: gathered_to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gathered_to_host(v) for v in value)
    return value


def like(value: Tensor, param: Tensor) -> Tensor:
    """A full tensor shaped as ``param`` sharded as ``param`` is (every process holds the full value: no
    communication), or ``value`` itself for an unsharded parameter or a value sharded already (a sharded
    checkpoint's, read into the run's layout)."""
    if not is_sharded(param) or is_sharded(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    local = value.to(param.device_mesh.device_type)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
