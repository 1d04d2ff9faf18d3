"""Measuring helpers of the benchmarks: velocity-call meter, CUDA-aware clocks, peak memory, spread, machine line.

Kept apart from ``rollout_cost.py`` so that the script reads as "what is measured" and this file as "how".
"""

from __future__ import annotations

import ctypes
import gc
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work so that a wall clock read afterwards covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VelocityMeter:
    """Wraps ``backbone.velocity`` (an instance attribute shadows the method) to count calls, rows and seconds.

    Rows are latent rows as the engine passes them; a CFG backbone runs each row twice inside one call. On CUDA
    every call is synchronised before and after, so ``seconds`` is the time spent inside the model.
    """

    def __init__(self, backbone: Any, device: torch.device) -> None:
        self.backbone, self.device = backbone, device
        self.inner = backbone.velocity
        self.reset()
        backbone.velocity = self._velocity

    def reset(self) -> None:
        self.calls, self.rows, self.seconds = 0, 0, 0.0

    def _velocity(self, z, sigma, cond, guidance):
        sync(self.device)
        start = time.perf_counter()
        out = self.inner(z, sigma, cond, guidance)
        sync(self.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += z.shape[0]
        return out

    def remove(self) -> None:
        del self.backbone.velocity  # the class's method again


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


# ---- memory -------------------------------------------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def release_free_memory() -> None:
    """Collect garbage and return free heap pages to the OS (glibc ``malloc_trim``), so RSS counts live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may then include freed memory kept by the allocator
        pass


def rss_peak_increase_mib(fn: Callable[[], Any]) -> float:
    """Peak resident memory of this process while ``fn()`` runs, minus the resident memory before it (MiB).

    Linux only: writing 5 to /proc/self/clear_refs resets the high-water mark VmHWM to the current RSS. Meant to run
    in a fresh process after one warm-up call, so that lazy imports and one-time caches are not counted.
    """
    release_free_memory()
    Path("/proc/self/clear_refs").write_text("5")
    before = _proc_status_kib("VmRSS")
    fn()
    return (_proc_status_kib("VmHWM") - before) / 1024


def reset_rss_peak() -> bool:
    """Reset the peak resident set (VmHWM) to the current RSS (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_peak_mib() -> float:
    """The peak resident set of this process since the last ``reset_rss_peak`` (MiB); without /proc, the lifetime
    peak from ``resource.getrusage`` (kilobytes on Linux)."""
    try:
        return _proc_status_kib("VmHWM") / 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cuda_peak_reset(device: torch.device) -> int:
    """Reset CUDA's peak counter; returns the bytes allocated now (the base of the increase)."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak_increase_mib(device: torch.device, base: int) -> float:
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def tune_malloc() -> bool:
    """Keep freed heap memory in the process (what the trainer does on CPU runs): see tpflow/train/allocator.py."""
    from tpflow.train.allocator import keep_freed_memory

    return keep_freed_memory()


# ---- description --------------------------------------------------------------------------------------------


def machine(device: torch.device) -> str:
    """One line: platform, CPU, threads, torch version and the accelerator when there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = f"{names[0]} × {len(names)}" if names else cpu
    except OSError:
        pass
    line = (
        f"{platform.platform()}, {cpu}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"Python {sys.version.split()[0]}"
    )
    if device.type == "cuda":
        line += f", {torch.cuda.get_device_name(device)}"
    return line
