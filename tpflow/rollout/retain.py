"""What a rollout keeps for a recompute-free update (``[optimizer] recompute = "retain"``, docs/training.md).

A GRPO update's first optimizer step is on policy: it re-runs, with gradients, the very forward pass the rollout ran
without them (the ratio is exactly 1, the clip inert), so its cost buys nothing but the graph (LeanGRPO, arXiv
2609.03528, "Retain"). With :class:`Retain` the window engine runs the main trajectory's velocity at the first M
window steps with gradients and keeps, per step, the log-probability of the transition it sampled with its autograd
graph (``tpflow.types.RetainedSteps``); the update back-propagates those once the advantages exist.

Three choices keep it the native update up to float rounding:

* **What is differentiated** is ``Sampler.log_prob`` of the sampled latent, detached, as the update recomputes it,
  not the step's own log-probability (whose sample depends on the velocity through its mean, and whose gradient would
  therefore cancel).
* **The stored transition is the native one**: the step samples from the detached velocity, so the latents, ξ and
  the stored log-probabilities are those of a rollout without retain (bitwise where the velocity is: the main
  trajectory's velocity is computed in a call of its own when other branches share the step, which changes the
  rounding of a batched matmul at most).
* **Each step's graph starts at a detached latent**, as the update's recompute does: no gradient through the chain.

Memory: each retained step holds its forward activations for the batch until the update's first optimizer step
back-propagates them. Only the rollout batches that hold the first optimizer step's rows (``rows``, as reweight caps
its buffers) keep graphs: a later batch's could be read by no on-policy step and would be held through every native
step of the update. ``steps`` caps how many window steps are retained (the first M); the rest are recomputed
natively.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tpflow.types import RetainedPart, RetainedSteps, StepOutput


@dataclass(frozen=True)
class Retain:
    """Which window steps a rollout runs with gradients, and how the optimizer wants the velocity computed."""

    steps: int | None = None  # the first M window steps (None: all of them)
    keep_mean: bool = False  # keep the differentiable transition mean too (the KL with β > 0, RatioNorm)
    # the optimizer's context around the policy's velocity call (e.g. tpflow.guidance.conditional_only)
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # the first optimizer step's rows on this process (gradient_accumulation_steps × micro_batch_size): a rollout
    # batch of the epoch starting past them keeps no graphs (``for_batch``); None: every batch keeps them
    rows: int | None = None

    def covers(self, i: int) -> bool:
        """Whether window step i (0-based) is retained."""
        return self.steps is None or i < self.steps

    def for_credit(self, same_every_step: bool) -> Retain:
        """Graphs are per step whatever the credit."""
        return self

    def for_batch(self, first_row: int) -> Retain | None:
        """For the rollout batch whose first row is the process's epoch row ``first_row``: None past the first
        optimizer step's rows (the update's first step trains the epoch's first informative rows; a first-step
        micro-batch with a row past the kept batches recomputes natively). Which kept graphs the update uses is its
        decision (``retain_min_trained``)."""
        return None if self.rows is not None and first_row >= self.rows else self

    def log(self, backbone, engine, width: int) -> RetainedLog:
        """The record of one rollout batch."""
        return RetainedLog(self)


class RetainedLog:
    """The retained steps of one rollout batch, in window order."""

    def __init__(self, retain: Retain) -> None:
        self.retain = retain
        self.outputs: list[StepOutput] = []

    def covers(self, i: int) -> bool:
        return self.retain.covers(i)

    def velocity(self, call: Callable[[], Tensor], rows: int) -> Tensor:
        """The main trajectory's velocity with gradients, inside the optimizer's context."""
        with torch.enable_grad(), self.retain.context():
            return call()

    def skip(self, n: int) -> None:
        raise ValueError("retain keeps every window step of the one-window plan; a trained subset is reweight's.")

    def keep(self, out: StepOutput, n: int, pick: Tensor | None = None) -> None:
        """One retained step: ``Sampler.log_prob`` of the stored transition under the differentiable velocity (every
        row: ``pick`` must be None)."""
        if pick is not None:
            raise ValueError("retain keeps every row of a step; a trained subset is reweight's.")
        mean = out.mean if self.retain.keep_mean else None
        self.outputs.append(StepOutput(out.prev, mean, out.std.detach(), out.log_prob, out.std_dev_t.detach()))

    def stacked(self) -> RetainedSteps | None:
        if not self.outputs:
            return None
        with torch.enable_grad():  # the engine runs without gradients; the stacked graphs must keep theirs
            return self._stacked(self.outputs)

    def _stacked(self, outs: list[StepOutput]) -> RetainedSteps:
        def column(name: str) -> Tensor:  # [n, M]; a step's std may be one value for the whole batch
            return torch.stack([getattr(o, name).reshape(-1).expand_as(o.log_prob) for o in outs], dim=1)

        mean = torch.stack([o.mean for o in outs], dim=1) if self.retain.keep_mean else None
        return RetainedSteps((RetainedPart(column("log_prob"), mean, column("std"), column("std_dev_t")),), (0,))


def log_prob_with_grad(sampler, z_next: Tensor, z: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
                       noise_level: float) -> StepOutput:  # fmt: skip
    """``Sampler.log_prob`` of the detached sample ``z_next`` under the differentiable velocity ``v``."""
    with torch.enable_grad():
        return sampler.log_prob(z_next.detach(), z.detach(), v, sigma, sigma_next, noise_level)
