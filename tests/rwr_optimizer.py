"""Reward-weighted flow matching, ``[optimizer] name = "rwr-example"``: the method docs/adding_an_optimizer.md walks
through, built from tpflow's parts the way the built-in ``nft``, ``awm`` and ``dgpo`` are. Importing this module
registers it (tests/test_adding_an_optimizer.py does).

Reward-weighted regression (Peters & Schaal, ICML 2007), as Lee et al. weight the likelihood of text-to-image samples
by their reward (arXiv 2302.12192): each final sample x₀ is noised again, x_t = (1 − t)·x₀ + t·ε, and the
flow-matching loss against the target u = ε − x₀ is weighted by w = exp(A / τ) of the sample's group-normalised
advantage A (clipped at ±adv_clip_max):

    L = mean_rows w · mean_elems (v_θ(x_t, t) − u)²  +  kl_weight · mean_elems (v_θ − v_ref)²
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from tpflow import register
from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.final import (
    LaggedCopy,
    NoisedMethod,
    draw_times,
    final_advantages,
    noised_update,
    outcome_only,
    row_loss,
)
from tpflow.optim.loop import AdamWLoop, RowLoss, batch_layout, held
from tpflow.optim.options import FinalSampleOptions
from tpflow.types import BatchLayout, Conditioning, Rollout


# ---- 1. options: the shared fields come from the base; declare only the method's own -------------------------------
class RWROptions(FinalSampleOptions):
    """Options of ``rwr-example``: AdamW, batching, advantages, KL, the schedule and the seed are
    ``FinalSampleOptions``' (it keeps no lagged copy: its decay fields are unused)."""

    temperature: float = Field(1.0, gt=0, description="τ of the sample weight w = exp(A / τ).")
    timesteps_per_sample: int = Field(4, ge=1, le=1000, description="Distinct times t per sample and pass.")

    @model_validator(mode="after")
    def _fits(self) -> RWROptions:
        if self.timesteps_per_sample > self.num_timesteps:
            raise ValueError(f"timesteps_per_sample={self.timesteps_per_sample} exceeds num_timesteps.")
        return self


# ---- 2. the loss: a pure function of tensors, tested against a float64 hand computation ----------------------------
@dataclass(frozen=True)
class RWRLoss:
    rows: Tensor  # [N] differentiable: w·mse + kl_weight·KL
    mse: Tensor  # [N] detached mean (v_θ − u)²
    kl_rows: Tensor  # [N] detached mean (v_θ − v_ref)² (zeros without a reference)


def rwr_loss(v: Tensor, target: Tensor, weight: Tensor, v_ref: Tensor | None = None, kl: float = 0.0) -> RWRLoss:
    """The loss (module docstring) of N rows: v, target u [N, ...], the weights w [N]; in float64."""
    n = v.shape[0]
    mse = (v.double() - target.detach().double()).square().reshape(n, -1).mean(dim=1)
    rows, kl_rows = weight.detach().double() * mse, torch.zeros_like(mse)
    if v_ref is not None and kl > 0:
        kl_rows = (v.double() - v_ref.detach().double()).square().reshape(n, -1).mean(dim=1)
        rows = rows + kl * kl_rows
    return RWRLoss(rows.float(), mse.detach(), kl_rows.detach())


# ---- 3. the optimizer: the Optimizer protocol, holding the loop and calling the final-sample parts -----------------
@register("optimizer", "rwr-example", options=RWROptions)
class RWR:
    """Reward-weighted flow matching on final samples (module docstring)."""

    consumes: Literal["transitions", "final_samples"] = "final_samples"  # the rollout stores no window
    layout_of = staticmethod(batch_layout)  # micro-batches from the options alone (tpflow validate)

    def __init__(self, options: RWROptions | None = None) -> None:
        self.options = options if options is not None else RWROptions()
        self.loop = AdamWLoop("rwr-example", autocast_each_loss=False)  # AdamW, the row-weighted loop, state
        self.lagged = LaggedCopy("rwr-example", self.options.seed, copy=False)  # the draws' seed and update count

    global_step = held("global_step")  # the Optimizer protocol's, from the loop

    @staticmethod
    def check_recipe(options: RWROptions, settings: dict) -> list[str]:
        return outcome_only("rwr-example", settings)  # one reward per image

    def uses_reference(self) -> bool:
        return self.options.kl_weight > 0

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the live adapter samples

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        self.loop.bind(self.options, backbone, accelerator, precision)
        self.lagged.bind(self.loop.params)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
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
        """The samples shuffled into micro-batches, each trained at its own times with its own noise
        (``noised_update``); the loop divides each step's gradient by its rows."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o = self.options
        times = functools.partial(draw_times, num_timesteps=o.num_timesteps, per_sample=o.timesteps_per_sample)

        def weights(advantages: Tensor) -> Tensor:  # [N] w = exp(A / τ)
            return torch.exp(advantages / o.temperature)

        method = NoisedMethod(weights, times, self._row_loss, kl=o.kl_weight > 0, old=False)
        result, w = noised_update(self.loop, o, self.lagged, backbone, batch, advantages, method, on_step)
        self.lagged.updates += 1  # the next update draws afresh
        result["weight_mean"] = float(w.mean()) if len(w) else 1.0
        return result

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, w: Tensor,
        v_old: Tensor | None, v_ref: Tensor | None, noise: Tensor,
    ) -> RowLoss:  # fmt: skip
        """One micro-batch at one time: v_θ with grad in its own autocast region, the loss summed over its rows."""
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        out = rwr_loss(v, noise.float() - x0.float(), w, v_ref, self.options.kl_weight)
        sums = {"loss": out.rows.detach().sum(), "matching_mse": out.mse.sum().float(),
                "kl": out.kl_rows.sum().float()}  # fmt: skip
        return row_loss(out.rows, sums)
