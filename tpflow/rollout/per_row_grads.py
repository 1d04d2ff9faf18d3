"""Per-row gradients of a backbone's trainable ``nn.Linear`` layers from one batched backward (``recompute =
"reweight"``, ``tpflow.rollout.reweight``).

LeanGRPO's Reweight back-propagates each sampled step at once, before its advantage exists, so the update needs one
gradient per trajectory (or per trajectory and step), to be weighted by the advantages later. Back-propagating each
row alone would cost a backward per row. For a linear layer y = x·Wᵀ + b the gradient is a sum over the batch and the
tokens, ∂L/∂W = Σ_{b,t} g_{b,t} ⊗ x_{b,t} (g = ∂L/∂y), so keeping the batch index gives every row's share from the one
backward: the rule Opacus (Yousefpour et al. 2021, ``opacus.grad_sample.linear``) applies for per-sample gradients.
Here the layer inputs are recorded by forward hooks during the velocity call, the loss is differentiated with
respect to the layer outputs only (``torch.autograd.grad``: no parameter's ``.grad`` is touched), and each layer's
per-row weight and bias gradients are contracted in float32.

Which rows are which: a velocity call may be split into chunks (``[rollout] max_batch``), and a backbone with CFG
runs [unconditional; conditional] copies of a chunk's c rows as one batch of k·c (the convention every tpflow
backbone follows, ``tpflow.guidance``), or calls the transformer once per copy (k = 1 per call). A layer call of m
rows in the chunk of c rows therefore holds k = m / c blocks of the chunk's rows, in order, and its share folds onto
them by summing the blocks. A layer that saw its batch flattened with the tokens (m = c·T rows in row-major order)
would be folded wrongly, and so would one whose batch holds frames × rows (a factorised video model: such a
backbone declares ``per_row_layers = False`` and the recipe check refuses reweight with it). The contract test
(tests/test_recompute_reweight.py) checks each backbone against one backward per row, and the rule is checked where
it runs too: the first rollout step back-propagated with a set of parameters (:meth:`PerRowGradients.gradients`,
``check``) differentiates one row's loss alone and refuses the run if its gradient reaches a layer position the rule
credits to another row (frames folded in, rows mixed by the model), or if autograd returns no gradient for any
recorded output (blocks compiled by ``torch.compile``, whose hooks fire outside the graph autograd sees).

Every trainable parameter must be the weight or bias of an ``nn.Linear`` (peft LoRA's A and B are); anything else is
refused with the parameter's name.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tpflow.errors import UserError

# id → weak reference of the first trainable parameter of every parameter set whose row layout has been checked
# (once per process; a tensor's == is elementwise, so no WeakSet)
_CHECKED: dict[int, weakref.ref] = {}


def _checked(param: Tensor) -> bool:
    ref = _CHECKED.get(id(param))
    return ref is not None and ref() is param


@dataclass
class _Call:
    """One forward of a hooked layer: its input, its output, and the chunk of rows it ran on."""

    layer: int  # index into PerRowGradients.layers
    x: Tensor  # [m, ..., in]
    y: Tensor  # [m, ..., out]
    chunk: tuple[int, int]  # (first row, rows c) of the velocity call's chunk


class PerRowGradients:
    """The trainable linear layers of a backbone, and their per-row gradients (module docstring).

    Args:
        params: the optimizer's parameters, in its order (``Backbone.trainable_parameters()``); the gradients come
            back in this order.
        modules: the backbone's modules to search for the layers owning them.
    """

    def __init__(self, params: list[nn.Parameter], modules: list[nn.Module]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self.params = params
        self.layers: list[nn.Linear] = []
        self.slots: list[tuple[int | None, int | None]] = []  # per layer: (weight's index, bias's index) in params
        found: set[int] = set()
        seen: set[int] = set()
        for module in modules:
            for layer in module.modules():
                if not isinstance(layer, nn.Linear) or id(layer) in seen:
                    continue
                seen.add(id(layer))
                weight = index.get(id(layer.weight))
                bias = None if layer.bias is None else index.get(id(layer.bias))
                if weight is None and bias is None:
                    continue
                self.layers.append(layer)
                self.slots.append((weight, bias))
                found.update(i for i in (weight, bias) if i is not None)
        missing = [i for i in range(len(params)) if i not in found]
        if missing:
            names = {id(p): n for m in modules for n, p in m.named_parameters()}
            name = names.get(id(params[missing[0]]), f"parameter {missing[0]}")
            raise UserError(
                f'[optimizer] recompute = "reweight" keeps one gradient per trajectory, taken per row from the '
                f"trainable linear layers (LoRA's A and B matrices are), and the trainable parameter {name!r} is not "
                f'the weight or bias of an nn.Linear ({len(missing)} such). Use recompute = "retain" or "native".'
            )
        self.calls: list[_Call] = []
        self._chunk = (0, 0)

    @staticmethod
    def of(backbone) -> PerRowGradients:
        """For a backbone: its trainable parameters, searched for in every module it holds as an attribute."""
        modules = [m for m in vars(backbone).values() if isinstance(m, nn.Module)]
        return PerRowGradients(list(backbone.trainable_parameters()), modules)

    def chunk(self, first: int, rows: int) -> None:
        """The velocity call is about to run rows first .. first + rows − 1 (``tpflow.rollout.parts.Velocity``)."""
        self._chunk = (first, rows)

    @contextlib.contextmanager
    def recording(self, rows: int) -> Iterator[None]:
        """Record every hooked layer's forward inside the block (a velocity call over ``rows`` rows)."""
        self.calls, self._chunk = [], (0, rows)

        def hook(k: int):
            def record(_module: nn.Module, args: tuple, out: Tensor) -> None:
                if torch.is_grad_enabled() and out.requires_grad:
                    self.calls.append(_Call(k, args[0], out, self._chunk))

            return record

        handles = [layer.register_forward_hook(hook(k)) for k, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def gradients(self, losses: Tensor, n: int) -> list[Tensor | None]:
        """∂Σ losses/∂θ per row, [n, *θ.shape] float32 for each parameter (None: no recorded call reached it), from
        the calls recorded since :meth:`recording` (``losses`` [n]: each row's differentiable loss); frees them. The
        first call for this parameter set checks the row rule first (module docstring)."""
        calls, self.calls = self.calls, []
        if not calls:
            return [None] * len(self.params)
        out: list[Tensor | None] = [None] * len(self.params)
        # outside the rollout's autocast region: the backward as the update's runs, the contractions in float32
        with torch.autocast(losses.device.type, enabled=False), torch.enable_grad():  # the rollout runs without
            if not _checked(self.params[0]) and losses.requires_grad:
                self._check_rows(losses, calls)
            grads = torch.autograd.grad(losses.sum(), [c.y for c in calls], allow_unused=True)
            if losses.requires_grad and all(g is None for g in grads):
                raise UserError(_NO_GRADIENT)
            for call, g in zip(calls, grads, strict=True):
                if g is not None:
                    self._add(out, call, g, n)
        return out

    def _check_rows(self, losses: Tensor, calls: list[_Call]) -> None:
        """Differentiate one row's loss alone (the last row with a non-zero loss, so a chunk offset is exercised)
        and refuse the run if a recorded layer output credited to another row by the rule gets any of its gradient,
        or none of them does. One extra backward, once per process."""
        live = (losses.detach() != 0).nonzero()
        if len(live) == 0:
            return
        r = int(live[-1, 0])  # the one host read
        grads = torch.autograd.grad(losses[r], [c.y for c in calls], retain_graph=True, allow_unused=True)
        if all(g is None for g in grads):
            raise UserError(_NO_GRADIENT)
        leaks, shapes = [], []
        for call, g in zip(calls, grads, strict=True):
            if g is None:
                continue
            first, c = call.chunk
            g = _blocks(g.detach(), c).flatten(2)  # [k, c, rest]
            other = torch.ones(c, dtype=torch.bool, device=g.device)
            if first <= r < first + c:
                other[r - first] = False
            leaks.append(g[:, other].abs().amax() if other.any() else g.new_zeros(()))
            shapes.append((call.x.shape[0], c))
        leaked = torch.stack(leaks).amax(dim=0) if leaks else None
        if leaked is not None and float(leaked) > 0:
            m, c = next(shape for shape, value in zip(shapes, leaks, strict=True) if float(value) > 0)
            raise UserError(_FOLDED.format(m=m, c=c))
        _CHECKED[id(self.params[0])] = weakref.ref(self.params[0])

    def _add(self, out: list[Tensor | None], call: _Call, g: Tensor, n: int) -> None:
        first, c = call.chunk
        x = _blocks(call.x.detach(), c).float()  # [k, c, T, in]
        g = _blocks(g, c).float()  # [k, c, T, out]
        weight, bias = self.slots[call.layer]
        for slot, share in ((weight, lambda: torch.einsum("kcto,kcti->coi", g, x)), (bias, lambda: g.sum((0, 2)))):
            if slot is None:
                continue
            if out[slot] is None:
                out[slot] = torch.zeros((n, *self.params[slot].shape), dtype=torch.float32, device=g.device)
            out[slot][first : first + c] += share()


def _blocks(t: Tensor, c: int) -> Tensor:
    """A layer's tensor [m, ..., d] over a velocity call of ``c`` rows as its k = m / c blocks of those rows (the CFG
    copies): [k, c, T, d]; a batch that is not whole blocks of the rows cannot be told apart."""
    m = t.shape[0]
    if m % c:
        raise UserError(_FOLDED.format(m=m, c=c))
    return t.reshape(m // c, c, -1, t.shape[-1])


_NO_GRADIENT = (
    '[optimizer] recompute = "reweight" records each trainable linear layer\'s output with forward hooks and '
    "differentiates those outputs, and autograd returned no gradient for any of them: the layers ran where autograd "
    "does not see the hooked tensors (blocks compiled by torch.compile, [backbone] compile_blocks = true), so every "
    "per-trajectory gradient would be missing and the step zero. Use compile_blocks = false with reweight, or "
    'recompute = "retain" or "native".'
)
_FOLDED = (
    '[optimizer] recompute = "reweight" credits each row of a trainable linear layer\'s batch to one trajectory (the '
    "batch holding the velocity call's rows, or its CFG copies of them, in blocks), and this backbone's layers ran "
    "on {m} rows for a call of {c} rows in a way that rule does not hold for: one trajectory's loss reached rows "
    "credited to another (frames or tokens folded into the batch, or rows mixed by the model). Its per-trajectory "
    'gradients would be wrong, so the run stops here. Use recompute = "retain" or "native" with this backbone.'
)
