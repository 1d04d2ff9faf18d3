"""Mixed precision on the training path: autocast regions that never outlive a weight change, and the fp16 scaler.

``train.mixed_precision`` ("no", "fp16", "bf16") is honoured on every device, the CPU included, so the CPU test suite
runs the recipes' precision too. tpflow owns it rather than accelerate (whose ``Accelerator`` is built with
``mixed_precision = "no"``): accelerate gives a CPU fp16 run neither autocast nor a gradient scaler, and its
``autocast()`` caches casts, which is the hazard below.

Why the regions are small and never cache (docs/training.md, "Mixed precision"): autocast keeps the low-precision
cast of every float32 leaf that requires grad (the LoRA matrices) until the *outermost* region exits, keyed by the
tensor, not by its version. An optimizer step, an EMA swap or the NFT old-policy swap writes those tensors in place;
inside one long region every later forward would still use the cast of the old values (an update that trained on
the epoch-start weights: a GRPO ratio of exactly 1 after every step, NFT's v_θ = v_old). So:

* every region is opened with ``cache_enabled=False``: a cast is never reused, whatever runs inside;
* the optimizer skeleton (``tpflow.optim.loop``) opens one region per loss (its forward passes; NFT one per forward,
  its old-policy swap between them) and runs backward and the optimizer step outside any region, as PyTorch
  recommends; rollout and evaluation open one per batch; the EMA and old-policy swaps happen outside every region.

Without the cache each use of a LoRA matrix casts it again; a forward uses each once, so this costs nothing
measurable (``benchmarks/precision_ratio.py``, docs/training.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from tpflow.errors import UserError

Mode = Literal["no", "fp16", "bf16"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def quiet_norm_dtype_warning() -> None:
    """Silence torch's "Mismatch dtype between input and weight … Cannot dispatch to fused implementation".

    Under autocast a LayerNorm/RMSNorm (diffusers' qk-norm, the final norms) gets a low-precision input beside its
    float32 weight (autocast leaves the weight alone); torch then takes its unfused kernel, which gives the same
    normalisation up to the output's bf16/fp16 rounding (checked: ≤ 2.5e-3 from a float32 reference at bf16). The
    warning is a note about a kernel choice, not a precision bug, and every mixed-precision run printed it in the
    middle of its progress lines."""
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)


class Precision:
    """The precision of one run's forward passes and, under fp16, the gradient scaler of its backward passes.

    Args:
        mode: ``train.mixed_precision``.
        device: the backbone's device (its type picks the autocast backend and the scaler's).
    """

    def __init__(self, mode: Mode = "no", device: torch.device | str = "cpu") -> None:
        if mode not in ("no", *DTYPES):
            raise UserError(f"train.mixed_precision must be 'no', 'fp16' or 'bf16', got {mode!r}.")
        self.mode = mode
        self.device_type = torch.device(device).type
        if mode != "no" and not torch.amp.is_autocast_available(self.device_type):
            raise UserError(
                f"train.mixed_precision = {mode!r} needs torch autocast on {self.device_type!r}, which this torch "
                f"({torch.__version__}) lacks; set train.mixed_precision = 'no'."
            )
        if mode != "no":
            quiet_norm_dtype_warning()
        # fp16 gradients underflow without loss scaling; bf16 has float32's range and needs none
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, None without mixed precision."""
        return DTYPES.get(self.mode)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """A region of forward passes: autocast to ``dtype`` without the weight cache (module docstring)."""
        if self.mode == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: Tensor, sync: bool = True) -> None:
        """Back-propagate ``loss``, scaled under fp16 (outside any autocast region). Sharded with a
        ``gradient_sync`` switch (``shard``), ``sync`` False keeps this backward's gradient whole on each process,
        for a later backward's reduce-scatter to carry (the update loop's deferral to a step's last backward)."""
        if self.gradient_sync is not None:
            self.gradient_sync(sync)
            self.pending_sync = not sync
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def add_scaled(self, params: Sequence[torch.nn.Parameter], grads: Sequence[Tensor | None]) -> None:
        """Add gradients formed elsewhere at the current loss scale (``loss_scale``) as a backward would: the fp16
        scaler is readied as ``scale`` readies it, so that ``step`` can unscale them."""
        if self.scaler is not None and params:
            self.scaler.scale(torch.zeros((), device=params[0].device))  # its lazy start: a step of these alone
        for param, grad in zip(params, grads, strict=True):
            if grad is not None:
                param.grad = grad.to(param.dtype).clone() if param.grad is None else param.grad.add_(grad)

    def shard(self, gradient_sync: Callable[[bool], None] | None = None) -> None:
        """Under FSDP (``tpflow.train.sharding``): the fp16 scaler becomes torch's ShardedGradScaler, whose inf check
        is reduced over the processes (each sees only its shard of the gradients), and ``step`` skips a step whose
        gradient norm is not finite (every process holds the same norm: they skip together). ``gradient_sync``
        (``tpflow.train.sharding.deferred_sync``) turns the reduce-scatter of each backward on or off: ``backward``'s
        ``sync``."""
        self.sharded = True
        self.gradient_sync = gradient_sync
        if self.scaler is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device_type)

    sharded = False
    gradient_sync: Callable[[bool], None] | None = None
    pending_sync = False  # a backward kept its gradient whole, and no backward has reduced it since

    def loss_scale(self) -> float:
        """The factor ``backward`` multiplies a loss by now (the fp16 scaler's scale: one host read; 1 otherwise)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def step(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], max_norm: float):
        """Unscale (fp16), clip to ``max_norm``, step and zero the gradients. Returns ``(norm, skipped)``: the
        pre-clip norm (a 0-d tensor, not read here) and whether the scaler skipped the step for inf/NaN gradients
        (fp16 only: the scaler's own read of its inf check decides; tpflow adds none)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.sharded:
            from tpflow.shards import full

            norm = full(norm)  # the norm over every shard, the same on every process
            if self.scaler is None and not bool(torch.isfinite(norm)):  # a non-finite loss reached every shard
                optimizer.zero_grad(set_to_none=True)
                return norm, True
        skipped = False
        if self.scaler is not None:
            taken: list[bool] = []  # the scaler calls optimizer.step only for finite gradients: a post hook sees it
            hook = optimizer.register_step_post_hook(lambda *_: taken.append(True))
            try:
                self.scaler.step(optimizer)
            finally:
                hook.remove()
            self.scaler.update()
            skipped = not taken
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def state_dict(self) -> dict:
        """The scaler's state (its scale and growth tracker), for exact resume; empty without one."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


FP32 = Precision("no")  # what an optimizer bound without a trainer uses
