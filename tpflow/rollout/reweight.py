"""What a rollout keeps for ``[optimizer] recompute = "reweight"`` (docs/training.md, "Recompute-free updates").

LeanGRPO's Reweight (arXiv 2609.03528): each trained step of the main trajectory runs with gradients during the
rollout and is back-propagated at once with a provisional advantage of 1, so its activations are freed before the
next step; what is kept is a gradient per trajectory (``per_step`` False, when every step of a trajectory gets the
same advantage and weight: outcome credit) or per trajectory and step (TP-GRPO's step credits, noise-aware weights).
Once the advantages exist the update's on-policy step forms −Σ A·w·G locally and the loop reduces it once across
processes, as it reduces a native step's gradient (``tpflow.optim.recompute``).

The per-row gradients come from one batched backward per step (``tpflow.rollout.per_row_grads``). What is
differentiated is what ``retain`` differentiates (``tpflow.rollout.retain``): ``Sampler.log_prob`` of the stored,
detached transition under the differentiable velocity, each step's graph starting at a detached latent, the
transition sampled from the detached velocity, so the stored rollout is the native one.

Memory: no graph outlives its step; the buffers are P float32 numbers per trajectory (×M per step), P the trainable
parameters (LoRA), for the rollout batches that hold the first optimizer step's rows only (``rows``):
docs/training.md states them for the paper recipes. ``steps`` caps the steps kept (the first M), the rest recomputed
natively.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tpflow.rollout.per_row_grads import PerRowGradients
from tpflow.types import ReweightedSteps, StepOutput


def _one() -> float:
    return 1.0


@dataclass(frozen=True)
class Reweight:
    """Which window steps a rollout back-propagates at once, and how the optimizer wants them computed."""

    steps: int | None = None  # the first M window steps (None: all of them)
    weighted_steps: bool = False  # the optimizer weighs a trajectory's steps unequally (noise-aware, 1/Δσ)
    per_step: bool = True  # a buffer per (trajectory, step); False: per trajectory (``for_credit``)
    # the optimizer's context around the policy's velocity call (e.g. tpflow.guidance.conditional_only)
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    loss_scale: Callable[[], float] = field(default=_one)  # the fp16 GradScaler's current scale
    # the first optimizer step's rows on this process (gradient_accumulation_steps × micro_batch_size): a rollout
    # batch of the epoch starting past them keeps no buffers (``for_batch``); None: every batch keeps them
    rows: int | None = None

    def covers(self, i: int) -> bool:
        """Whether window step i (0-based) is back-propagated by the rollout."""
        return self.steps is None or i < self.steps

    def for_credit(self, same_every_step: bool) -> Reweight:
        """Per-trajectory buffers where the credit gives every step of a trajectory the same reward (so the same
        advantage) and the optimizer weighs its steps alike; per (trajectory, step) otherwise."""
        return dataclasses.replace(self, per_step=self.weighted_steps or not same_every_step)

    def for_batch(self, first_row: int) -> Reweight | None:
        """For the rollout batch whose first row is the process's epoch row ``first_row``: None past the first
        optimizer step's rows. The update's first step trains the epoch's first informative rows, so the batches
        after them would keep buffers no on-policy step reads (a first-step micro-batch with a row past them, when
        the zero-advantage filter skipped rows, recomputes natively)."""
        return None if self.rows is not None and first_row >= self.rows else self

    def log(self, backbone, engine, width: int) -> ReweightLog:
        """The record of one rollout batch over a window of ``width`` steps (``engine``: its velocity calls)."""
        return ReweightLog(self, PerRowGradients.of(backbone), engine, width)


class ReweightLog:
    """The provisional gradients of one rollout batch, accumulated step by step."""

    def __init__(self, spec: Reweight, per_row: PerRowGradients, engine, width: int) -> None:
        self.spec, self.per_row, self.engine = spec, per_row, engine
        self.steps = width if spec.steps is None else min(spec.steps, width)  # M
        self.scale = float(spec.loss_scale())  # one per rollout batch: no optimizer step runs during a rollout
        self.buffers: list[Tensor] | None = None
        self.live: Tensor | None = None  # [n, M] bool: the (row, window step) pairs back-propagated with std ≠ 0
        self.t = 0  # the next window step of a one-window batch (``keep`` without positions)

    def covers(self, i: int) -> bool:
        return self.spec.covers(i)

    def velocity(self, call: Callable[[], Tensor], rows: int) -> Tensor:
        """The main trajectory's velocity with gradients, inside the optimizer's context, its layers recorded."""
        self.engine.on_chunk = self.per_row.chunk
        try:
            with self.per_row.recording(rows), torch.enable_grad(), self.spec.context():
                return call()
        finally:
            self.engine.on_chunk = None

    def keep(self, out: StepOutput, n: int, pick: Tensor | None = None, positions: Tensor | None = None) -> None:
        """Back-propagate one step's log-probabilities (advantage 1; rows with std 0 have none) into the buffers of
        the batch's ``n`` rows: ``out`` holds rows ``pick`` ([P] device indices; None: all n), at their window
        steps ``positions`` ([P] device, per-row windows) or, None, at the batch's next window step."""
        size = out.log_prob.shape[0]
        live = out.std.reshape(-1).expand(size) != 0  # [P] bool
        with torch.enable_grad():
            losses = torch.where(live, out.log_prob, 0.0) * self.scale  # [P]
        grads = self.per_row.gradients(losses, size)  # per parameter [P, *θ.shape] or None
        self._allocate(n, live.device)
        rows = torch.arange(n, device=live.device) if pick is None else pick
        steps = torch.full_like(rows, self.t) if positions is None else positions
        for buffer, g in zip(self.buffers, grads, strict=True):
            if g is None:
                continue
            if self.spec.per_step:
                buffer[rows, steps] = g
            else:
                buffer[rows] += g  # each row once per call
        self.live[rows, steps] = live
        self.t += positions is None

    def skip(self, n: int) -> None:
        """A window step no row trains: nothing back-propagated, no pair live."""
        self._allocate(n, self.per_row.params[0].device)
        self.t += 1

    def _allocate(self, n: int, device: torch.device) -> None:
        if self.buffers is None:
            shape = (n, self.steps) if self.spec.per_step else (n,)
            self.buffers = [torch.zeros((*shape, *p.shape), dtype=torch.float32, device=p.device)
                            for p in self.per_row.params]  # fmt: skip
            self.live = torch.zeros((n, self.steps), dtype=torch.bool, device=device)

    def stacked(self) -> ReweightedSteps | None:
        if self.buffers is None:
            return None
        return ReweightedSteps(tuple(self.buffers), self.live, self.spec.per_step, self.scale)
