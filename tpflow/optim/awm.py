"""AWM, Advantage Weighted Matching: the flow-matching loss on final samples, weighted by their advantages.

Xue et al., arXiv 2509.25050 (24× over Flow-GRPO in its arXiv abstract); public code scxue/advantage_weighted_matching
(``scripts/train_sd3_awm.py``). What it shares with DiffusionNFT (``tpflow.optim.nft``, whose update loop this class
inherits): it trains on the epoch's final samples, re-noised by the forward process at times drawn from the
backbone's schedule with fresh noise, one outcome reward per image, a lagged copy of the adapter soft-updated after
each update, the KL to the adapter-disabled model. What differs is its loss only (``tpflow.optim.awm_loss``) and:

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
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.awm_loss import AWMLoss, Weighting, awm_loss, stratified_indices
from tpflow.optim.loop import RowLoss
from tpflow.optim.nft import NFT, SEED_LIMIT
from tpflow.optim.nft_loss import old_decay
from tpflow.plans.base import derived_generator
from tpflow.registry import register
from tpflow.types import Conditioning, Rollout


class AWMOptions(BaseModel):
    """Options of the ``awm`` optimizer; defaults are the public code's SD3.5-M GenEval config (``dgx_awm.py``) but
    ``train_guidance``, whose default keeps what tpflow ran before the option (the shipped recipes set the code's)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(3e-4, gt=0, description="AdamW learning rate (the code: 3e-4, in effect constant).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β1, β2).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip at each optimizer step.")
    kl_weight: float = Field(
        1e-3,
        ge=0,
        description="β: weight of mean((v_θ − v_ref)²) to the adapter-disabled model (GenEval 0.001, OCR 0.003, "
        "PickScore 0.0001); 0 skips the reference pass.",
    )
    ema_weight: float = Field(
        1.0, ge=0, description="γ: weight of mean((v_θ − v_ema)²) to the lagged adapter copy (the code's ema_beta)."
    )
    clip_range: float = Field(1.0, gt=0, description="ε of the ratio clip (inert on policy; the code: 1).")
    train_guidance: float | None = Field(
        None,
        ge=1,
        description="CFG of the loss's velocities (v_θ, the KL-EMA copy's and the reference's). The code's "
        "train.cfg = False, in every public config, is 1 (the conditional prediction; the shipped recipes set it); "
        "None trains at the rollout's guidance, as train.cfg = True would, and as tpflow did before this option "
        "(docs/results.md §2.8's AWM arm, at CFG 3).",
    )
    weighting: Weighting = Field("ghuber", description="The matching value ℓ(m, t) (tpflow/optim/awm_loss.py).")
    ghuber_power: float = Field(0.25, gt=0, le=1, description="p of the ghuber weighting.")
    adv_clip_max: float = Field(5.0, gt=0, description="c: A' = clip(A, ±c)/c (the code: 5).")
    global_std: bool = Field(True, description="Normalise the rewards by the std of the whole epoch (the code).")
    num_timesteps: int = Field(
        14, ge=2, le=1000, description="K of the backbone's schedule the training times are read from (the code: 14)."
    )
    train_timesteps: int = Field(6, ge=1, le=1000, description="T: stratified times per sample (the code: 6).")
    timestep_fraction: float = Field(
        0.9, gt=0, le=1, description="The strata end at index ⌊K·fraction⌋ (the code: 0.9): later times never train."
    )
    time_type: Literal["discrete_wo_init", "discrete"] = Field(
        "discrete_wo_init",
        description="'discrete_wo_init': strata from index 1 (never t = 1; GenEval, OCR); 'discrete': from 0 "
        "(PickScore).",
    )
    old_decay_flat: int = Field(0, ge=0, description="n (in old_decay_unit) before the lagged copy starts to lag.")
    old_decay_rate: float = Field(1e-3, ge=0, description="Growth of the copy's decay d per unit of n.")
    old_decay_max: float = Field(0.3, ge=0, lt=1, description="Cap of d (the code: 0.3).")
    old_decay_unit: Literal["epoch", "step"] = Field(
        "epoch",
        description="What n of d = min(rate·(n − flat), cap) counts: 'epoch', the updates so far, what the code "
        "does in effect (it takes one optimizer step per epoch and counts steps); 'step', the optimizer steps so far, "
        "what tpflow counted before this option (docs/results.md §2.8: 8 steps an epoch). The copy moves once per "
        "epoch either way.",
    )
    micro_batch_size: int = Field(3, ge=1, description="Samples per forward/backward pass (GenEval: 3).")
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step; the code takes one step per epoch (accumulation = the "
        "epoch's micro-batches): set micro_batch_size × this ≥ the samples of a process's epoch to match it.",
    )
    num_inner_epochs: int = Field(1, ge=1, description="Passes over the epoch's samples per update.")
    seed: int | None = Field(
        None, ge=0, lt=SEED_LIMIT, description="Seed of the update's draws; None derives it from the run's seed."
    )
    recompute: str = Field("native", description="Only 'native' (AWM trains on final samples, as NFT).")

    @model_validator(mode="after")
    def _fits(self) -> AWMOptions:
        if self.recompute != "native":
            raise ValueError(f'recompute = "{self.recompute}": awm trains on final samples (only "native").')
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
class AWM(NFT):
    """Advantage Weighted Matching (module docstring); every option is a field of :class:`AWMOptions`. The update
    loop, the draws of times and noise by global row, the lagged copy and its checkpointing are NFT's."""

    registered_name = "awm"

    def __init__(self, options: AWMOptions | None = None) -> None:
        super().__init__(options if options is not None else AWMOptions())  # type: ignore[arg-type]

    @staticmethod
    def check_recipe(options: AWMOptions, settings: dict) -> list[str]:
        """One reward per final image, as NFT: only the ``outcome`` credit."""
        credit = settings.get("credit")
        if credit is not None and credit.name != "outcome":
            return [
                f'[credit] name = "{credit.name}": the awm optimizer trains on final samples, one reward per image '
                "(re-noised by the forward process: no SDE window steps to credit apart). Set [credit] name = "
                '"outcome".'
            ]
        return []

    def uses_reference(self) -> bool:
        return self.options.kl_weight > 0

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("lagged (EMA) copy of the trained parameters", "the KL-EMA anchor")]

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The live adapter samples (the lagged copy is only the loss's anchor)."""
        return contextlib.nullcontext()

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """NFT's update (``tpflow.optim.nft``) of ``batch``'s final samples, its velocities at ``train_guidance``."""
        return super().update(backbone, sampler, self._at_train_guidance(batch), advantages, on_step)

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> AWMLoss:
        """NFT's one-batch ``loss`` (what the memory estimate runs), at ``train_guidance``."""
        return super().loss(backbone, self._at_train_guidance(batch), rows, r, t, noise)  # type: ignore[return-value]

    def _at_train_guidance(self, batch: Rollout) -> Rollout:
        """``batch`` with the guidance its loss's velocities run at (the rollout's when ``train_guidance`` is None)."""
        g = self.options.train_guidance
        return batch if g is None or g == batch.guidance else dataclasses.replace(batch, guidance=g)

    def _sample_weights(self, advantages: Tensor) -> Tensor:
        """A' = clip(A, ±c)/c ∈ [−1, 1]."""
        c = self.options.adv_clip_max
        return advantages.clamp(-c, c) / c

    def _draw_times(self, key: tuple[int, ...], first: int, n: int) -> Tensor:
        """[n, T] long: each sample's T stratified schedule indices, from (key, its global row)."""
        o = self.options
        lower, upper = o.strata_range
        uniforms = [torch.rand(o.train_timesteps, generator=derived_generator(*key, first + i, "awm-t"),
                               device="cpu") for i in range(n)]  # fmt: skip
        if not uniforms:
            return torch.zeros((0, o.train_timesteps), dtype=torch.long, device="cpu")
        return stratified_indices(torch.stack(uniforms), lower, upper, o.train_timesteps)

    def _pass_metrics(self, r: Tensor, decay: float) -> dict[str, float]:
        return {"advantage_weight_mean": float(r.abs().mean()) if len(r) else 0.0, "ema_decay": decay}

    def _old_decay(self) -> float:
        """d of the KL-EMA copy's move that ends this update: n the epochs so far, this one included (the code's
        step count at one step per epoch), or the optimizer steps so far (``old_decay_unit``)."""
        o = self.options
        n = self.updates + 1 if o.old_decay_unit == "epoch" else self.global_step
        return old_decay(n, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)

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
        with self.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        target = noise.to(torch.float64) - x0.detach().to(torch.float64)
        return awm_loss(v, target, t, r, o.clip_range, o.weighting, o.ghuber_power, v_ref, o.kl_weight, v_old,
                        o.ema_weight)  # fmt: skip

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor | None = None,
    ) -> RowLoss:  # fmt: skip
        out = self._loss(backbone, x0, x_t, t, cond, guidance, r, v_old, v_ref, noise)
        sums = {
            "loss": out.rows.detach().sum(),
            "policy_loss": out.policy_rows.sum().float(),
            "matching_mse": out.mse.sum().float(),
            "kl": out.kl_rows.sum().float(),
            "kl_ema": out.ema_rows.sum().float(),
        }
        count = torch.full((), float(out.rows.shape[0]), device=out.rows.device)
        return RowLoss(out.rows.sum(), count, sums)
