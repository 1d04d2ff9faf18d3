"""``Flops``: the floating-point operations of the ops that run, counted as they dispatch (fake tensors too).

Why not ``torch.utils.flop_counter.FlopCounterMode`` itself: its formulas are reused here (matmuls, convolutions,
attention: 2 FLOPs per multiply-add, forward and backward), but it does not know the CPU flash-attention kernel the
estimate's fake tensors dispatch to (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: the same
arithmetic as the GPU kernels), and its module tracker hooks every module's backward, which the estimate has no use
for. Elementwise ops, norms and softmax count 0 (as in FlopCounterMode): a few per cent of a transformer's work.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

aten = torch.ops.aten
CPU_ATTENTION = {  # the CPU flash kernel: the formulas of the GPU's flash / memory-efficient kernels
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}


class Flops(TorchDispatchMode):
    """FLOPs of the ops dispatched while entered (``total``), by ``torch.utils.flop_counter``'s formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.registry = {**flop_registry, **CPU_ATTENTION}  # the formulas take tensors (shape-wrapped already)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out
