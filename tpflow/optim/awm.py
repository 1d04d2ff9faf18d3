"""AWM, Advantage Weighted Matching: the flow-matching loss on final samples, weighted by their advantages.

Xue et al., arXiv 2509.25050 (24× over Flow-GRPO in its arXiv abstract); public code scxue/advantage_weighted_matching
(``scripts/train_sd3_awm.py``). What it shares with DiffusionNFT (``tpflow.optim.nft``; both call
``tpflow.optim.final``, neither inherits the other): it trains on the epoch's final samples, re-noised by the
forward process at times drawn from the backbone's schedule with fresh noise, one outcome reward per image, a lagged
copy of the adapter soft-updated after each update, the KL to the adapter-disabled model. What differs is its loss
only (``tpflow.optim.awm_loss``) and:

* the rollouts sample with the live adapter (the code's ``off_policy = False``); the lagged copy is the "KL-EMA"
  anchor of the loss, θ_ema ← d·θ_ema + (1 − d)·θ after each update (epoch) with d = min(0.001·n, 0.3). The code's
  n is its optimizer steps so far, and it takes one step per epoch, so in effect n counts epochs: n is the epochs
  so far with ``old_decay_unit = "epoch"`` (the default), the optimizer steps with ``"step"`` (what tpflow counted
  before the option; the two differ only where an epoch takes several steps);
* the advantages are rescaled to A' = clip(A, ±c)/c ∈ [−1, 1];
* the training times are stratified: T = 6 schedule indices, one per stratum of bounds long(linspace(lower,
  ⌊K·0.9⌋, T + 1)) (lower = 1: the code's ``discrete_wo_init``, 0: ``discrete``);
* the loss's three velocities (v_θ, the KL-EMA copy's, the reference's) run at ``train_guidance``: the code's
  ``train.cfg`` is False in every public config (``base_awm.py`` and all six of ``dgx_awm.py``), so it trains the
  conditional prediction (CFG 1); ``train.cfg = True`` would train at the sampling ``guidance_scale``, which is
  ``train_guidance = None`` here.

Where tpflow departs from the code, and why (docs/algorithm.md, "AWM"): the code draws the T indices once per
micro-batch, shared by its samples; here each sample draws its own from its global row (as NFT's times), so that an
optimizer step's gradient does not depend on how its rows are cut into micro-batches or spread over processes. The
expectation over the draw is the same. The code's SA-Solver rollout is not reproduced: the recipe's sampler makes
the final samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.awm_loss import AWMLoss, Weighting, awm_loss, stratified_indices
from tpflow.optim.final import (
    LaggedCopy,
    NoisedMethod,
    final_advantages,
    forward_noising,
    frozen_velocities,
    noised_update,
    old_decay,
    outcome_only,
    row_loss,
)  # fmt: skip
from tpflow.optim.loop import AdamWLoop, RowLoss, batch_layout, held
from tpflow.optim.options import (
    CLIP_RANGE,
    TRAIN_GUIDANCE,
    TRAIN_TIMESTEPS,
    DecayUnit,
    FinalSampleOptions,
    KLWeight,
    MicroBatchSize,
    NumTimesteps,
    OldDecayMax,
)  # fmt: skip
from tpflow.plans.base import derived_generator
from tpflow.registry import register
from tpflow.types import BatchLayout, Conditioning, Rollout


class AWMOptions(FinalSampleOptions):
    """Options of the ``awm`` optimizer; defaults are the public code's SD3.5-M GenEval config (``dgx_awm.py``) but
    ``train_guidance``, whose default keeps what tpflow ran before the option (the shipped recipes set the code's).
    The AdamW, batching, advantage, KL, schedule, lagged-copy decay and seed fields are
    ``tpflow.optim.options.FinalSampleOptions``'; the code's values differ from NFT's in the defaults below."""

    micro_batch_size: MicroBatchSize = 3
    kl_weight: KLWeight = 1e-3
    num_timesteps: NumTimesteps = 14
    old_decay_max: OldDecayMax = 0.3
    old_decay_unit: DecayUnit = "epoch"
    ema_weight: float = Field(
        1.0, ge=0, description="γ: weight of mean((v_θ − v_ema)²) to the lagged adapter copy (the code's ema_beta)."
    )
    clip_range: float = Field(1.0, gt=0, description=CLIP_RANGE)
    train_guidance: float | None = Field(None, ge=1, description=TRAIN_GUIDANCE)
    weighting: Weighting = Field("ghuber", description="The matching value ℓ(m, t) (tpflow/optim/awm_loss.py).")
    ghuber_power: float = Field(0.25, gt=0, le=1, description="p of the ghuber weighting.")
    train_timesteps: int = Field(6, ge=1, le=1000, description=TRAIN_TIMESTEPS)
    timestep_fraction: float = Field(
        0.9, gt=0, le=1, description="The strata end at index ⌊K·fraction⌋ (the code: 0.9): later times never train."
    )
    time_type: Literal["discrete_wo_init", "discrete"] = Field(
        "discrete_wo_init",
        description="'discrete_wo_init': strata from index 1 (never t = 1; GenEval, OCR); 'discrete': from 0 "
        "(PickScore).",
    )

    @model_validator(mode="after")
    def _fits(self) -> AWMOptions:
        lower, upper = self.strata_range
        if upper - lower < self.train_timesteps:
            raise ValueError(
                f"train_timesteps={self.train_timesteps} strata do not fit schedule indices {lower}..{upper - 1} "
                f"(num_timesteps={self.num_timesteps}, timestep_fraction={self.timestep_fraction}): lower "
                "train_timesteps or raise num_timesteps."
            )
        return self

    @property
    def strata_range(self) -> tuple[int, int]:
        """(lower, upper) schedule indices of the strata's bounds."""
        return (1 if self.time_type == "discrete_wo_init" else 0), int(self.num_timesteps * self.timestep_fraction)


@register("optimizer", "awm", options=AWMOptions)
class AWM:
    """Advantage Weighted Matching (module docstring; implements ``tpflow.interfaces.Optimizer``); every option is a
    field of :class:`AWMOptions`. The update's passes, the draws of noise by global row, the lagged copy and its
    checkpointing are ``tpflow.optim.final``'s; the loop is ``self.loop``."""

    consumes: Literal["transitions", "final_samples"] = "final_samples"
    layout_of = staticmethod(batch_layout)  # the layout from the options alone (tpflow validate)

    def __init__(self, options: AWMOptions | None = None) -> None:
        self.options = options if options is not None else AWMOptions()
        self.loop = AdamWLoop("awm", autocast_each_loss=False)  # the lagged copy is swapped in between forwards
        self.lagged = LaggedCopy("awm", self.options.seed)  # the KL-EMA anchor, the update count, the base seed

    global_step = held("global_step")  # the Optimizer protocol's, from the loop
    precision = held("precision", settable=True)

    @staticmethod
    def check_recipe(options: AWMOptions, settings: dict) -> list[str]:
        return outcome_only("awm", settings)

    def uses_reference(self) -> bool:
        return self.options.kl_weight > 0

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("lagged (EMA) copy of the trained parameters", "the KL-EMA anchor")]

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The live adapter samples (the lagged copy is only the loss's anchor)."""
        return contextlib.nullcontext()

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        """AdamW over the adapter, the lagged copy as a copy of it, the base seed (``tpflow.optim.final``)."""
        self.loop.bind(self.options, backbone, accelerator, precision)
        self.lagged.bind(self.loop.params)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """[N, 1] float64: the group-normalised final reward, with ``global_std`` and clipped at ``adv_clip_max``."""
        return final_advantages(step_rewards, groups, self.options)

    def state_dict(self, gather: bool = True) -> dict:
        return self.loop.state_dict(self.lagged.state(), gather)

    def load_state_dict(self, state: dict) -> None:
        self.loop.load_state_dict(self.options, state, lambda s: self.lagged.load(s, self.loop.params))

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """The final-sample update (``tpflow.optim.final.noised_update``) of ``batch`` at ``train_guidance``, each
        sample at its stratified times, weighted by A'; then the KL-EMA copy's move."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o = self.options
        method = NoisedMethod(self._weights, self._times, self._row_loss, o.kl_weight > 0)
        result, r = noised_update(self.loop, o, self.lagged, backbone, self._at_train_guidance(batch), advantages,
                                  method, on_step)  # fmt: skip
        # d: n the epochs so far, this one included (the code's step count at one step per epoch), or the steps
        n = self.lagged.updates + 1 if o.old_decay_unit == "epoch" else self.loop.global_step
        decay = old_decay(n, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)
        self.lagged.soft_update(self.loop.params, decay)
        self.lagged.updates += 1
        result.update(advantage_weight_mean=float(r.abs().mean()) if len(r) else 0.0, ema_decay=decay)
        return result

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> AWMLoss:
        """The loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and weights A' [M],
        at ``train_guidance``: the lagged copy's and the reference's velocities without grad, then v_θ with grad
        (what the memory estimate runs). ε is recovered from x_t, as the loss of one noised batch."""
        batch = self._at_train_guidance(batch)
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        reference = batch.guidance if self.options.kl_weight > 0 else None
        ((_, v_old, v_ref),) = frozen_velocities(backbone, self.loop.precision, self.lagged.swapped(self.loop.params),
                                                 [(x_t, t)], cond, batch.guidance, reference=reference)  # fmt: skip
        return self._loss(backbone, x0, x_t, t, cond, batch.guidance, r, v_old, v_ref)

    def _at_train_guidance(self, batch: Rollout) -> Rollout:
        """``batch`` with the guidance its loss's velocities run at (the rollout's when ``train_guidance`` is None)."""
        g = self.options.train_guidance
        return batch if g is None or g == batch.guidance else dataclasses.replace(batch, guidance=g)

    def _weights(self, advantages: Tensor) -> Tensor:
        """A' = clip(A, ±c)/c ∈ [−1, 1]."""
        c = self.options.adv_clip_max
        return advantages.clamp(-c, c) / c

    def _times(self, key: tuple[int, ...], rows: Sequence[int]) -> Tensor:
        """[n, T] long: each sample's T stratified schedule indices, from (key, its epoch row)."""
        o = self.options
        lower, upper = o.strata_range
        uniforms = [torch.rand(o.train_timesteps, generator=derived_generator(*key, row, "awm-t"),
                               device="cpu") for row in rows]  # fmt: skip
        if not uniforms:
            return torch.zeros((0, o.train_timesteps), dtype=torch.long, device="cpu")
        return stratified_indices(torch.stack(uniforms), lower, upper, o.train_timesteps)

    def _loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor | None = None,
    ) -> AWMLoss:  # fmt: skip
        """The AWM loss from v_θ (the one forward with grad, in its own autocast region), the target u = ε − x₀,
        the lagged copy's velocity (``v_old``) and the reference's."""
        o = self.options
        if noise is None:  # the public ``loss`` path: ε from x_t = (1 − t)·x₀ + t·ε
            tt = t.reshape(-1, *([1] * (x0.dim() - 1))).double()
            noise = (x_t.double() - (1 - tt) * x0.double()) / tt
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        target = noise.to(torch.float64) - x0.detach().to(torch.float64)
        return awm_loss(v, target, t, r, o.clip_range, o.weighting, o.ghuber_power, v_ref, o.kl_weight, v_old,
                        o.ema_weight)  # fmt: skip

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor,
    ) -> RowLoss:  # fmt: skip
        out = self._loss(backbone, x0, x_t, t, cond, guidance, r, v_old, v_ref, noise)
        sums = {
            "loss": out.rows.detach().sum(),
            "policy_loss": out.policy_rows.sum().float(),
            "matching_mse": out.mse.sum().float(),
            "kl": out.kl_rows.sum().float(),
            "kl_ema": out.ema_rows.sum().float(),
        }
        return row_loss(out.rows, sums)
