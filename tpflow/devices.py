"""Device selection shared by backbones and rewards."""

from __future__ import annotations

import torch


def resolve_device(device: str | None) -> torch.device:
    """``None`` or ``"auto"``: the first CUDA device when there is one, else the CPU; anything else goes to torch."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
