"""Where a reward's own model lives: its ``device`` option, resolved when the reward is built."""

from __future__ import annotations

import torch

from tpflow.devices import resolve_device


def reward_device(option: str | None) -> torch.device:
    """``resolve_device(option)``, with a bare ``"cuda"`` pinned to the CUDA device current in the calling thread.

    Why: rewards load their weights lazily, on the first call, which usually comes from the scoring worker thread.
    CUDA's current device is per thread and a new thread starts on cuda:0, so a bare "cuda" resolved there would
    put every process's reward model on GPU 0 in a multi-GPU run. Resolved when the reward is built (by the thread
    that selected the process's GPU), it lands on that GPU. CUDA is not initialised here: where nothing has
    initialised it yet, no thread has selected another device, and "cuda" is left for the loading thread.
    """
    device = resolve_device(option)
    if device.type == "cuda" and device.index is None and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    return device
