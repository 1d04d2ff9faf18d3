"""GARDO's adaptive reference (``[optimizer] adaptive_reference``, grpo): the KL's reference is a held copy of the
adapter, reset to the policy now and then, instead of the base model (docs/algorithm.md §10.9).

A KL to the base model holds the policy near where it started for the whole run; GARDO's resets let it move on once
it has moved far enough: before an epoch's update the copy becomes the current policy when an optimizer step of an
earlier update saw its mean KL above ``threshold`` (the reference's ``kl_thres``), or when more than ``every`` epochs
(``reset_freq``) have passed since the last reset. The first update copies the adapter as it starts, without counting
a reset. Everything here is the optimizer's checkpointed state (:meth:`state`), so a resumed run resets when the
uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError

STATE_KEY = "adaptive_reference"  # its entry in the optimizer's state


class AdaptiveReference:
    """The copy (one tensor per trained parameter), the update count, the epoch of the last reset and the flag."""

    def __init__(self, every: int, threshold: float) -> None:
        self.every, self.threshold = every, threshold
        self.copy: list[Tensor] | None = None
        self.updates = 0  # updates begun: the reference's epoch of the next one
        self.last_reset = 0  # the reference's prev_epoch
        self.flagged = False  # a step's KL exceeded the threshold since the last reset

    def begin_update(self, params: Sequence[Tensor]) -> bool:
        """Before an update: copy ``params`` if due (the first update, or the reset rule); True when it was a reset."""
        epoch, reset = self.updates, False
        if self.copy is None:
            self.copy = [p.detach().clone() for p in params]
        elif (epoch != 0 and self.flagged) or epoch - self.last_reset > self.every:
            with torch.no_grad():
                for held, p in zip(self.copy, params, strict=True):
                    held.copy_(p.detach())
            self.flagged, self.last_reset, reset = False, epoch, True
        self.updates += 1
        return reset

    def observe(self, step_kl: float) -> None:
        """An optimizer step's mean KL over its rows on every process: above the threshold, reset at the next
        update."""
        if step_kl > self.threshold:
            self.flagged = True

    def state(self) -> dict:
        """The checkpointed part: the copy on the host (a sharded run's shards as they are, for the loop's
        ``state_dict`` to gather), the counters."""
        from tpflow.shards import is_sharded

        copy = None if self.copy is None else [t.detach().clone() if is_sharded(t) else t.detach().cpu().clone()
                                               for t in self.copy]  # fmt: skip
        return {STATE_KEY: {"copy": copy, "updates": self.updates, "last_reset": self.last_reset,
                            "flagged": self.flagged}}  # fmt: skip

    def load(self, state: dict, params: Sequence[Tensor]) -> None:
        """Restore :meth:`state` (``UserError`` when the checkpoint has none or another adapter's)."""
        held = state.get(STATE_KEY)
        if held is None:
            raise UserError(
                "[optimizer] adaptive_reference = true, but the checkpoint holds no reference copy: it was written by "
                "a run without the option, whose KL was to the base model. Resume it as it was written (drop "
                "adaptive_reference), or start a new run."
            )
        copy = held["copy"]
        if copy is not None and [tuple(t.shape) for t in copy] != [tuple(p.shape) for p in params]:
            raise UserError(
                f"the checkpoint's reference copy has {len(copy)} tensors that do not match the {len(params)} "
                "trained parameters; was the LoRA rank or target list changed since it was written?"
            )
        from tpflow.shards import like  # a sharded run's parameters: the copy sharded as they are

        self.copy = None if copy is None else [like(t.to(dtype=p.dtype), p).to(device=p.device).clone() for t, p in
                                               zip(copy, params, strict=True)]  # fmt: skip
        self.updates, self.last_reset = int(held["updates"]), int(held["last_reset"])
        self.flagged = bool(held["flagged"])


def adaptive_problems(options: Any) -> list[str]:
    """The recipe's limits for ``adaptive_reference`` (grpo's options), before anything loads."""
    if not options.adaptive_reference:
        return []
    if options.beta == 0:
        return [
            "[optimizer] adaptive_reference = true with beta = 0: the held reference copy is read only by the KL "
            "term, which beta = 0 turns off (GARDO resets its reference only when beta > 0), so the option would "
            "change nothing. Set beta > 0 (GARDO's OCR config: 0.04) or drop adaptive_reference."
        ]
    if options.recompute == "retain":
        return [
            '[optimizer] adaptive_reference = true with recompute = "retain": the reference pass swaps the held '
            "copy into the trained parameters, which the retained rollout graphs saved, so their backward would "
            'fail. Use recompute = "native" with adaptive_reference.'
        ]
    return []
