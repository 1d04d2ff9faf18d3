"""Keep freed heap memory in the process on CPU runs (glibc): batched rollouts then stop paying page faults.

glibc's malloc serves blocks above 32 MiB with mmap and unmaps them on free, so every large activation tensor of a
batched velocity call (CFG-doubled rows × tokens × width: ~94 MB for shapes-dit at 288 rows) is faulted in page by
page, zeroed, at each call. Measured with benchmarks/rollout_cost.py on shapes-dit: the batched TP-GRPO rollout took
419 ms per NFE against 257 for the reference's sequential order, and 241 ms per NFE with freed memory kept (minor
faults per row 1,085 -> ~0). The price: the process keeps its peak heap instead of returning it to the system.
The CUDA caching allocator already does the equivalent for GPU memory, so only CPU runs call this.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (1 GiB, 2 GiB); True when applied. TPFLOW_KEEP_FREED_MEMORY=0 skips."""
    if os.environ.get("TPFLOW_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
