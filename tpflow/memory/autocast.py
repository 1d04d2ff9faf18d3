"""``CudaAutocast``: CUDA autocast's casting policy applied at the Python call, for a machine without CUDA.

Why: the trainer runs rollouts and updates under ``tpflow.precision``'s regions (CUDA autocast in the recipe's
``mixed_precision``, without the weight cache), which decide the dtype, hence the bytes, of every activation. CUDA
autocast cannot be switched on without a CUDA device, so this ``TorchFunctionMode`` casts as it would: matmul-type
ops cast their floating inputs to the low-precision dtype (afresh at each call: no cache, as ``cache_enabled=False``),
the float32-list ops to float32.
Ops reached only through a C++ decomposition are not cast, unlike CUDA autocast.
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

LOWER_PRECISION_OPS = frozenset(  # CUDA autocast's float16/bfloat16 list (torch docs, "Autocast Op Reference")
    "linear matmul __matmul__ __rmatmul__ mm bmm baddbmm addmm addbmm addmv addr mv chain_matmul multi_dot prelu "
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d scaled_dot_product_attention".split()
)
FLOAT32_OPS = frozenset(  # CUDA autocast's float32 list (the ops a diffusion transformer or VAE reaches)
    "layer_norm group_norm softmax log_softmax softmin exp expm1 log log1p log2 log10 pow __pow__ __rpow__ rsqrt "
    "reciprocal sum prod cumsum cumprod norm normalize softplus mse_loss cosine_similarity".split()
)


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casting policy applied at the Python call, for devices where autocast cannot be enabled."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _cast(self, to: torch.dtype, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype in (to, torch.float64):
            return t
        return t.to(to)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.backward and len(args) == 1 and not any((kwargs or {}).values()):
            # A handler runs with its mode off, so ``loss.backward()`` would recompute checkpointed blocks without
            # the policy (autocast keeps it on there); run the engine directly with the mode on.
            from torch.autograd.graph import _engine_run_backward

            with self:
                _engine_run_backward(
                    (args[0],),
                    (torch.ones_like(args[0]),),
                    False,
                    False,
                    (),
                    allow_unreachable=True,
                    accumulate_grad=True,
                )
            return None
        to = self.dtype if name in LOWER_PRECISION_OPS else torch.float32 if name in FLOAT32_OPS else None
        if to is not None:
            args, kwargs = tree_map_only(torch.Tensor, functools.partial(self._cast, to), (args, kwargs or {}))
        return func(*args, **(kwargs or {}))
