"""Exponential moving average of the trained (LoRA) parameters, with the reference's warm-up and update interval.

docs/algorithm.md §6.3: ``θ_ema ← θ_ema + (1 − d_n)(θ − θ_ema)`` with ``d_n = min((1 + n)/(10 + n), decay_cap)``, where
n is the 0-based index of the optimizer step just taken. The trainer calls ``step(n)`` right after each optimizer step
(``Optimizer.update``'s ``on_step``), so every step's weights are averaged, and a step the fp16 gradient scaler
skipped is not one. It applies only when ``(n + 1) % every == 0``. (The reference calls it after every training
micro-batch, so with several micro-batches per step the same n can apply twice; tpflow applies each n once.) The EMA
weights are swapped in for evaluation and saving only; rollouts use the live weights.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from tpflow.errors import UserError
from tpflow.optim.swap import swapped


class EMA:
    """Float32 shadow copies of a list of parameters.

    Args:
        params: the parameters to average (the LoRA parameters), in a fixed order.
        decay_cap: upper bound of the decay d_n (0.9 in every shipped config).
        every: apply the update only when ``(global_step + 1) % every == 0`` (8 in every shipped config).
        names: optional keys for ``state_dict`` (default ``"0"``, ``"1"``, ...); names make a mismatch on resume
            easier to read.
    """

    def __init__(
        self, params: list[nn.Parameter], decay_cap: float = 0.9, every: int = 8, *, names: list[str] | None = None
    ):
        if not 0.0 <= decay_cap < 1.0:
            raise ValueError(f"decay_cap must be in [0, 1), got {decay_cap}.")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}.")
        self.params = list(params)
        if names is not None and len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} parameters.")
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.params))]
        self.decay_cap = decay_cap
        self.every = every
        self.shadow = [p.detach().to(torch.float32, copy=True) for p in self.params]  # same shapes and devices

    def decay(self, global_step: int) -> float:
        """d_n = min((1 + n)/(10 + n), decay_cap): a short warm-up, then the cap."""
        return min((1 + global_step) / (10 + global_step), self.decay_cap)

    @torch.no_grad()
    def step(self, global_step: int) -> bool:
        """Move the shadow towards the live parameters if ``global_step`` is on the interval; return whether it did."""
        if (global_step + 1) % self.every != 0:
            return False
        one_minus_decay = 1.0 - self.decay(global_step)
        for shadow, param in zip(self.shadow, self.params, strict=True):
            shadow.add_(param.detach().to(torch.float32) - shadow, alpha=one_minus_decay)
        return True

    def swapped(self) -> AbstractContextManager[None]:
        """Context in which the live parameters hold the EMA values; the live values come back on exit, exactly."""
        return swapped(self.params, self.shadow)

    @torch.no_grad()
    def reset(self) -> None:
        """Shadow ← the live parameters: a resumed or warm-started run whose checkpoint holds no EMA state starts
        its average from the restored adapter, not from the adapter's initialisation."""
        for shadow, param in zip(self.shadow, self.params, strict=True):
            shadow.copy_(param.detach())

    def state_dict(self, gather: bool = True) -> dict[str, Tensor]:
        """The shadow values as CPU float32 tensors, keyed by ``names`` (a sharded run's gathered into full tensors on
        the main process, ``None`` on the others: a collective, every process calls it; ``tpflow.train.sharding``;
        with ``gather`` False, this process's shards as they are: a sharded checkpoint)."""
        from tpflow.shards import gathered_to_host, is_sharded

        if not gather:
            return {name: s.detach() if is_sharded(s) else s.detach().cpu().clone()
                    for name, s in zip(self.names, self.shadow, strict=True)}  # fmt: skip
        return {name: gathered_to_host(s.detach()) if is_sharded(s) else s.detach().cpu().clone()
                for name, s in zip(self.names, self.shadow, strict=True)}  # fmt: skip

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore the shadow values from ``state_dict()``.

        Raises:
            UserError: when the keys or shapes differ from the parameters being averaged (a changed LoRA setup).
        """
        missing = [n for n in self.names if n not in state]
        unexpected = [k for k in state if k not in self.names]
        if missing or unexpected:
            raise UserError(
                f"The EMA state does not match the trained parameters (missing keys {missing[:5]}, unexpected keys "
                f"{unexpected[:5]}); was the LoRA rank or target list changed since the checkpoint was written?"
            )
        for name, shadow in zip(self.names, self.shadow, strict=True):
            if tuple(state[name].shape) != tuple(shadow.shape):
                raise UserError(
                    f"The EMA state does not match the trained parameters: {name!r} has shape "
                    f"{list(state[name].shape)} in the checkpoint but {list(shadow.shape)} here; was the LoRA rank or "
                    "target list changed since the checkpoint was written?"
                )
        from tpflow.shards import like

        for name, shadow in zip(self.names, self.shadow, strict=True):
            shadow.copy_(like(state[name].to(shadow.dtype), shadow))  # sharded as the shadow is, if it is
