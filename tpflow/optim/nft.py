"""DiffusionNFT: policy optimisation on the forward (noising) process, from final samples only.

Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117), docs/nft.md.
Each final latent x₀ of the epoch is noised again and the trained velocity is pulled towards an implicit positive
policy and away from an implicit negative one around a frozen "old" velocity: the loss is ``tpflow.optim.nft_loss``.
The factor adv_clip_max / β in it is the public code's: it sets the gradient's size, which the norm clip sees. The
old policy is a copy of the adapter, soft-updated after each epoch's update
(θ_old ← η·θ_old + (1 − η)·θ with η = min(max(step − flat, 0)·rate, cap)), and the rollouts sample with it.
The update loop (``tpflow.optim.loop``) and the final-sample machinery (``tpflow.optim.final``: the draws, the old
copy, the update's passes) are objects and functions this class holds and calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

from pydantic import Field, model_validator
from torch import Tensor

from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.final import (
    LaggedCopy,
    NoisedMethod,
    draw_times,
    final_advantages,
    forward_noising,
    frozen_velocities,
    noised_update,
    old_decay,
    outcome_only,
    row_loss,
)  # fmt: skip
from tpflow.optim.loop import AdamWLoop, RowLoss, batch_layout, held
from tpflow.optim.nft_loss import NFTLoss, nft_loss, optimality
from tpflow.optim.options import BETA, FinalSampleOptions
from tpflow.registry import register
from tpflow.types import BatchLayout, Conditioning, Rollout


class NFTOptions(FinalSampleOptions):
    """Options of the ``nft`` optimizer; defaults are the public code's SD3.5-M GenEval settings (docs/nft.md). The
    AdamW, batching, advantage, KL, schedule, old-policy decay and seed fields are
    ``tpflow.optim.options.FinalSampleOptions``'."""

    beta: float = Field(1.0, gt=0, description=BETA)
    timesteps_per_sample: int = Field(
        9,
        ge=1,
        le=1000,
        description="Distinct times t (without replacement, in random order) each sample is trained at per inner "
        "epoch, each with fresh noise ε: int(K · 0.99) = 9 in the public code.",
    )

    @model_validator(mode="after")
    def _timesteps_fit(self) -> NFTOptions:
        if self.timesteps_per_sample > self.num_timesteps:
            raise ValueError(
                f"timesteps_per_sample={self.timesteps_per_sample} exceeds num_timesteps={self.num_timesteps}: each "
                "sample is trained at distinct times of a K-step schedule; lower it or raise num_timesteps."
            )
        return self


@register("optimizer", "nft", options=NFTOptions)
class NFT:
    """DiffusionNFT update (implements ``tpflow.interfaces.Optimizer``); every option is a field of
    :class:`NFTOptions`.

    It consumes final samples (``consumes``): the rollout stores no transitions, log-probs or completions, and the
    credit must be ``outcome`` (one reward per image). The rollouts sample with the old policy (``sampling_policy``).
    One ``update`` shuffles the samples, cuts micro-batches, and trains each at ``timesteps_per_sample`` times
    drawn from the backbone's schedule, each with fresh noise (``tpflow.optim.final.noised_update``); the loop, its
    uniform row weights (every (sample, t) of an optimizer step weighs the same), precision and AdamW are
    ``self.loop``'s. After the pass the old policy moves towards the adapter (:func:`old_decay`). The old copy, the
    base seed and the number of updates are part of ``state_dict``, so a resumed run continues exactly.
    """

    consumes: Literal["transitions", "final_samples"] = "final_samples"
    layout_of = staticmethod(batch_layout)  # the layout from the options alone (tpflow validate)

    def __init__(self, options: NFTOptions | None = None) -> None:
        self.options = options if options is not None else NFTOptions()
        # autocast per forward, not per loss: the old policy is swapped in between the forwards of one loss
        self.loop = AdamWLoop("nft", autocast_each_loss=False)
        self.lagged = LaggedCopy("nft", self.options.seed)  # the old policy, the update count, the base seed

    global_step = held("global_step")  # the Optimizer protocol's, from the loop
    precision = held("precision", settable=True)

    def uses_reference(self) -> bool:
        """The KL reference pass runs only with kl_weight > 0."""
        return self.options.kl_weight > 0

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("old policy: a copy of the trained parameters", "samples the rollouts")]

    @staticmethod
    def check_recipe(options: NFTOptions, settings: dict) -> list[str]:
        return outcome_only("nft", settings)

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        """AdamW over the adapter (``AdamWLoop.bind``), the old policy as a copy of it, and the base seed (from the
        global RNG, which the trainer seeds with the run's seed, unless the ``seed`` option is set)."""
        self.loop.bind(self.options, backbone, accelerator, precision)
        self.lagged.bind(self.loop.params)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """[N, 1] float64: the group-normalised final reward (the last column of the step rewards, which ``outcome``
        fills with R_W), with ``global_std`` and clipped at ``adv_clip_max``."""
        return final_advantages(step_rewards, groups, self.options)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The rollouts collect data with the old policy v_old, as the paper's algorithm does."""
        return self.lagged.swapped(self.loop.params)

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
        """One pass (``num_inner_epochs`` passes) over the final samples of ``batch`` with advantages [N, 1] (or
        [N, W]: the last column is read) as ``advantages`` returns them; then the old policy's soft update.

        ``on_step(n)`` runs right after each optimizer step taken (n: its 0-based index); a step the fp16 gradient
        scaler skips is not counted. ``sampler`` is not used: NFT needs no likelihood."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o = self.options
        times = functools.partial(draw_times, num_timesteps=o.num_timesteps, per_sample=o.timesteps_per_sample)
        method = NoisedMethod(lambda a: optimality(a, o.adv_clip_max), times, self._row_loss, o.kl_weight > 0)
        result, r = noised_update(self.loop, o, self.lagged, backbone, batch, advantages, method, on_step)
        decay = old_decay(self.loop.global_step, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)
        self.lagged.soft_update(self.loop.params, decay)
        self.lagged.updates += 1
        result.update(optimality_mean=float(r.mean()) if len(r) else 0.5, old_decay=decay)
        return result

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> NFTLoss:
        """The loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and optimality r
        [M]: v_old (old policy) and v_ref (adapter disabled) without grad, then v_θ with grad (what the memory
        estimate, ``tpflow.memory``, runs)."""
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        reference = batch.guidance if self.options.kl_weight > 0 else None
        ((_, v_old, v_ref),) = frozen_velocities(backbone, self.loop.precision, self.lagged.swapped(self.loop.params),
                                                 [(x_t, t)], cond, batch.guidance, reference=reference)  # fmt: skip
        return self._loss(backbone, x0, x_t, t, cond, batch.guidance, r, v_old, v_ref)

    def _loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None,
    ) -> NFTLoss:  # fmt: skip
        """The NFT loss from v_θ (the one forward with grad, in its own autocast region) and the frozen velocities."""
        o = self.options
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        return nft_loss(x0, x_t, t, v, v_old, r, o.beta, o.adv_clip_max, v_ref, o.kl_weight)

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor,
    ) -> RowLoss:  # fmt: skip
        """:meth:`_loss` as the loop takes it: summed over the M samples, with its parts as row sums."""
        out = self._loss(backbone, x0, x_t, t, cond, guidance, r, v_old, v_ref)
        sums = {
            "loss": out.rows.detach().sum(),
            "policy_loss": out.policy_rows.sum(),
            "positive_loss": out.positive.sum(),
            "negative_loss": out.negative.sum(),
            "kl": out.kl_rows.sum(),
        }
        return row_loss(out.rows, sums)
