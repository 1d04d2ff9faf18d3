"""``LiveBytes``: the bytes of the tensor storages alive now and at most, counted as ops create and free them.

Why a dispatch mode rather than ``torch.cuda.max_memory_allocated``: the estimate runs where there is no GPU, on
fake tensors (``FakeTensorMode``: real shapes, dtypes and storage sizes, no data). Every op's outputs pass through
``__torch_dispatch__``, where their storages are counted once; a weakref finalizer subtracts a storage when it dies,
so ``peak`` is the peak of live tensor bytes, what the caching allocator would have to hold at least.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now (``live``) and at most (``peak``), counted as ops create them.

    Works on real and on fake tensors (a fake tensor's storage has its real size). Tensors created before the mode
    was entered are counted only when passed to ``add``. Scalar reads of fake tensors (``bool``, ``float``) return
    0: under FakeTensorMode they have no value, and tpflow's reads are checks and logged diagnostics.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.ops: set[str] = set()  # names of the ops seen (to tell which attention kernel ran)
        self._seen = WeakIdKeyDictionary()

    def add(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> int:
        """Start a new peak at the current live bytes; returns them."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return False if args[0].dtype == torch.bool else 0
        self.ops.add(str(func))
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        return out
