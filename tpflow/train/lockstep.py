"""A sharded run's rollouts in lockstep: every process runs as many forward passes of the sharded transformer per
rollout batch, whatever its own batch needs.

A forward pass of an FSDP2-sharded transformer (``tpflow.train.sharding``) all-gathers each block's weights: a
collective every process must join, in the same order. How many velocity calls a rollout batch makes depends on its
data once ``[rollout] max_batch`` splits the calls: the rows alive at a step depend on the batch's window start (the
completions of TP-GRPO's credit start inside the window) and, with ``same_noise``, on how many distinct prompts it
holds (the steps before the window run once per distinct noise). Unpadded, one process would start the all-gathers of
a forward that another never runs (gloo aborts with "collective mismatch"; NCCL may pair same-sized all-gathers of
different calls without an error).

Each rollout batch runs inside :meth:`Lockstep.batch`. Before every forward of the transformer there, the processes
exchange whether each has one (one all-reduce of three integers); a process whose batch is done says no and, while
another says yes, runs its last forward again, output dropped, to join that forward's all-gathers. The batch ends when
every process says no. A repeat changes nothing a process computes (the weights are only read; no random numbers
are drawn: the backbones run in eval mode). The same exchange compares the processes' batch counts: processes in
different batches (a bug) stop with a clear error on every process instead of pairing the wrong collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class LockstepError(RuntimeError):
    """The processes of a sharded run left lockstep (a bug: their forward passes would pair the wrong collectives)."""


class Lockstep:
    """Pads each process's forward passes of ``module`` (the sharded transformer) inside :meth:`batch` to the most any
    process runs, on the collectives' ``device`` (module docstring).

    Attributes:
        batches: how many :meth:`batch` regions this process has entered.
        calls: the forwards this process ran for its own rollout in the current (or last) region.
        repeats: the forwards it ran again to keep in step, over the run.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device
        self.batches = self.calls = self.repeats = 0
        self._inside = self._repeating = False
        self._last: tuple[tuple, dict] | None = None  # the inputs of this region's last forward
        # before FSDP2's own pre-forward hook (prepend): the exchange comes before the forward's first all-gather
        module.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """A rollout batch: on leaving it (without an error), repeat forwards until every process is done."""
        self.batches += 1
        self.calls, self._inside = 0, True
        try:
            yield
            self._pad()
        finally:
            self._inside, self._last = False, None

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._inside and not self._repeating:
            self._exchange(1)
            self._last = (args, kwargs)
            self.calls += 1

    def _pad(self) -> None:
        while self._exchange(0):  # another process still has a forward: join it with a repeat of the last one
            if self._last is None:
                raise LockstepError(
                    "A sharded rollout batch ran no forward pass on this process while another process ran some: "
                    "there is no call to repeat. This is a bug; please report it with the recipe."
                )
            args, kwargs = self._last
            self._repeating = True
            try:
                with torch.no_grad():
                    self.module(*args, **kwargs)
            finally:
                self._repeating = False
            self.repeats += 1

    def _exchange(self, has_forward: int) -> bool:
        """Whether any process has a forward to run now; raises on every process if they are in different
        batches."""
        flags = torch.tensor([has_forward, self.batches, -self.batches], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        any_forward, highest, lowest = flags.tolist()
        if highest != -lowest:
            raise LockstepError(
                f"The processes of this sharded run are in different rollout batches (this one in its batch "
                f"{self.batches}, another in its batch {highest if highest != self.batches else -lowest}): their "
                "forward passes would pair the wrong collectives. This is a bug; please report it with the recipe "
                "and the launch command."
            )
        return bool(any_forward)
