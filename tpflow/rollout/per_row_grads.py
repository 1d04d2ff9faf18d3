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
would be folded wrongly; no tpflow backbone does that to a LoRA-targeted layer, and the contract test
(tests/test_recompute_reweight.py) checks each against one backward per row.

Every trainable parameter must be the weight or bias of an ``nn.Linear`` (peft LoRA's A and B are); anything else is
refused with the parameter's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tpflow.errors import UserError


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

    def gradients(self, loss: Tensor, n: int) -> list[Tensor | None]:
        """∂loss/∂θ per row, [n, *θ.shape] float32 for each parameter (None: no recorded call reached it), from the
        calls recorded since :meth:`recording`; frees them."""
        calls, self.calls = self.calls, []
        if not calls:
            return [None] * len(self.params)
        out: list[Tensor | None] = [None] * len(self.params)
        # outside the rollout's autocast region: the backward as the update's runs, the contractions in float32
        with torch.autocast(loss.device.type, enabled=False):
            grads = torch.autograd.grad(loss, [c.y for c in calls], allow_unused=True)
            for call, g in zip(calls, grads, strict=True):
                if g is not None:
                    self._add(out, call, g, n)
        return out

    def _add(self, out: list[Tensor | None], call: _Call, g: Tensor, n: int) -> None:
        first, c = call.chunk
        m = call.x.shape[0]
        if m % c:
            raise ValueError(f"a linear layer ran on {m} rows in a velocity call of {c}: cannot tell its rows apart.")
        k = m // c
        x = call.x.detach().reshape(k, c, -1, call.x.shape[-1]).float()  # [k, c, T, in]
        g = g.reshape(k, c, -1, g.shape[-1]).float()  # [k, c, T, out]
        weight, bias = self.slots[call.layer]
        for slot, share in ((weight, lambda: torch.einsum("kcto,kcti->coi", g, x)), (bias, lambda: g.sum((0, 2)))):
            if slot is None:
                continue
            if out[slot] is None:
                out[slot] = torch.zeros((n, *self.params[slot].shape), dtype=torch.float32, device=g.device)
            out[slot][first : first + c] += share()
