"""The gradient an optimizer takes at its first step on a batch: the quantity a gradient probe compares across arms.

A probe must measure what training does, not a re-implementation of it: the arm's own advantages go through the
optimizer's own loss code (group normalisation, zero-std rows, clipping, the uniform row weights of
``tpflow.optim.loop``), with every row of the batch in one optimizer step, so the step is on policy (ratio 1) and
its gradient is the arm's estimate of the policy gradient. The step itself is not taken: the weights, the AdamW
moments and every other optimizer state are as before the call.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from tpflow.interfaces import Backbone, Optimizer, Sampler
from tpflow.precision import Precision
from tpflow.types import Rollout


class _Capture(Precision):
    """A precision whose optimizer step records the (row-averaged, all-reduced) gradient and takes no step."""

    def __init__(self, like: Precision) -> None:
        super().__init__(like.mode, like.device_type)  # forwards as ``like``'s ("no" or "bf16": no scaler)
        self.gradients: list[Tensor] = []

    def step(self, optimizer, params, max_norm):
        flat = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        self.gradients.append(torch.cat(flat).detach().float().cpu())
        optimizer.zero_grad(set_to_none=True)
        # no norm: nothing was clipped. On the gradients' device: the loop stacks it with its device-side totals
        return torch.zeros((), device=params[0].device), False


def first_step_gradient(
    optimizer: Optimizer, backbone: Backbone, sampler: Sampler, batch: Rollout, advantages: Tensor
) -> Tensor:
    """The flat gradient [P] (float32, CPU; P = the adapter's parameter count, in ``trainable_parameters()``
    order) of ``optimizer``'s loss over every row of ``batch`` with ``advantages`` (as ``optimizer.advantages``
    returns them), before norm clipping; zeros when no row trains. ``optimizer`` must be bound; its state and the
    weights are left as they were."""
    if optimizer.precision.scaler is not None:
        raise ValueError("first_step_gradient measures fp32 or bf16 updates; fp16's loss scale would enter it.")
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_options, saved_precision = optimizer.options, optimizer.precision
    rows = max(len(batch.final), 1)
    optimizer.options = saved_options.model_copy(
        update={"gradient_accumulation_steps": rows, "num_inner_epochs": 1}
    )  # every micro-batch in one step: on policy (the gradient is recorded before any clipping)
    capture = _Capture(saved_precision)
    optimizer.precision = capture
    try:
        optimizer.update(backbone, sampler, batch, advantages)
    finally:
        optimizer.options, optimizer.precision = saved_options, saved_precision
        optimizer.load_state_dict(saved_state)
    if not capture.gradients:  # no process trained a row: the loop took no step
        return torch.zeros(sum(p.numel() for p in backbone.trainable_parameters()), device="cpu")
    (gradient,) = capture.gradients
    return gradient
