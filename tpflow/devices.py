"""Where tensors live and where random numbers are drawn (docs/architecture.md, "Devices").

Two rules, written once here and followed by every module on the training, evaluation and inspection paths:

1. **Random draws happen on a CPU generator and are moved.** z_0, the SDE noise ξ and the independent baseline's
   noise are drawn by ``randn`` from a ``torch.Generator`` on the CPU (seeded from the run seed, the epoch and the
   rollout batch), in float32, then copied to the device that uses them, as diffusers' ``randn_tensor`` does for a
   CPU generator. A seed therefore gives the same z_0 and ξ, bit for bit, on the CPU and on any GPU, and a resumed
   run does not depend on the CUDA RNG. A generator a caller made on the GPU is honoured (the draw happens there).
2. **The model's tensors live on the backbone's device; the bookkeeping lives on the CPU.** Rollout storage
   (latents, old log-probs, σ, conditioning), the update's forward/backward, the KL reference pass and the EMA
   shadow stay on the backbone's device. Reward traces, credit, advantages and logged values are small host tensors
   (float64 advantages): the scoring worker returns them on the CPU, and the optimizer moves the advantages to the
   rollout's device once per update (``Rollout.device``). Checkpoints are written from CPU copies and restored with
   ``copy_`` / ``load_state_dict``, which move them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError


def resolve_device(device: str | None) -> torch.device:
    """``None`` or ``"auto"``: the current CUDA device when there is one, else the CPU; anything else goes to torch.

    "auto" and "cuda" resolve to the *indexed* current device (``cuda:<LOCAL_RANK>`` once accelerate has set it in a
    training process), so a model built later in another thread (a reward loaded lazily by the scoring worker) or
    compared with ``==`` names the same GPU.

    Raises:
        UserError: for a name torch does not know ("gpu0") or a CUDA device this machine does not have.
    """
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"Unknown device {device!r} ({exc}). Use 'auto', 'cpu', 'cuda' or 'cuda:<index>'.") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"Device {device!r} asked for, but this machine has no CUDA GPU that torch can use "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Use device = 'cpu' or 'auto'."
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UserError(
                f"Device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s): "
                f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}."
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def device_name_problem(device: str | None) -> str | None:
    """Why torch does not know the device name ``device`` ("gpu0"), or None; whether this machine has it is
    ``resolve_device``'s question."""
    if device is None or device == "auto":
        return None
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        return f"Unknown device {device!r} ({exc}). Use 'auto', 'cpu', 'cuda' or 'cuda:<index>'."
    return None


def torch_device_fields(options: Any) -> list[tuple[str, Any]]:
    """The options that name a torch device: fields called ``device``, unless marked ``torch_device: False`` in their
    ``json_schema_extra`` (the ocr reward's paddle device ``gpu:0``)."""
    fields = getattr(type(options), "model_fields", {})
    out = []
    for name, info in fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if name == "device" and extra.get("torch_device", True):
            out.append((name, getattr(options, name)))
    return out


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device index (None without CUDA): worker threads start on device 0, so a
    thread that builds or runs models sets it from its creator's (``torch.cuda.set_device``)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def cpu_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: the only kind the training path creates (rule 1)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(
    shape: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """N(0, I) of ``shape``, drawn in float32 on the generator's device and returned on ``device`` in ``dtype``.

    With ``generator=None`` the CPU's global RNG draws, so the rule holds there too.
    """
    source = generator.device if generator is not None else torch.device("cpu")
    draw = torch.randn(tuple(shape), generator=generator, device=source, dtype=torch.float32)
    return to_device(draw, device).to(dtype=dtype)


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` on ``device``, the same values, without the host waiting for the GPU's queue.

    A copy to CUDA from pageable host memory waits until the work queued before it has run (a host synchronisation
    at every SDE step of a rollout, for a noise draw or even a one-element σ); from pinned memory it is queued like
    a kernel. So a host tensor goes to CUDA through pinned memory, ``non_blocking``, and a one-element one is filled
    on the device from its value instead. Anything else is a plain ``.to(device)``."""
    target = torch.device(device)
    if tensor.device.type != "cpu" or target.type != "cuda":
        return tensor.to(device=target)
    if tensor.numel() == 1:
        return torch.full(tensor.shape, tensor.item(), dtype=tensor.dtype, device=target)
    return tensor.pin_memory().to(device=target, non_blocking=True)
