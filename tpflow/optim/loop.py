"""The update loop every built-in optimizer owns: AdamW over the adapter, and one loop around a per-micro-batch loss.

An optimizer (``tpflow.optim.grpo.GRPO``, ``tpflow.optim.nft.NFT``, ``awm``, ``dgpo``; a plugin alike:
docs/adding_an_optimizer.md) holds an :class:`AdamWLoop` (``self.loop``, composed, not inherited) and gives it its
options (the fields of ``tpflow.optim.options.AdamWOptions``), the micro-batches of a pass and, per micro-batch, its
losses as thunks returning :class:`RowLoss`. The loop does the rest, the same for every optimizer:

* **Uniform weights** (docs/algorithm.md §8 D10). Each loss is a *sum* over the rows it trains (a row: one
  trajectory at one window step for GRPO, one sample at one time t for NFT); the gradients of an optimizer step are
  divided by the number of rows trained in that step over every process (``Distributed.sync_gradients``). Every row
  of a step therefore weighs the same, however the rows fall into micro-batches (ragged ones after the zero-std
  filter, masked rows, several processes); with equal micro-batches and no masked row this is the reference's
  mean of per-micro-batch means. Lowering ``micro_batch_size`` and raising ``gradient_accumulation_steps`` by the
  same factor leaves each step's gradient unchanged.
* **Precision** (``tpflow.precision``): each loss's forward passes run in their own autocast region, which never
  caches a cast (or, with ``autocast_each_loss = False``, each forward in its own, opened by the owner); backward
  (scaled under fp16), the optimizer step and any weight swap run outside every region.
* **Few host reads**: one per loss (does it train any row, is it finite: together); per optimizer step none on
  one process (the row count is already a host number), the all-reduce's on several (the total row count and
  which parameters any process trained), plus the fp16 scaler's; the metrics stay on the device and are read once
  per update.
* Every process takes the same number of optimizer steps (one collective per update); a step the fp16 scaler skips
  is not counted and does not call ``on_step``.
* **State**: AdamW's moments, the step count and the fp16 scaler, with the owner's own state beside them under the
  keys it chooses (``state_dict(extra)``), so a checkpoint keeps the keys it always had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tpflow.distributed import Distributed
from tpflow.errors import UserError
from tpflow.interfaces import Backbone
from tpflow.precision import FP32, Precision
from tpflow.types import BatchLayout


@dataclass
class RowLoss:
    """The loss of one unit of a micro-batch (GRPO: one window step; NFT: one draw of t and ε)."""

    total: Tensor  # [] differentiable: the sum over the trained rows of their per-row loss
    rows: Tensor  # [] how many rows it trains (float, on the loss's device); 0: nothing to back-propagate
    sums: dict[str, Tensor] = field(default_factory=dict)  # [] detached sums over the trained rows -> row means
    maxima: dict[str, Tensor] = field(default_factory=dict)  # [] detached maxima over the trained rows
    # True: ``total`` goes through graphs that other losses of the step share (a rollout's retained graphs, which one
    # backward frees): the loop sums the step's deferred losses and back-propagates them once, before its step.
    deferred: bool = False
    # Gradients already formed, one per optimizer parameter (None: none), at the loss scale ``Precision.backward``
    # applies: added to the parameters' gradients in place of a backward (recompute = "reweight"); ``total`` is then
    # only its value, for the metrics and the finiteness check.
    grads: list[Tensor | None] | None = None


LossThunk = Callable[[], "RowLoss"]


def batch_layout(options: Any) -> BatchLayout:
    """How an optimizer on this loop batches its rows (``Optimizer.batch_layout``), from its options alone: also
    before any model exists (``tpflow validate --num-processes``, which reads an optimizer class's ``layout_of``)."""
    return BatchLayout(
        options.micro_batch_size, options.gradient_accumulation_steps, "optimizer.micro_batch_size",
        "optimizer.gradient_accumulation_steps",
    )  # fmt: skip


def held(name: str, settable: bool = False) -> property:
    """A property of an optimizer that reads (and, ``settable``, writes) ``self.loop.<name>``: the ``global_step``
    and ``precision`` the Optimizer protocol asks for live in the loop each optimizer holds, declared once here."""

    def get(self: Any) -> Any:
        return getattr(self.loop, name)

    def put(self: Any, value: Any) -> None:
        setattr(self.loop, name, value)

    return property(get, put if settable else None, doc=f"``self.loop.{name}``")


class AdamWLoop:
    """AdamW over ``backbone.trainable_parameters()`` and the update loop (module docstring): an object each
    optimizer owns (``self.loop``), never a base class. It reads from the owner's options (an
    :class:`tpflow.optim.options.AdamWOptions`, passed to each call) the AdamW, clip and batching fields; the owner
    supplies the passes, the losses and its own checkpoint state.

    ``name`` is the owner's registry name (its state's ``optimizer_name``, and messages). ``autocast_each_loss``
    True: each loss thunk runs in one autocast region; False: the owner opens its own regions, one per forward pass,
    because it changes weights between its forwards (NFT swaps in its old policy for v_old), and no weight may change
    inside a region."""

    def __init__(self, name: str, autocast_each_loss: bool = True) -> None:
        self.name = name
        self.autocast_each_loss = autocast_each_loss
        self.global_step = 0  # optimizer steps taken
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None  # torch's AdamW, once bound
        self.dist = Distributed()
        self.precision: Precision = FP32
        self._max_grad_norm = 1.0  # the running update's clip (its options')

    # ---- binding and state -------------------------------------------------------------------------------------

    def bind(self, options: Any, backbone: Backbone, accelerator=None, precision: Precision | None = None) -> None:
        """AdamW over the backbone's trainable parameters with ``options``' hyper-parameters; collectives from
        ``accelerator`` (None: one process), forward precision and loss scaling from ``precision`` (None: float32)."""
        o = options
        self.params = list(backbone.trainable_parameters())
        if not self.params:
            raise ValueError("The backbone has no trainable parameters: attach an adapter before training.")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.learning_rate, betas=o.adam_betas, weight_decay=o.weight_decay, eps=o.adam_eps
        )
        self.dist = Distributed(accelerator)
        self.precision = precision if precision is not None else FP32
        from tpflow.shards import is_sharded

        if any(is_sharded(p) for p in self.params):  # FSDP2 (tpflow.train.sharding): lockstep, sharded states
            self.dist.sharded = True
            if not self.precision.sharded:
                self.precision = Precision("no") if self.precision is FP32 else self.precision  # FP32 is shared
                self.precision.shard()

    def state_dict(self, extra: dict, gather: bool = True) -> dict:
        """AdamW moments, the step count, the fp16 scaler and the owner's ``extra`` state. Sharded (FSDP2), the
        moments and any sharded extra state are gathered into full tensors on the main process's host (a collective
        every process joins; the others get ``None`` in their place): the state an unsharded run writes
        (``tpflow.train.sharding``); with ``gather`` False they stay this process's shards (a sharded checkpoint,
        ``tpflow.train.checkpoints.shards``)."""
        state = {
            "optimizer": self.optimizer.state_dict() if self.optimizer else {},
            "optimizer_name": self.name,
            "global_step": self.global_step,
            "scaler": self.precision.state_dict(),
            **extra,
        }
        if self.dist.sharded and gather:  # gathered to the main process's host memory, one tensor at a time
            from tpflow.shards import gathered_to_host

            return gathered_to_host(state)
        return state

    def load_state_dict(self, options: Any, state: dict, load_extra: Callable[[dict], None]) -> None:
        """Restore ``state_dict`` (after ``bind``); ``load_extra`` checks and restores the owner's part first (it
        raises ``UserError`` for another optimizer's state before anything changes). The hyper-parameters stay
        ``options``' (torch's ``load_state_dict`` would bring back the checkpoint's learning rate, betas, weight decay
        and epsilon): a run resumed with ``--set optimizer.learning_rate=...`` trains with the new value."""
        if self.optimizer is None:
            raise RuntimeError("Call bind(backbone) before load_state_dict.")
        missing = [key for key in ("optimizer", "global_step") if not isinstance(state, dict) or key not in state]
        if missing:
            raise UserError(
                f"the optimizer state lacks {', '.join(map(repr, missing))}: it was not written by the "
                f"{self.name} optimizer's state_dict."
            )
        written_by = state.get("optimizer_name", self.name)  # absent in checkpoints before 2026-12
        if written_by != self.name:
            raise UserError(
                f"the optimizer state was written by the {written_by} optimizer: its AdamW moments are of another "
                f"loss, and a checkpoint of one optimizer cannot continue as {self.name}. Start a new run, "
                f'or resume with [optimizer] name = "{written_by}".'
            )
        load_extra(state)
        self.optimizer.load_state_dict(self._sharded_like_params(state["optimizer"]))
        o = options
        for group in self.optimizer.param_groups:
            group.update(lr=o.learning_rate, betas=tuple(o.adam_betas), weight_decay=o.weight_decay, eps=o.adam_eps)
        self.precision.load_state_dict(state.get("scaler") or {})
        self.global_step = int(state["global_step"])

    def _sharded_like_params(self, optimizer_state: dict) -> dict:
        """Full AdamW moments (a checkpoint's) sharded as their parameters are (FSDP2); as they are otherwise."""
        if not self.dist.sharded:
            return optimizer_state
        from tpflow.shards import like

        state = {
            index: {key: like(value, self.params[int(index)]) if key != "step" else value
                    for key, value in entry.items()}
            for index, entry in optimizer_state.get("state", {}).items()
        }  # fmt: skip
        return {**optimizer_state, "state": state}

    # ---- the loop ----------------------------------------------------------------------------------------------

    def run(
        self,
        options: Any,
        passes: Iterable[list[Any]],
        losses: Callable[[Any], Iterable[LossThunk]],
        on_step: Callable[[int], object] | None,
        filler: Any = None,
        before_step: Callable[[list[Any]], None] | None = None,
    ) -> dict[str, float]:
        """Train over ``passes`` (per inner epoch, its micro-batches in order: row indices, in whatever form the
        owner's ``losses`` takes) with the losses that ``losses(micro_batch)`` yields; ``on_step(n)`` after each
        optimizer step taken. ``options`` gives ``gradient_accumulation_steps`` and ``max_grad_norm``. Returns the
        update's metrics: row means of every ``RowLoss.sums`` entry, maxima (overall and, as ``first_<name>``, before
        the first optimizer step), ``grad_norm``, ``nonfinite_losses`` (how many rows, counted as ``rows_trained``
        counts them, were skipped with a non-finite loss: one unit however a mode bundles its losses, a window step's
        or reweight's several steps in one), ``rows_trained``, ``optimizer_steps``, ``skipped_steps``.

        ``before_step(micro_batches)``, when given, runs once per optimizer step on every process (collectives
        allowed), with the step's micro-batches on this process (possibly none), before their first loss: a loss
        that couples rows across micro-batches or processes (DGPO's group weight, ``tpflow.optim.dgpo``) computes
        what it needs of the whole step there, at the weights the step starts from.

        Sharded over several processes (FSDP2: every forward and backward is a collective), a step of a process
        with fewer micro-batches than another's is padded with ``filler`` (a micro-batch of its own, trained at
        weight 0): every process runs as many losses per step (``tpflow.train.sharding``). Each backward is told
        whether it is the step's last (``Precision.backward``'s ``sync``), where a LoRA's gradient is reduced over
        the processes once per step (``tpflow.train.sharding.deferred_sync``)."""
        accumulation, self._max_grad_norm = options.gradient_accumulation_steps, options.max_grad_norm
        totals = _Totals()
        steps_before, skipped, num_steps = self.global_step, 0, None
        for micro_batches in passes:
            if num_steps is None:  # every process takes as many steps as the one with the most micro-batches
                num_steps = int(self.dist.max(-(-len(micro_batches) // accumulation)))
            for step in range(num_steps):
                mine = micro_batches[step * accumulation : (step + 1) * accumulation]
                padding = int(self.dist.max(len(mine))) - len(mine) if self.dist.sharded and self.dist.enabled else 0
                if padding and filler is None:
                    raise RuntimeError("a sharded step needs a filler micro-batch to pad with; none was given")
                if before_step is not None:
                    before_step(mine)
                parts = [*((mb, True) for mb in mine), *((filler, False) for _ in range(padding))]
                taken = self._one_step(parts, losses, totals, self.global_step == steps_before)
                if taken is False:
                    skipped += 1
                elif taken and on_step is not None:
                    on_step(self.global_step - 1)
        result = totals.result()
        result.update(optimizer_steps=float(self.global_step - steps_before), skipped_steps=float(skipped))
        return result

    def _one_step(
        self, parts: list[tuple[Any, bool]], losses: Callable[[Any], Iterable[LossThunk]], totals: _Totals, first: bool
    ) -> bool | None:
        """The losses of one optimizer step's micro-batches ``parts`` (each with whether it trains: a lockstep
        step's padding does not), their backward passes, then :meth:`_step`'s answer."""
        rows, deferred = 0.0, []  # deferred: the step's losses through shared graphs (RowLoss.deferred)
        for k, (mb, trained) in enumerate(parts):
            for thunk, last in _with_last(losses(mb)):
                sync = last and k == len(parts) - 1  # sharded: reduced once, at the step's last backward
                if trained:
                    rows += self._backward(thunk, totals, first, deferred, sync)
                else:
                    self._zero_backward(thunk, sync)
        if deferred:  # in one backward: it frees the graphs they share
            self.precision.backward(sum(deferred))
        if self.precision.pending_sync:
            raise RuntimeError("the sharded step's last loss had no backward to reduce its gradient with")
        return self._step(rows, totals)

    def _backward(self, thunk: LossThunk, totals: _Totals, first: bool, deferred: list[Tensor], sync: bool) -> float:
        """Forward one loss in its autocast region and back-propagate it outside (a deferred one is appended to
        ``deferred`` instead; ``sync``: ``Precision.backward``'s); returns the rows it trained."""
        with self.precision.autocast() if self.autocast_each_loss else contextlib.nullcontext():
            out = thunk()
        flags = torch.stack([out.rows.detach().float(), torch.isfinite(out.total.detach()).float()])
        rows, finite = flags.tolist()  # the loss's one host read
        if rows == 0 or not finite:
            totals.nonfinite += int(rows)  # rows, not losses: the unit of rows_trained, whatever a loss bundles
            if self.dist.sharded and out.total.requires_grad:  # lockstep: every process back-propagates every
                # loss; a non-finite one makes the gradient norm non-finite and the step is skipped everywhere
                self.precision.backward(out.total * 0, sync)
            return 0.0
        if out.grads is not None:
            self.precision.add_scaled(self.params, out.grads)
        elif out.deferred:
            deferred.append(out.total)
        elif out.total.requires_grad:  # else its rows ran a frozen module only (Wan2.2's other expert): gradient 0
            self.precision.backward(out.total, sync)
        totals.add(out, rows, first)
        return rows

    def _zero_backward(self, thunk: LossThunk, sync: bool) -> None:
        """A padding loss of a sharded step: its forward and backward run (collectives every process must join), at
        weight 0; nothing is counted."""
        with self.precision.autocast() if self.autocast_each_loss else contextlib.nullcontext():
            out = thunk()
        if out.total.requires_grad:
            self.precision.backward(torch.nan_to_num(out.total) * 0, sync)

    def _step(self, rows: float, totals: _Totals) -> bool | None:
        """Divide the step's gradients by its rows over every process, clip, step. True: taken; False: skipped by
        the fp16 scaler; None: no process trained a row (no step)."""
        if self.dist.sync_gradients(self.params, rows) == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        norm, skipped = self.precision.step(self.optimizer, self.params, self._max_grad_norm)
        if skipped:
            return False
        totals.add_step("grad_norm", norm)
        self.global_step += 1
        return True


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, whether it is the last one) of ``items``, taken one ahead: the next loss thunk is built, not run,
    before the current one runs."""
    iterator, end = iter(items), object()
    current = next(iterator, end)
    while current is not end:
        following = next(iterator, end)
        yield current, following is end
        current = following


class _Totals:
    """Metric sums and maxima of one update, kept on the device and read once, at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}  # row sums -> row means
        self.maxima: dict[str, Tensor] = {}  # -> maxima (and, as first_<name>, before the first step)
        self.steps: dict[str, list[Tensor]] = {}  # one value per optimizer step -> means over the steps
        self.rows = 0.0
        self.nonfinite = 0

    def add(self, out: RowLoss, rows: float, first: bool) -> None:
        self.rows += rows
        for name, value in out.sums.items():
            self.sums[name] = self.sums[name] + value.detach() if name in self.sums else value.detach()
        for name, value in out.maxima.items():
            for key in (name, f"first_{name}") if first else (name,):
                value = value.detach()
                self.maxima[key] = torch.maximum(self.maxima[key], value) if key in self.maxima else value

    def add_step(self, name: str, value: Tensor) -> None:
        self.steps.setdefault(name, []).append(value.detach())

    def result(self) -> dict[str, float]:
        values = [*self.sums.values(), *self.maxima.values(), *(torch.stack(v).mean() for v in self.steps.values())]
        read = torch.stack([v.double().reshape(()) for v in values]).tolist() if values else []  # one read
        means = [v / self.rows for v in read[: len(self.sums)]] if self.rows else read[: len(self.sums)]
        out = dict(zip([*self.sums, *self.maxima, *self.steps], [*means, *read[len(self.sums) :]], strict=True))
        out.update(nonfinite_losses=float(self.nonfinite), rows_trained=self.rows)
        return out
