"""The optimizer step shared by GRPO and NFT: average the accumulated gradients over every process, clip, step."""

from __future__ import annotations

from typing import Any

import torch

from tpflow.distributed import Distributed


def optimizer_step(
    dist: Distributed,
    params: list[torch.nn.Parameter],
    optimizer: Any,
    accelerator: Any,
    max_grad_norm: float,
    num_losses: int,
) -> float | str | None:
    """Average the accumulated gradients over every process's losses, clip, step, zero. Returns the pre-clip norm of
    a step taken; ``"skipped"`` when the fp16 gradient scaler found inf/NaN gradients and skipped the step
    (Accelerate's ``step_was_skipped``; the same on every process, whose gradients are all-reduced); None (and no
    step) when no process had a loss. The caller counts only a step taken."""
    if dist.sync_gradients(params, num_losses) == 0:
        optimizer.zero_grad(set_to_none=True)
        return None
    if accelerator is not None:
        norm = accelerator.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if getattr(optimizer, "step_was_skipped", False):
        return "skipped"
    return float(norm)
