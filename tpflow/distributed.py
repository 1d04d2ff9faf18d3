"""Collectives over the training processes, through accelerate: gather rows, reduce numbers and gradients.

Every function takes a ``Distributed`` view of an ``accelerate.Accelerator`` (or of nothing: one process, where every
collective is the identity and costs nothing). Why tpflow does not wrap the transformer in DDP (docs/distributed.md):

* a GRPO step runs micro-batches × W forward/backward passes, and after the all-zero-advantage filter each process
  may hold a different number of trajectories; DDP needs the same number of synchronised backward passes everywhere;
* some LoRA tensors get no gradient by construction (SD3's last, context-pre-only block), which DDP rejects unless
  ``find_unused_parameters`` scans the graph on every pass;
* only the adapter is trained, so its gradients are small: one flat all-reduce per optimizer step is what DDP does
  at a synchronising step, minus the hooks.

``sync_gradients`` sums the accumulated gradients and the number of rows they cover over the processes and divides, so
each step's gradient is the mean over every row of every process, whatever their split (docs/algorithm.md §8 D10).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError

RUNNING_UNDER_LAUNCHER = ("LOCAL_RANK", "RANK")  # set by torchrun, accelerate launch, deepspeed, SLURM wrappers


def launched() -> bool:
    """True inside a process started by a distributed launcher (so it must not launch again; its accelerate state
    belongs to the launch)."""
    return any(name in os.environ for name in RUNNING_UNDER_LAUNCHER)


class Distributed:
    """Rank, world size and collectives of the current run (one process when ``accelerator`` is None)."""

    def __init__(self, accelerator: Any = None) -> None:
        self.accelerator = accelerator
        self.world_size = accelerator.num_processes if accelerator is not None else 1
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.sharded = False  # True once the trained module is FSDP-sharded (tpflow.train.sharding)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, tensor: Tensor) -> Tensor:
        """[n_r, ...] on each process -> [Σ n_r, ...] in process order (rank 0's rows first), on every process.

        The row counts may differ between processes (they are exchanged first and the rows padded for the
        transfer); the trailing shape and dtype must agree."""
        if not self.enabled:
            return tensor
        from accelerate.utils import gather

        device = self.accelerator.device
        local = tensor.to(device)
        counts = gather(torch.tensor([local.shape[0]], device=device)).tolist()
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: local.shape[0]] = local
        rows = gather(padded.contiguous()).reshape(self.world_size, max(counts), *local.shape[1:])
        return torch.cat([rows[r, : counts[r]] for r in range(self.world_size)]).to(tensor.device)

    def gather_objects(self, objects: Sequence[Any]) -> list[Any]:
        """A list on each process -> their concatenation in process order, on every process (picklable items)."""
        if not self.enabled:
            return list(objects)
        from accelerate.utils import gather_object

        return list(gather_object(list(objects)))

    def sum(self, value: float) -> float:
        """The sum of a number over the processes."""
        return self._reduce(value, "sum")

    def max(self, value: float) -> float:
        """The largest value of a number over the processes."""
        return self._reduce(value, "max")

    def barrier(self) -> None:
        if self.enabled:
            self.accelerator.wait_for_everyone()

    def close(self, exit_workers: bool = False) -> None:
        """End the process group, in every process, once a command has succeeded.

        A process that leaves with gloo's group alive can abort at interpreter shutdown ("terminate called without an
        active exception", exit status -6): gloo's worker threads outlive the Python objects they hold. Only after
        success: after a failure another process may still wait inside a collective, and the barrier here would hang
        (the launcher stops the others instead). Even with the group destroyed, about one process in ten still
        aborted so at shutdown (``tpflow eval --num-processes 2``), and the launcher then reports the command as
        failed: ``exit_workers`` (a command's end, where the processes other than the main one have nothing left
        to write) ends those processes here with status 0, their output flushed, skipping the interpreter's
        teardown."""
        if self.enabled and torch.distributed.is_initialized():
            self.barrier()
            torch.distributed.destroy_process_group()
            if exit_workers and not self.is_main:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)

    def sync_gradients(self, params: Sequence[torch.nn.Parameter], rows: float) -> float:
        """Turn each process's summed gradients into the mean over all processes' rows; returns that total count.

        The losses back-propagated since the last step are sums over rows (``tpflow.optim.loop``); ``rows`` is how
        many this process's covered (0 is fine: its gradients count as zero). Afterwards every process holds the
        same gradient, bit for bit. Sharded (FSDP2), the backward passes have summed the gradients over the
        processes already (each holds its shard): only the row count is reduced."""
        if self.sharded:
            total = self.sum(rows)
            if total:
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(total)
            return total
        if not self.enabled:
            if rows:
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(rows)
            return rows
        from accelerate.utils import reduce

        device = self.accelerator.device
        has_grad = [float(p.grad is not None) for p in params]
        flat = torch.cat([_grad_or_zeros(p).reshape(-1).to(device, torch.float32) for p in params])
        flat = reduce(torch.cat([flat, torch.tensor([*has_grad, float(rows)], device=device)]), "sum")
        total = float(flat[-1])
        used = flat[-1 - len(params) : -1].tolist()  # how many processes had a gradient for each parameter
        grads = flat[: -1 - len(params)] / max(total, 1)
        offset = 0
        for p, count in zip(params, used, strict=True):
            n = p.numel()
            # None where no process had a gradient, as on one process (AdamW then skips the parameter)
            p.grad = grads[offset : offset + n].view_as(p).to(p.device, p.dtype) if count else None
            offset += n
        return total

    def check_in_sync(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Raise if the processes' copies of these tensors differ (a run that silently trains P different models).
        Sharded, each process holds other shards by design: nothing to compare."""
        if not self.enabled or self.sharded:
            return
        digest = hashlib.sha256()
        for name, value in named:
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests = self.gather_objects([digest.hexdigest()])
        if len(set(digests)) > 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise UserError(
                f"The trained weights differ between processes (ranks {differing} disagree with rank 0): gradients "
                "were not synchronised, so the run would train different models. This is a bug; please report it "
                "with the recipe and the launch command."
            )

    def _reduce(self, value: float, op: str) -> float:
        if not self.enabled:
            return float(value)
        device = self.accelerator.device
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
        if op == "max":
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            return float(tensor)
        from accelerate.utils import reduce

        return float(reduce(tensor, "sum"))


def _grad_or_zeros(p: torch.nn.Parameter) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def make_accelerator(
    cpu: bool, mixed_precision: str, log_with: Sequence[str] = (), logging_dir: Path | None = None
) -> Any:
    """An ``accelerate.Accelerator`` on the CPU or the process's GPU with ``mixed_precision``, logging to the
    trackers ``log_with`` (accelerate's names: "tensorboard", "wandb") under ``logging_dir``.

    accelerate keeps one state per process, fixed by the first Accelerator: a later one with another device or
    precision either raises ("AcceleratorState has already been initialized") or silently keeps the first device. A
    process that no launcher started (a notebook, the test suite) may build several trainers, so there a state that
    disagrees is reset first; under a launcher the state belongs to the launch and is left alone."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    state = AcceleratorState._shared_state
    if state and not launched():
        same_device = state.get("_cpu") == cpu or (not cpu and getattr(state.get("device"), "type", None) == "cuda")
        if not same_device or state.get("_mixed_precision") != mixed_precision:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    project = ProjectConfiguration(logging_dir=str(logging_dir)) if logging_dir is not None else None
    return Accelerator(
        cpu=cpu, mixed_precision=mixed_precision, log_with=list(log_with) or None, project_config=project
    )
