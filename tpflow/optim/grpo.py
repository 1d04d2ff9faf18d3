"""The GRPO policy loss: PPO-clipped likelihood ratio per window step, plus a KL to the adapter-disabled model.

docs/algorithm.md §6 is the specification. For one micro-batch of trajectories at window position i the loss is

    L = mean_b max(−Â_b·κ_b, −Â_b·clip(κ_b, 1 − ε, 1 + ε))  +  β · mean_b KL_b,    κ_b = exp(ℓ_θ,b − ℓ_old,b)

(``tpflow.optim.grpo_loss``: :func:`clipped_surrogate` and :func:`kl_to_reference`). The update sums these per-row
terms and divides each optimizer step's gradient by its number of trained rows over every process
(``tpflow.optim.loop``, docs/algorithm.md §8 D10), so that every (trajectory, window step) of a step weighs the same.
The registered optimizer ``grpo`` holds the options (:class:`GRPOOptions`, the SD3.5-M paper settings of
docs/algorithm.md §6.3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from tpflow import registry
from tpflow.devices import to_device
from tpflow.errors import UserError
from tpflow.guidance import conditional_only
from tpflow.interfaces import Backbone, Sampler, capability
from tpflow.optim.adaptive_reference import AdaptiveReference, StepKL, adaptive_problems
from tpflow.optim.advantage_fusion import RunningReward, fusion_problems, with_fusion
from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.grpo_loss import PolicyLoss, clipped_surrogate, kl_to_reference
from tpflow.optim.grpo_options import GRPOOptions
from tpflow.optim.kl_gate import GateFraction, KLGate, gate_problems
from tpflow.optim.loop import AdamWLoop, LossThunk, RowLoss, batch_layout, held
from tpflow.optim.ratio_norm import normalised_log_ratio
from tpflow.optim.recompute import retain_problems, retained_passes, retained_step, reweighted_loss
from tpflow.optim.replay_weights import corrected
from tpflow.optim.step_weights import noise_aware_weights, transition_std
from tpflow.optim.swap import swapped
from tpflow.precision import Precision
from tpflow.registry import register
from tpflow.rollout.retain import Retain
from tpflow.rollout.reweight import Reweight
from tpflow.types import BatchLayout, ReweightedSteps, Rollout, StepOutput


@register("optimizer", "grpo", options=GRPOOptions)
class GRPO:
    """GRPO update (implements ``tpflow.interfaces.Optimizer``); every option is a field of :class:`GRPOOptions`.

    One ``update`` walks the epoch's trajectories in micro-batches of ``micro_batch_size`` (in order, as the
    reference), and for each micro-batch the W window steps in order: recompute the velocity with grad, re-score the
    stored transition (``Sampler.log_prob``), take the clipped surrogate and, when β > 0, the KL to the
    adapter-disabled model (``Backbone.reference``). A window step's rows whose transition std is 0 (cps at σ⁺ = 0)
    carry no likelihood ratio and are never trained: they are masked out, row by row. The loop, the uniform row
    weights of each optimizer step (every trained (trajectory, window step) row of every process weighs the same),
    precision and AdamW are those of ``self.loop``, the ``tpflow.optim.loop.AdamWLoop`` it holds.
    """

    consumes: Literal["transitions", "final_samples"] = "transitions"  # the window's stored SDE steps
    layout_of = staticmethod(batch_layout)  # the layout from the options alone (tpflow validate)

    @property
    def needs_old_means(self) -> bool:
        """Whether the rollout must store each step's transition mean μ_old (``Rollout.means``): RatioNorm."""
        return self.options.ratio_norm

    @property
    def retain(self) -> Retain | Reweight | None:
        """What the rollout keeps with gradients for ``recompute = "retain"`` (``tpflow.rollout.retain``) or
        ``"reweight"`` (``tpflow.rollout.reweight``), else None: the first ``max_retained_steps`` window steps, the
        velocity through the CFG branches ``cfg_gradient`` names; retain keeps the means when the KL or RatioNorm
        reads them, reweight back-propagates at the loss scale the update will use."""
        o = self.options
        conditional = o.cfg_gradient == "conditional"
        first_step = o.gradient_accumulation_steps * o.micro_batch_size  # rows of the on-policy step
        if o.recompute == "reweight":
            weighted = o.step_weight != "uniform" or o.ratio_norm_reweight
            return Reweight(o.max_retained_steps, weighted, context=lambda: conditional_only(conditional),
                            loss_scale=lambda: self.precision.loss_scale(), rows=first_step)  # fmt: skip
        if o.recompute != "retain":
            return None
        return Retain(o.max_retained_steps, o.beta > 0 or o.ratio_norm, lambda: conditional_only(conditional),
                      rows=first_step)  # fmt: skip

    def __init__(self, options: GRPOOptions | None = None) -> None:
        self.options = options if options is not None else GRPOOptions()
        self.loop = AdamWLoop("grpo")
        o = self.options  # GARDO's adaptive reference (tpflow.optim.adaptive_reference), or None: the base model
        adaptive = o.adaptive_reference
        self.adaptive = AdaptiveReference(o.reference_reset_every, o.reference_reset_kl) if adaptive else None
        self.step_kl = StepKL(self.adaptive, self.loop) if adaptive else None  # what the reference observes
        fraction = GateFraction(o.kl_gate_fraction, 0.1, o.kl_gate_min, o.kl_gate_max, o.kl_gate_history)
        self.gate = KLGate(o.kl_gate_main or "", o.kl_gate_aux, fraction) if o.kl_gate else None  # GARDO's gated KL
        self.running_reward = RunningReward()  # read by advantage_fusion; the prompt policy's own, set at build

    @property
    def reads_reward_details(self) -> bool:
        """The KL gate ranks the final samples' reward parts (``Rollout.reward_details``)."""
        return self.options.kl_gate

    global_step = held("global_step")  # the Optimizer protocol's, from the loop
    precision = held("precision", settable=True)

    def bind(self, backbone: Backbone, accelerator=None, precision: Precision | None = None) -> None:
        """AdamW over the adapter (``AdamWLoop.bind``)."""
        self.loop.bind(self.options, backbone, accelerator, precision)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The live adapter collects the rollouts."""
        return contextlib.nullcontext()

    def state_dict(self, gather: bool = True) -> dict:
        """The loop's state (AdamW, the step count, the fp16 scaler) and, with ``adaptive_reference``, the reference
        copy and its counters; with ``kl_gate``, the gate's φ and its history."""
        extra = {} if self.adaptive is None else self.adaptive.state()
        return self.loop.state_dict({**extra, **(self.gate.state() if self.gate else {})}, gather)

    def load_state_dict(self, state: dict) -> None:
        def load(state: dict) -> None:  # the adaptive reference's copy and the gate's controller, when on
            if self.adaptive is not None:
                self.adaptive.load(state, self.loop.params)
            if self.gate is not None:
                self.gate.load(state)

        self.loop.load_state_dict(self.options, state, load)

    def uses_reference(self) -> bool:
        """The KL reference pass runs only with beta > 0."""
        return self.options.beta > 0

    @staticmethod
    def check_recipe(options: GRPOOptions, settings: dict) -> list[str]:
        """The recipe's limits for GRPO, checked by ``tpflow validate`` before anything loads: a group of one image
        per prompt has advantage (r - mean) / std = 0 at every step, and a window sampled with noise level 0 is the
        ODE (every transition has std 0, so no likelihood ratio): either way nothing would ever train."""
        problems = fusion_problems(options, settings)  # advantage_fusion's (tpflow.optim.advantage_fusion)
        group_size = settings["train"].group_size
        if group_size < 2:
            problems.append(
                f"[train] group_size = {group_size}: GRPO normalises each reward within its prompt's group of G "
                "images, so with G = 1 every advantage is 0 and nothing trains. Use group_size >= 2 (the paper: 24)."
            )
        noise_level = settings["rollout"].noise_level
        if noise_level == 0:
            problems.append(
                f"[rollout] noise_level = {noise_level:g}: the SDE window is then the deterministic ODE, every "
                "transition has std 0 and no likelihood ratio, and GRPO never trains such a step, so nothing trains. "
                "Use the paper's 0.7 (any value > 0; at most 1 for the cps sampler)."
            )
        guidance = settings["rollout"].guidance
        if options.cfg_gradient == "conditional" and guidance == 1:
            problems.append(
                f'[optimizer] cfg_gradient = "conditional" with [rollout] guidance = {guidance:g}: at guidance 1 '
                "there is no unconditional branch to hold constant, so the option would change nothing. Drop it, or "
                "set the guidance of the method you reproduce (SD3.5: 4.5)."
            )
        backbone = settings.get("backbone")
        if (options.cfg_gradient == "conditional" and guidance != 1 and backbone is not None
                and not capability(registry.get("backbone", backbone.name).factory, "cfg_branch")):  # fmt: skip
            problems.append(
                f'[optimizer] cfg_gradient = "conditional" holds the unconditional branch of classifier-free guidance '
                f"constant, and [backbone] name = {backbone.name!r} is guidance-distilled (its guidance "
                f"{guidance:g} is an embedding of one call, no unconditional branch). Drop the option."
            )
        problems += retain_problems(options, settings) + adaptive_problems(options)
        reward = settings.get("reward") if options.kl_gate else None  # the gate names its reward details
        keys = None if reward is None else capability(registry.get("reward", reward.name).factory, "detail_keys")
        problems += gate_problems(options, None if keys is None else keys(reward.options))
        sampler = settings["sampler"].name
        if options.ratio_norm and not capability(registry.get("sampler", sampler).factory, "gaussian_log_prob"):
            problems.append(
                f"[optimizer] ratio_norm = true needs a log-probability that is the Gaussian density the sampler "
                f"draws from (RatioNorm rescales it by the step's std), and sampler {sampler!r} has none (cps scores "
                'a surrogate without 1/(2·std²)). Use [sampler] name = "flow-sde" (GRPO-Guard) or "dance-sde", or '
                "drop ratio_norm."
            )
        return problems

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """Group-normalised advantages [N, W] float64 of step rewards [N, W] (docs/algorithm.md §5), with this
        optimizer's ``global_std``, ``advantage_std``, ``advantage_eps``, ``adv_clip_max`` and ``advantage_fusion``:
        the one place they are applied. ``groups`` holds one prompt key per row (equal keys form a group)."""
        o = self.options
        correction = 1 if o.advantage_std == "sample" else 0
        own = group_advantages(step_rewards, groups, global_std=o.global_std, eps=o.advantage_eps, clip=o.adv_clip_max,
                               correction=correction, divide=o.advantage_std != "none")  # fmt: skip
        return with_fusion(own, step_rewards, groups, self.running_reward, o)  # advantage_fusion's part, if on

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """One pass (``num_inner_epochs`` passes) over ``batch`` with advantages [N, W] as ``advantages`` returns them
        (any device: they are moved to the batch's; not clipped again); returns mean metrics.

        ``on_step(n)`` is called right after each optimizer step taken, with n its 0-based index (``global_step``
        before it): the trainer's EMA averages the weights of every step, not the epoch's last ones only. A step the
        fp16 gradient scaler skips (inf/NaN gradients) is not taken: it is not counted in ``global_step``, does not
        call ``on_step``, and shows in the ``skipped_steps`` metric."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o = self.options
        # the advantages' shape checked, rows replayed from earlier epochs corrected (tpflow.optim.replay_weights)
        batch, advantages, replay = corrected(o, self.precision, backbone, sampler, batch, advantages)
        width = batch.log_probs.shape[1]
        # Advantages are host bookkeeping (float64, CPU); they join the stored transitions on the rollout's device
        # here, once (tpflow.devices, rule 2), so every index and loss below stays on one device. The noise levels
        # stay on the host too: the sampler checks them there, without a device read per step.
        adv = advantages.to(device=batch.device, dtype=torch.float32)  # [N, W], clipped by self.advantages
        sigmas = batch.sigmas.cpu()  # [N, W + 1]
        host_adv = advantages.detach().cpu()  # [N, W] the one host copy: the rows kept, the retained steps' check
        rows, micro_batches = self._micro_batches(host_adv, batch.device)
        passes, use_retained = retained_passes(batch, micro_batches, o, host_adv)  # tpflow.optim.recompute
        plain = dataclasses.replace(batch, retained=None, reward_details=None)  # indexed; graphs come by host rows
        trained = None if batch.trained is None else batch.trained.cpu()  # [N, W] host: a rollout plan's subset
        weights = self._step_weights(sampler, sigmas, batch.noise_level, trained)  # [N, W] host, or None: all 1
        weights = None if weights is None else weights.to(batch.device)
        # reweight's buffers serve the first step only, before the fp16 scaler moves: its scale read once
        scale = self.precision.loss_scale() if isinstance(batch.retained, ReweightedSteps) else 1.0
        gate, gate_metrics = self._gate_weights(batch)  # [N] each row's KL weight on the device, or None: 1

        def losses(mb: tuple[Tensor, Tensor, bool]) -> Iterator[LossThunk]:
            device_rows, host_rows, use_retained = mb
            kept = batch.retained.select(host_rows) if use_retained and batch.retained is not None else None
            first = 0  # reweight: its first M steps come formed, in one loss; the rest native
            if isinstance(kept, ReweightedSteps):
                weight = None if weights is None else weights[device_rows]
                yield functools.partial(reweighted_loss, kept, adv[device_rows], weight, batch.log_probs[device_rows],
                                        scale)  # fmt: skip
                first, kept = kept.steps, None
            if trained is not None:  # a plan's subset of (trajectory, step) pairs: packed, nothing else computed
                mask = trained[host_rows].clone()
                mask[:, :first] = False  # the pairs reweight formed
                yield from self._packed_losses(backbone, sampler, batch, adv, sigmas, (weights, gate), mask,
                                               (device_rows, host_rows))  # fmt: skip
                return
            part, host = plain.index(device_rows), sigmas[host_rows]
            kl_weight = None if gate is None else gate[device_rows]
            for i in range(first, width):
                weight = None if weights is None else weights[device_rows, i]
                out = retained_step(kept, part, i)
                yield functools.partial(self._step_loss, backbone, sampler, part, adv[device_rows, i], i,
                                        host[:, i : i + 2], weight, out, kl_weight)  # fmt: skip

        first_row = torch.zeros(1, dtype=torch.long, device="cpu")  # a sharded step's padding: row 0, weight 0
        result = self._run(passes, losses, on_step, filler=(first_row.to(batch.device), first_row, False))
        result = {"ratio_max_deviation": 0.0, "first_ratio_max_deviation": 0.0, **result, **gate_metrics, **replay}
        result["trajectories_trained"] = float(rows.numel())
        if batch.retained is not None:
            result["retained_graphs_used"] = float(use_retained)
        return result

    def _run(self, passes: list, losses: Callable, on_step: Callable[[int], object] | None, filler: tuple) -> dict:
        """``AdamWLoop.run`` over ``passes``; with ``adaptive_reference``, the copy reset first when due, each step's
        mean KL observed, and the reset (1 or 0) and the updates since the last one in the metrics."""
        if self.adaptive is None:
            return self.loop.run(self.options, passes, losses, on_step, filler=filler)
        reset = self.adaptive.begin_update(self.loop.params)
        assert self.step_kl is not None
        result = self.loop.run(
            self.options, passes, losses, self.step_kl.observing(on_step), filler, self.step_kl.start
        )
        age = self.adaptive.updates - 1 - self.adaptive.last_reset
        result.update(reference_reset=float(reset), reference_age=float(age))
        return result

    def _gate_weights(self, batch: Rollout) -> tuple[Tensor | None, dict[str, float]]:
        """With ``kl_gate``: each row's KL weight [N] on the device (``KLGate.row_weights``), its metrics; or none."""
        if self.gate is None:
            return None, {}
        weights, metrics = self.gate.row_weights(batch.reward_details, self.loop.dist)
        return to_device(weights, batch.device), metrics

    def _micro_batches(self, host_adv: Tensor, device: torch.device) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The rows that train ([M] host) and their micro-batches as (device rows, host rows), in order. Decided on
        the host from the host advantages ``host_adv`` [N, W]: one copy of the indices to the device per update, no
        read back."""
        o, n = self.options, host_adv.shape[0]
        rows = informative_trajectories(host_adv).nonzero().squeeze(1) if o.filter_zero_advantage else None
        rows = torch.arange(n, device="cpu") if rows is None else rows  # [M] on the host
        on_device = rows.to(device).split(o.micro_batch_size)
        return rows, list(zip(on_device, rows.split(o.micro_batch_size), strict=True)) if rows.numel() else []

    def _packed_losses(
        self, backbone: Backbone, sampler: Sampler, batch: Rollout, adv: Tensor, sigmas: Tensor,
        row_weights: tuple[Tensor | None, Tensor | None], trained: Tensor, mb: tuple[Tensor, Tensor],
    ) -> Iterator[LossThunk]:  # fmt: skip
        """The micro-batch ``mb`` (its rows on the device and on the host)'s trained (trajectory, step) pairs
        (``trained`` [n, W] host), step by step, in calls of as many pairs as it has trajectories: a call computes only
        rows that train. (An earlier release computed the whole micro-batch at every step any of its rows trained,
        weighing the others 0: +45% update compute for flux_dancegrpo, docs/algorithm.md §10.1.) ``adv`` [N, W] and
        ``row_weights`` (the policy loss's [N, W] and the KL's [N], or None) are on the device, ``sigmas`` [N, W + 1]
        on the host."""
        (weights, gate), (device_rows, host_rows) = row_weights, mb
        step, local = trained.T.nonzero(as_tuple=True)  # [P] each, ordered by step, then row
        if not step.numel():
            return
        pairs = to_device(torch.stack([local, step]), batch.device)  # [2, P]: one copy per micro-batch
        size = len(host_rows)
        for start in range(0, step.numel(), size):
            rows, steps = device_rows[pairs[0, start : start + size]], pairs[1, start : start + size]  # [p] device
            host_rows_p, host_steps = host_rows[local[start : start + size]], step[start : start + size]  # [p] host
            host = torch.stack([sigmas[host_rows_p, host_steps], sigmas[host_rows_p, host_steps + 1]], dim=1)
            weight = None if weights is None else weights[rows, steps]
            part, kl_weight = batch.transitions(rows, steps), None if gate is None else gate[rows]
            yield functools.partial(self._step_loss, backbone, sampler, part, adv[rows, steps], 0, host, weight,
                                    None, kl_weight)  # fmt: skip

    def _policy_velocity(self, backbone: Backbone, z: Tensor, sigma: Tensor, part: Rollout) -> Tensor:
        """v_θ with grad, through the CFG branches ``cfg_gradient`` names (tpflow.guidance)."""
        conditional = self.options.cfg_gradient == "conditional"
        with conditional_only(conditional) as combined:
            v = backbone.velocity(z, sigma, part.cond, part.guidance)
        if conditional and part.guidance != 1 and not combined[0]:
            raise UserError(
                f'[optimizer] cfg_gradient = "conditional": the backbone ({type(backbone).__name__}) computed its '
                f"guidance {part.guidance:g} without a classifier-free-guidance branch (FLUX's guidance is a "
                "distilled embedding, one call), so there is no unconditional velocity to hold constant. Drop the "
                "option."
            )
        return v

    def _step_weights(self, sampler: Sampler, sigmas: Tensor, alpha: float, trained: Tensor | None) -> Tensor | None:
        """The per-(row, step) weights [N, W] of the policy loss on the host (None: all 1): TempFlow-GRPO's
        noise-aware weight and GRPO-Guard's 1/Δσ reweight, as the options ask (``sigmas`` [N, W + 1] host)."""
        o = self.options
        weights = None
        if o.step_weight == "noise-aware":
            weights = noise_aware_weights(transition_std(sampler, sigmas, alpha), trained)
        if o.ratio_norm_reweight:
            length = (sigmas[:, :-1] - sigmas[:, 1:]).float()  # [N, W] Δσ
            inverse = torch.where(length > 0, 1 / torch.where(length > 0, length, torch.ones_like(length)), 0.0)
            weights = inverse if weights is None else weights * inverse
        return weights

    def _reference_mean(
        self, backbone: Backbone, sampler: Sampler, z: Tensor, z_next: Tensor, sigma_on_device: Tensor,
        sigma: Tensor, sigma_next: Tensor, part: Rollout,
    ) -> Tensor:  # fmt: skip
        """μ_ref of the KL, without grad: the adapter-disabled model's, or with ``adaptive_reference`` the held
        copy's (swapped into the trained parameters for the pass)."""
        if self.adaptive is None:
            context = backbone.reference()
        else:
            assert self.adaptive.copy is not None, "begin_update makes the copy before the first loss"
            context = swapped(self.loop.params, self.adaptive.copy)
        with torch.no_grad(), context:
            v_ref = backbone.velocity(z, sigma_on_device, part.cond, part.guidance)
            return sampler.log_prob(z_next, z, v_ref, sigma, sigma_next, part.noise_level).mean

    def _surrogate(self, out: StepOutput, part: Rollout, i: int, adv: Tensor, live: Tensor) -> PolicyLoss:
        """The clipped surrogate of window step i's rows ([n]; ``live`` [n] bool: std not 0), GRPO-Guard's RatioNorm
        when asked. A masked row's log-probs are replaced by 0 before the ratio: no NaN · 0 in the gradient either."""
        o = self.options
        if o.ratio_norm:  # GRPO-Guard: the normalised log-ratio in place of ℓ_θ − ℓ_old
            if part.means is None:
                raise ValueError("ratio_norm needs the rollout's transition means (Rollout.means, store_means=True).")
            log_ratio = normalised_log_ratio(out.log_prob, part.log_probs[:, i], out.mean, part.means[:, i], out.std)
            return clipped_surrogate(log_ratio, torch.zeros_like(log_ratio), adv, o.clip_range)
        log_prob, old = (torch.where(live, lp, 0.0) for lp in (out.log_prob, part.log_probs[:, i]))
        return clipped_surrogate(log_prob, old, adv, o.clip_range)

    def _step_loss(
        self,
        backbone: Backbone,
        sampler: Sampler,
        part: Rollout,
        adv: Tensor,
        i: int,
        sigmas: Tensor | None = None,
        weight: Tensor | None = None,
        retained: StepOutput | None = None,
        kl_weight: Tensor | None = None,
    ) -> RowLoss:
        """Loss of window step i for one micro-batch, summed over its rows whose transition std is not 0, and its
        diagnostics as row sums. ``sigmas`` [n, 2]: (σ, σ⁺) of the step on the host (default: read from ``part``);
        ``weight`` [n] multiplies each row's policy loss (not its KL; None: 1). A rollout plan's subset of steps comes
        packed (``Rollout.transitions``: every row trains unless its std is 0). ``retained``: the step's
        differentiable log-probability kept by the rollout (``recompute = "retain"``) instead of recomputing it; its
        loss is then back-propagated with the rest of the optimizer step's (``RowLoss.deferred``). ``kl_weight`` [n]
        multiplies each row's KL (the KL gate's g / f; None: 1), in the loss, the metric and the step KL alike."""
        o = self.options
        sigmas = part.sigmas[:, i : i + 2] if sigmas is None else sigmas
        sigma, sigma_next = sigmas[:, 0], sigmas[:, 1]
        z, z_next = part.latents[:, i], part.next_latents[:, i]
        sigma_on_device = to_device(sigma, z.device)  # the host σ (checked there by the sampler) for the model
        reference = (z, z_next, sigma_on_device, sigma, sigma_next, part)
        # the held copy's pass before the policy's forward: its swap writes the parameters that graph saves
        ref_mean = self._reference_mean(backbone, sampler, *reference) if self.adaptive and o.beta > 0 else None
        if retained is None:
            v = self._policy_velocity(backbone, z, sigma_on_device, part)
            out = sampler.log_prob(z_next, z, v, sigma, sigma_next, part.noise_level)
        else:
            out = retained
        # Rows whose transition has std 0 (cps at σ⁺ = 0) carry no likelihood ratio and are never trained, row by
        # row: a micro-batch can mix rollout batches whose windows start differently, so some rows of step i may be
        # at σ⁺ = 0 while others are not. They are selected out of every sum below (their placeholder log-prob and KL
        # are finite, with a finite gradient; a non-finite placeholder would still stay out of the forward).
        live = out.std.reshape(-1) != 0  # [n] bool on the rollout's device
        policy = self._surrogate(out, part, i, adv, live)
        weighted = policy.row_losses if weight is None else policy.row_losses * weight  # [n] the trained policy term
        row = weighted
        kl = torch.zeros_like(row)
        if o.beta > 0:
            ref_mean = self._reference_mean(backbone, sampler, *reference) if ref_mean is None else ref_mean
            kl = kl_to_reference(out.mean, ref_mean, out.std if o.kl_std == "transition" else out.std_dev_t)
            kl = kl if kl_weight is None else kl * kl_weight
            row = row + o.beta * kl
            if self.step_kl is not None:
                self.step_kl.add(torch.where(live, kl, 0.0).sum(), live.sum())
        with torch.no_grad():
            deviation = (policy.ratio - 1).abs()
            sums = {
                "loss": row.detach(),
                "policy_loss": weighted.detach(),
                "kl": kl.detach(),
                "approx_kl": 0.5 * policy.log_ratio.square(),
                "clip_fraction": (deviation > o.clip_range).float(),
                "ratio_mean": policy.ratio,
            }
            # selected, not multiplied by the mask: a masked row's non-finite placeholder (NaN · 0 = NaN) must not
            # reach the rows that train
            sums = {name: torch.where(live, value, 0.0).sum() for name, value in sums.items()}
            maxima = {"ratio_max_deviation": torch.where(live, deviation, 0.0).max()}
        total = torch.where(live, row, 0.0).sum()
        return RowLoss(total, live.sum().float(), sums, maxima, deferred=retained is not None)
