"""DiffusionNFT: policy optimisation on the forward (noising) process, from final samples only.

Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117), docs/nft.md.
Each final latent x₀ of the epoch is noised again and the trained velocity is pulled towards an implicit positive
policy and away from an implicit negative one around a frozen "old" velocity: the loss is ``tpflow.optim.nft_loss``.
The factor adv_clip_max / β in it is the public code's: it sets the gradient's size, which the norm clip sees. The
old policy is a copy of the adapter, soft-updated after each epoch's update
(θ_old ← η·θ_old + (1 − η)·θ with η = min(max(step − flat, 0)·rate, cap)), and the rollouts sample with it.
The update loop (``tpflow.optim.loop``) and the final-sample machinery (``tpflow.optim.final``: the draws, the old
copy, the update's passes) are objects and functions this class holds and calls.

GARDO on DiffusionNFT (docs/algorithm.md §10.9) is three options composed in: ``advantage_std = "none"`` (with the
``diversity-shaped`` reward), the KL to a held copy reset now and then (``adaptive_reference``,
``tpflow.optim.adaptive_reference``) and the KL weighted per sample by GARDO's gate (``kl_gate``,
``tpflow.optim.kl_gate``), each the grpo option of that name.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

from pydantic import Field, model_validator
from torch import Tensor

from tpflow import registry
from tpflow.devices import to_device
from tpflow.interfaces import Backbone, Sampler, capability
from tpflow.optim.adaptive_reference import AdaptiveReference, StepKL, adaptive_problems
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
from tpflow.optim.grpo_options import GRPOOptions
from tpflow.optim.kl_gate import GateFraction, KLGate, gate_problems
from tpflow.optim.loop import AdamWLoop, RowLoss, batch_layout, held
from tpflow.optim.nft_loss import NFTLoss, nft_loss, optimality
from tpflow.optim.options import BETA, FinalSampleOptions
from tpflow.optim.swap import swapped
from tpflow.registry import register
from tpflow.types import BatchLayout, Conditioning, Rollout

_GRPO = GRPOOptions.model_fields  # GARDO's options are grpo's, each described once (tests/test_option_descriptions.py)
GARDO_NFT = "GARDO's DiffusionNFT config: 0.02"


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

    advantage_std: Literal["population", "sample", "none"] = copy.copy(_GRPO["advantage_std"])
    adaptive_reference: bool = copy.copy(_GRPO["adaptive_reference"])
    reference_reset_every: int = copy.copy(_GRPO["reference_reset_every"])
    reference_reset_kl: float = copy.copy(_GRPO["reference_reset_kl"])
    reference_reset_kl_moves: bool = Field(
        False,
        description="With adaptive_reference: move the threshold at each reset as GARDO's DiffusionNFT script does "
        "(it starts at 0.15 there): max(it − 0.01, 0.1) after a reset more than reference_reset_every updates after "
        "the previous one, min(it + 0.01, 0.05) after one fewer than 5 after (tpflow.optim.adaptive_reference).",
    )
    kl_gate: bool = copy.copy(_GRPO["kl_gate"])
    kl_gate_main: str | None = copy.copy(_GRPO["kl_gate_main"])
    kl_gate_aux: list[str] = copy.copy(_GRPO["kl_gate_aux"])
    kl_gate_fraction: float = copy.copy(_GRPO["kl_gate_fraction"])
    kl_gate_min: float = copy.copy(_GRPO["kl_gate_min"])
    kl_gate_max: float = copy.copy(_GRPO["kl_gate_max"])
    kl_gate_history: int = copy.copy(_GRPO["kl_gate_history"])
    kl_gate_batch: int = Field(
        0,
        ge=0,
        description="With kl_gate: B > 0 weighs each sample's KL so that a step's KL term is the expectation of "
        "GARDO's DiffusionNFT rule over micro-batches of B samples (the mean KL of a micro-batch's gated samples, of "
        "all its samples when it holds none: B = 9 there), whatever the micro-batches; 0: the gated samples only, "
        "weighted 1/(gated fraction) (tpflow.optim.kl_gate.fallback_weights).",
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
    base seed and the number of updates are part of ``state_dict``, so a resumed run continues exactly; so are
    GARDO's reference copy and gate controller when those options are on.
    """

    consumes: Literal["transitions", "final_samples"] = "final_samples"
    layout_of = staticmethod(batch_layout)  # the layout from the options alone (tpflow validate)

    def __init__(self, options: NFTOptions | None = None) -> None:
        self.options = o = options if options is not None else NFTOptions()
        # autocast per forward, not per loss: the old policy is swapped in between the forwards of one loss
        self.loop = AdamWLoop("nft", autocast_each_loss=False)
        self.lagged = LaggedCopy("nft", o.seed)  # the old policy, the update count, the base seed
        adaptive = AdaptiveReference(o.reference_reset_every, o.reference_reset_kl, o.reference_reset_kl_moves)
        self.adaptive = adaptive if o.adaptive_reference else None  # GARDO's held reference, or the base model
        fraction = GateFraction(o.kl_gate_fraction, 0.1, o.kl_gate_min, o.kl_gate_max, o.kl_gate_history)
        self.gate = KLGate(o.kl_gate_main or "", o.kl_gate_aux, fraction, o.kl_gate_batch) if o.kl_gate else None
        self.step_kl = StepKL(adaptive, self.loop) if o.adaptive_reference else None  # what the reference observes

    global_step = held("global_step")  # the Optimizer protocol's, from the loop
    precision = held("precision", settable=True)

    @property
    def reads_reward_details(self) -> bool:
        """The KL gate ranks the final samples' reward parts (``Rollout.reward_details``)."""
        return self.options.kl_gate

    def uses_reference(self) -> bool:
        """The KL reference pass runs only with kl_weight > 0."""
        return self.options.kl_weight > 0

    def kept_copies(self) -> list[tuple[str, str]]:
        copies = [("old policy: a copy of the trained parameters", "samples the rollouts")]
        if self.adaptive is not None:
            copies.append(("reference: a copy of the trained parameters, reset now and then", "the KL's reference"))
        return copies

    @staticmethod
    def check_recipe(options: NFTOptions, settings: dict) -> list[str]:
        """Per-step credit refused (``outcome_only``), and GARDO's options' limits: each needs the KL
        (kl_weight > 0), the gate reward details the recipe's reward returns, and the nft-only refinements their
        option."""
        weight = ("kl_weight", options.kl_weight, GARDO_NFT)
        reward = settings.get("reward") if options.kl_gate else None  # the gate names its reward details
        keys = None if reward is None else capability(registry.get("reward", reward.name).factory, "detail_keys")
        problems = outcome_only("nft", settings) + adaptive_problems(options, weight)
        problems += gate_problems(options, None if keys is None else keys(reward.options), weight)
        for option, needs in (("kl_gate_batch", "kl_gate"), ("reference_reset_kl_moves", "adaptive_reference")):
            if getattr(options, option) and not getattr(options, needs):
                problems.append(
                    f"[optimizer] {option} is set without {needs} = true: it refines {needs} (GARDO's DiffusionNFT "
                    f"script, docs/algorithm.md §10.9) and would change nothing alone. Set {needs} = true or drop "
                    f"{option}."
                )
        return problems

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        """AdamW over the adapter (``AdamWLoop.bind``), the old policy as a copy of it, and the base seed (from the
        global RNG, which the trainer seeds with the run's seed, unless the ``seed`` option is set)."""
        self.loop.bind(self.options, backbone, accelerator, precision)
        self.lagged.bind(self.loop.params)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """[N, 1] float64: the group-normalised final reward (the last column of the step rewards, which ``outcome``
        fills with R_W), with ``global_std`` and ``advantage_std``, clipped at ``adv_clip_max``."""
        return final_advantages(step_rewards, groups, self.options)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The rollouts collect data with the old policy v_old, as the paper's algorithm does."""
        return self.lagged.swapped(self.loop.params)

    def state_dict(self, gather: bool = True) -> dict:
        extra = {} if self.adaptive is None else self.adaptive.state()
        return self.loop.state_dict({**self.lagged.state(), **extra, **(self.gate.state() if self.gate else {})},
                                    gather)  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        def load(state: dict) -> None:  # the old copy; GARDO's reference copy and gate controller, when on
            self.lagged.load(state, self.loop.params)
            if self.adaptive is not None:
                self.adaptive.load(state, self.loop.params)
            if self.gate is not None:
                self.gate.load(state)

        self.loop.load_state_dict(self.options, state, load)

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """One pass (``num_inner_epochs`` passes) over the final samples of ``batch`` with advantages [N, 1] (or
        [N, W]: the last column is read) as ``advantages`` returns them; then the old policy's soft update. With
        ``adaptive_reference`` the held copy is reset first when due, and each step's mean KL is observed; with
        ``kl_gate`` each sample's KL carries the gate's weight.

        ``on_step(n)`` runs right after each optimizer step taken (n: its 0-based index); a step the fp16 gradient
        scaler skips is not counted. ``sampler`` is not used: NFT needs no likelihood."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o, extra = self.options, {}
        gate = None
        if self.gate is not None:
            weights, gate_metrics = self.gate.row_weights(batch.reward_details, self.loop.dist)
            gate, extra = to_device(weights, batch.final.device), gate_metrics
        before_step = None
        if self.adaptive is not None:
            extra["reference_reset"] = float(self.adaptive.begin_update(self.loop.params))
            extra["reference_age"] = float(self.adaptive.updates - 1 - self.adaptive.last_reset)
            assert self.step_kl is not None
            on_step, before_step = self.step_kl.observing(on_step), self.step_kl.start
        times = functools.partial(draw_times, num_timesteps=o.num_timesteps, per_sample=o.timesteps_per_sample)
        method = NoisedMethod(lambda a: optimality(a, o.adv_clip_max), times, self._row_loss, o.kl_weight > 0,
                              reference=self._held_reference, kl_weights=gate)  # fmt: skip
        result, r = noised_update(self.loop, o, self.lagged, backbone, batch, advantages, method, on_step, before_step)
        decay = old_decay(self.loop.global_step, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)
        self.lagged.soft_update(self.loop.params, decay)
        self.lagged.updates += 1
        result.update(optimality_mean=float(r.mean()) if len(r) else 0.5, old_decay=decay, **extra)
        return result

    def _held_reference(self) -> contextlib.AbstractContextManager[None] | None:
        """GARDO's reference copy swapped into the adapter for the reference pass; None: the adapter-disabled model
        (no adaptive reference, or none copied yet)."""
        if self.adaptive is None or self.adaptive.copy is None:
            return None
        return swapped(self.loop.params, self.adaptive.copy)

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> NFTLoss:
        """The loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and optimality r
        [M]: v_old (old policy) and v_ref (adapter disabled, or GARDO's held copy) without grad, then v_θ with grad
        (what the memory estimate, ``tpflow.memory``, runs)."""
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        reference = batch.guidance if self.options.kl_weight > 0 else None
        ((_, v_old, v_ref),) = frozen_velocities(backbone, self.loop.precision, self.lagged.swapped(self.loop.params),
                                                 [(x_t, t)], cond, batch.guidance, reference=reference,
                                                 held=self._held_reference())  # fmt: skip
        return self._loss(backbone, x0, x_t, t, cond, batch.guidance, r, v_old, v_ref)

    def _loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, kl_weights: Tensor | None = None,
    ) -> NFTLoss:  # fmt: skip
        """The NFT loss from v_θ (the one forward with grad, in its own autocast region) and the frozen velocities."""
        o = self.options
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        return nft_loss(x0, x_t, t, v, v_old, r, o.beta, o.adv_clip_max, v_ref, o.kl_weight, kl_weights)

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor, kl_weights: Tensor | None = None,
    ) -> RowLoss:  # fmt: skip
        """:meth:`_loss` as the loop takes it: summed over the M samples, with its parts as row sums (the step's KL
        sum and rows kept for the adaptive reference)."""
        out = self._loss(backbone, x0, x_t, t, cond, guidance, r, v_old, v_ref, kl_weights)
        sums = {
            "loss": out.rows.detach().sum(),
            "policy_loss": out.policy_rows.sum(),
            "positive_loss": out.positive.sum(),
            "negative_loss": out.negative.sum(),
            "kl": out.kl_rows.sum(),
        }
        if self.step_kl is not None:
            self.step_kl.add(sums["kl"], out.kl_rows.numel())
        return row_loss(out.rows, sums)
