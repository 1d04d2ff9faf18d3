"""GARDO's adaptive reference (``[optimizer] adaptive_reference``, grpo and nft): the KL's reference is a held copy
of the adapter, reset to the policy now and then, instead of the base model (docs/algorithm.md §10.9).

A KL to the base model holds the policy near where it started for the whole run; GARDO's resets let it move on once
it has moved far enough: before an epoch's update the copy becomes the current policy when an optimizer step of an
earlier update saw its mean KL above ``threshold`` (the reference's ``kl_thres``), or when more than ``every`` epochs
(``reset_freq``) have passed since the last reset. The first update copies the adapter as it starts, without counting
a reset. Everything here is the optimizer's checkpointed state (:meth:`state`), so a resumed run resets when the
uninterrupted one does.

GARDO's DiffusionNFT script (tinnerhrhe/GARDO at 52fd5e7, ``scripts/train_sd3_nft_gardo.py``) also moves the
threshold at each reset (``moves``, nft's ``reference_reset_kl_moves``): after a reset more than ``every`` updates
after the previous one it becomes max(threshold − 0.01, 0.1), after one fewer than 5 updates after it
min(threshold + 0.01, 0.05), the script's constants as they are (the second rule sets 0.05 from any threshold
above it, the first 0.1 from any below it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError

STATE_KEY = "adaptive_reference"  # its entry in the optimizer's state
# the DiffusionNFT script's threshold rule (``moves``): its step, floor after a long gap, short gap, cap after one
MOVE_STEP, AFTER_LONG_FLOOR, SHORT_GAP, AFTER_SHORT_CAP = 0.01, 0.1, 5, 0.05


class AdaptiveReference:
    """The copy (one tensor per trained parameter), the update count, the epoch of the last reset and the flag."""

    def __init__(self, every: int, threshold: float, moves: bool = False) -> None:
        self.every, self.threshold, self.moves = every, threshold, moves
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
            if self.moves:  # the script's order: the long-gap rule, then the short-gap one
                gap = epoch - self.last_reset
                if gap > self.every:
                    self.threshold = max(self.threshold - MOVE_STEP, AFTER_LONG_FLOOR)
                if gap < SHORT_GAP:
                    self.threshold = min(self.threshold + MOVE_STEP, AFTER_SHORT_CAP)
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
        held = {"copy": copy, "updates": self.updates, "last_reset": self.last_reset, "flagged": self.flagged}
        return {STATE_KEY: {**held, "threshold": self.threshold} if self.moves else held}

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
        self.threshold = float(held.get("threshold", self.threshold))  # a moving threshold's, when saved


class StepKL:
    """One optimizer step's KL over its rows, for the adaptive reference (grpo's and nft's alike): each loss adds its
    KL sum and rows (:meth:`add`); after the step, the mean over every process is what ``AdaptiveReference.observe``
    sees. ``loop``: the optimizer's ``AdamWLoop`` (its parameters' device, its processes)."""

    def __init__(self, adaptive: AdaptiveReference, loop: Any) -> None:
        self.adaptive, self.loop = adaptive, loop
        self.sums: Tensor | None = None  # [2] the step's KL sum and rows; None until a step starts

    def start(self, _micro_batches: list) -> None:
        """Before each optimizer step (``AdamWLoop.run``'s ``before_step``): the step's sums start at 0."""
        self.sums = torch.zeros(2, dtype=torch.float32, device=self.loop.params[0].device)

    def add(self, kl_sum: Tensor, rows: Tensor | int) -> None:
        """A loss's KL summed over its rows, and how many rows (outside a step: nothing)."""
        if self.sums is not None:
            self.sums[0] += kl_sum.detach().float()
            self.sums[1] += rows

    def observing(self, on_step: Callable[[int], object] | None) -> Callable[[int], object]:
        """``on_step`` after the adaptive reference has seen the step's mean KL over its rows on every process."""

        def observe(n: int) -> None:
            assert self.sums is not None
            kl_sum, rows = (self.loop.dist.sum(float(x)) for x in self.sums.tolist())
            self.adaptive.observe(kl_sum / rows if rows else 0.0)
            if on_step is not None:
                on_step(n)

        return observe


def adaptive_problems(options: Any, weight: tuple[str, float, str] | None = None) -> list[str]:
    """The recipe's limits for ``adaptive_reference`` (grpo's or nft's options), before anything loads. ``weight``:
    the KL weight's (name, value, GARDO's value), grpo's beta unless given."""
    if not options.adaptive_reference:
        return []
    name, value, gardo = weight if weight is not None else ("beta", options.beta, "GARDO's OCR config: 0.04")
    if value == 0:
        return [
            f"[optimizer] adaptive_reference = true with {name} = 0: the held reference copy is read only by the KL "
            f"term, which {name} = 0 turns off (GARDO resets its reference only when its KL weight is > 0), so the "
            f"option would change nothing. Set {name} > 0 ({gardo}) or drop adaptive_reference."
        ]
    if options.recompute == "retain":
        return [
            '[optimizer] adaptive_reference = true with recompute = "retain": the reference pass swaps the held '
            "copy into the trained parameters, which the retained rollout graphs saved, so their backward would "
            'fail. Use recompute = "native" with adaptive_reference.'
        ]
    return []
