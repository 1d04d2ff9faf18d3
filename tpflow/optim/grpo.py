"""The GRPO policy loss: PPO-clipped likelihood ratio per window step, plus a KL to the adapter-disabled model.

docs/algorithm.md §6 is the specification. For one micro-batch of trajectories at window position i the loss is

    L = mean_b max(−Â_b·κ_b, −Â_b·clip(κ_b, 1 − ε, 1 + ε))  +  β · mean_b KL_b,    κ_b = exp(ℓ_θ,b − ℓ_old,b)

(:func:`clipped_surrogate` and :func:`kl_to_reference`). The registered optimizer ``grpo`` holds the options
(:class:`GRPOOptions`, the SD3.5-M paper settings of docs/algorithm.md §6.3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.distributed import Distributed
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.step import optimizer_step
from tpflow.registry import register
from tpflow.types import Rollout


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate of one (micro-batch, window position) and its diagnostics."""

    loss: Tensor  # [] differentiable policy loss
    ratio: Tensor  # [N] detached κ = exp(ℓ_θ − ℓ_old)
    approx_kl: Tensor  # [] detached ½·mean((ℓ_θ − ℓ_old)²)
    clip_fraction: Tensor  # [] detached fraction with |κ − 1| > ε
    clip_fraction_high: Tensor  # [] detached fraction with κ > 1 + ε
    clip_fraction_low: Tensor  # [] detached fraction with κ < 1 − ε


def clipped_surrogate(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float) -> PolicyLoss:
    """PPO-clip loss of one window step (docs/algorithm.md §6.2).

    ``loss = mean_b max(−A_b·κ_b, −A_b·clip(κ_b, 1 − ε, 1 + ε))`` with ``κ = exp(log_prob − old_log_prob)``. On
    policy (κ = 1) its gradient is that of ``−mean(A·log_prob)``. Off policy, a sample whose ratio left the trust
    region in the direction its advantage pushes (κ > 1 + ε with A > 0, κ < 1 − ε with A < 0) gets no gradient.

    Args:
        log_prob: [N] ℓ_θ, recomputed with grad (float32).
        old_log_prob: [N] ℓ_old stored at rollout time; treated as a constant (detached).
        advantages: [N] advantages of this window step; cast to the dtype of ``log_prob``.
        clip_range: ε > 0 (``GRPOOptions.clip_range``, 1e-5 in the published runs).

    Returns:
        PolicyLoss with the differentiable loss and detached diagnostics.
    """
    if log_prob.dim() != 1:
        raise ValueError(f"log_prob must be 1-D [N] (one per trajectory), got shape {tuple(log_prob.shape)}.")
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if value.shape != log_prob.shape:
            raise ValueError(
                f"{name} must have the shape of log_prob {tuple(log_prob.shape)}, got {tuple(value.shape)}; "
                "pass one window position's column, e.g. advantages[:, i]."
            )
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 (the published runs use 1e-5), got {clip_range!r}.")

    advantages = advantages.detach().to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()

    with torch.no_grad():
        ratio_d = ratio.detach()
        high = (ratio_d > 1.0 + clip_range).to(log_prob.dtype)
        low = (ratio_d < 1.0 - clip_range).to(log_prob.dtype)
        return PolicyLoss(
            loss=loss,
            ratio=ratio_d,
            approx_kl=0.5 * log_ratio.detach().square().mean(),
            clip_fraction=((ratio_d - 1.0).abs() > clip_range).to(log_prob.dtype).mean(),
            clip_fraction_high=high.mean(),
            clip_fraction_low=low.mean(),
        )


def kl_to_reference(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-trajectory KL between the Gaussian transitions of the policy and of the reference (docs/algorithm.md §6.2).

    ``KL_b = mean_elems((μ_θ − μ_ref)²) / (2·std_b²)``, the reference code's form: ``std`` is the sampler's
    ``StepOutput.std_dev_t`` (ρ_k for cps; ε_k without the √h for flow-sde). The gradient flows through ``mean``
    only; ``ref_mean`` (the adapter-disabled model, computed without grad) and ``std`` are constants.

    Where ``std`` is 0 (an ODE step, e.g. cps at σ_{k+1} = 0, docs/algorithm.md §8 item 8) the KL is 0 with no
    gradient instead of the reference's x/0 (NaN or inf): such a step is deterministic, has no likelihood ratio
    and is never trained (docs/algorithm.md §8 D7).

    Args:
        mean: [N, ...] transition mean μ_θ of the policy, with grad.
        ref_mean: [N, ...] transition mean μ_ref of the reference model.
        std: [N] noise coefficient of each trajectory's step.

    Returns:
        [N] KL per trajectory, float32 or wider; average it over the micro-batch and weight it by β.
    """
    if mean.dim() < 1 or ref_mean.shape != mean.shape:
        raise ValueError(
            f"mean and ref_mean must have the same shape [N, ...], got {tuple(mean.shape)} and "
            f"{tuple(ref_mean.shape)}."
        )
    if std.shape != mean.shape[:1]:
        raise ValueError(
            f"std must be [N] = {tuple(mean.shape[:1])} (StepOutput.std_dev_t), got shape {tuple(std.shape)}."
        )
    dtype = torch.promote_types(mean.dtype, torch.float32)
    diff = mean.to(dtype) - ref_mean.detach().to(dtype)
    mean_sq = diff.square().reshape(diff.shape[0], -1).mean(dim=1)
    std = std.detach().to(dtype)
    nonzero = std != 0
    safe_std = torch.where(nonzero, std, torch.ones_like(std))  # keeps the masked branch (and its gradient) finite
    return torch.where(nonzero, mean_sq / (2.0 * safe_std.square()), torch.zeros_like(mean_sq))


class GRPOOptions(BaseModel):
    """Options of the ``grpo`` optimizer; defaults are the SD3.5-M paper settings (docs/algorithm.md §6.3)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(
        3e-4, gt=0, description="AdamW learning rate, constant, no warm-up (docs/algorithm.md §6.3, SD3.5-M and FLUX)."
    )
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW (β1, β2), each in [0, 1) (docs/algorithm.md §6.3)."
    )
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay (docs/algorithm.md §6.3).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon (docs/algorithm.md §6.3).")
    clip_range: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="PPO ratio clip ε: the ratio is clipped to [1 − ε, 1 + ε]. 1e-5 in every published TP-GRPO "
        "config; upstream Flow-GRPO uses 1e-4 (docs/algorithm.md §6.2, §8 item 12).",
    )
    adv_clip_max: float = Field(
        5.0,
        gt=0,
        description="Advantages are clamped to ±adv_clip_max; never binds with G = 24 and per-prompt std "
        "(|A| ≤ √(G−1) ≈ 4.8) (docs/algorithm.md §5 item 7).",
    )
    beta: float = Field(
        1e-4,
        ge=0,
        description="KL weight β toward the adapter-disabled model. The reference config files say 0, its launch "
        "scripts set 1e-4 (used here); the paper's Fig. 4 uses 0 (docs/algorithm.md §6.3, §8 item 7).",
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient-norm clip applied at each optimizer step (docs/algorithm.md §6.2)."
    )
    global_std: bool = Field(
        False,
        description="Normalise advantages by the std of the whole column instead of the prompt's std; the mean "
        "stays per prompt. False in TP-GRPO, True in upstream Flow-GRPO (docs/algorithm.md §5 item 2).",
    )
    filter_zero_advantage: bool = Field(
        True,
        description="Skip trajectories whose advantages are 0 at every window step, as the reference does "
        "(docs/algorithm.md §5 item 6, §8 D6).",
    )
    gradient_accumulation_steps: int = Field(
        2,
        ge=1,
        description="Micro-batches per optimizer step; each micro-batch contributes one backward per window step, "
        "so a step averages gradients over this × W losses (the reference's Accelerate accumulation is this × W). "
        "SD3.5-M: 2, giving 2 optimizer steps per epoch (docs/algorithm.md §6.1, §6.3).",
    )
    micro_batch_size: int = Field(
        9,
        ge=1,
        description="Trajectories per micro-batch: the reference trains on its per-device sampling batch "
        "(B = 9 for SD3.5-M, 3 for FLUX.1-dev) (docs/algorithm.md §6.3).",
    )
    num_inner_epochs: int = Field(
        1, ge=1, description="Passes over each epoch's rollouts (docs/algorithm.md §6.1; 1 in every published config)."
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOOptions:
        beta1, beta2 = self.adam_betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(
                f"adam_betas must both lie in [0, 1), got {self.adam_betas}; the paper uses (0.9, 0.999)."
            )
        return self


@register("optimizer", "grpo", options=GRPOOptions)
class GRPO:
    """GRPO update (implements ``tpflow.interfaces.Optimizer``); every option is a field of :class:`GRPOOptions`.

    Options: learning_rate, adam_betas, weight_decay, adam_eps, clip_range, adv_clip_max, beta, max_grad_norm,
    global_std, filter_zero_advantage, gradient_accumulation_steps, micro_batch_size, num_inner_epochs.

    One ``update`` walks the epoch's trajectories in micro-batches of ``micro_batch_size`` (in order, as the
    reference), and for each micro-batch the W window steps in order: recompute the velocity with grad, re-score the
    stored transition (``Sampler.log_prob``), take the clipped surrogate and, when β > 0, the KL to the
    adapter-disabled model (``Backbone.reference``). Gradients are averaged over the losses of
    ``gradient_accumulation_steps`` micro-batches × their trained steps, then norm-clipped, before each AdamW
    step. A window step's rows whose transition std is 0 (cps at σ⁺ = 0) carry no likelihood ratio and are never
    trained: they are left out of that step's surrogate, KL and means, row by row.

    On several processes (``bind`` with a distributed accelerator) each walks its own trajectories, all take the
    same number of optimizer steps, and each step's gradient is the mean over every process's losses
    (``Distributed.sync_gradients``), so the copies of the adapter stay identical.
    """

    consumes: Literal["transitions", "final_samples"] = "transitions"  # the window's stored SDE steps

    def __init__(self, options: GRPOOptions | None = None) -> None:
        self.options = options if options is not None else GRPOOptions()
        self.global_step = 0  # optimizer steps taken
        self._params: list[torch.nn.Parameter] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._accelerator = None
        self._dist = Distributed()

    @staticmethod
    def check_recipe(options: GRPOOptions, settings: dict) -> list[str]:
        """The recipe's limits for GRPO, checked by ``tpflow validate`` before anything loads: a group of one image
        per prompt has advantage (r - mean) / std = 0 at every step, and a window sampled with noise level 0 is the
        ODE (every transition has std 0, so no likelihood ratio): either way nothing would ever train."""
        problems = []
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
        return problems

    def bind(self, backbone: Backbone, accelerator=None) -> None:
        """Create AdamW over the backbone's trainable parameters (through ``accelerator.prepare`` when given)."""
        o = self.options
        self._params = list(backbone.trainable_parameters())
        if not self._params:
            raise ValueError("The backbone has no trainable parameters: attach an adapter before training.")
        optimizer = torch.optim.AdamW(
            self._params, lr=o.learning_rate, betas=o.adam_betas, weight_decay=o.weight_decay, eps=o.adam_eps
        )
        self._accelerator = accelerator
        self._dist = Distributed(accelerator)
        self._optimizer = accelerator.prepare(optimizer) if accelerator is not None else optimizer

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """GRPO samples with the live adapter: nothing to swap."""
        return contextlib.nullcontext()

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """Group-normalised advantages [N, W] float64 of step rewards [N, W] (docs/algorithm.md §5), with this
        optimizer's ``global_std`` and ``adv_clip_max``: the one place either option is applied. ``groups`` holds one
        prompt key per row (equal keys form a group)."""
        o = self.options
        return group_advantages(step_rewards, groups, global_std=o.global_std, clip=o.adv_clip_max)

    def state_dict(self) -> dict:
        """Optimizer state and step count, for checkpoints."""
        return {"optimizer": self._optimizer.state_dict() if self._optimizer else {}, "global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (``bind`` first): the AdamW moments and the step count.

        The hyper-parameters stay this optimizer's own options (torch's ``load_state_dict`` would bring back the
        checkpoint's learning rate, betas, weight decay and epsilon): a run resumed with
        ``--set optimizer.learning_rate=...`` trains with the new value, which is also what its checkpoints record."""
        if self._optimizer is None:
            raise RuntimeError("Call bind(backbone) before load_state_dict.")
        missing = [key for key in ("optimizer", "global_step") if not isinstance(state, dict) or key not in state]
        if missing:
            raise UserError(
                f"the optimizer state lacks {', '.join(map(repr, missing))}: it was not written by the grpo "
                "optimizer's state_dict."
            )
        if "old" in state:  # the nft optimizer's: its AdamW moments are of another loss, and its old policy has no use
            raise UserError(
                "the optimizer state was written by the nft optimizer (it holds an old policy): a checkpoint of "
                "another optimizer cannot continue as grpo. Start a new run, or resume with [optimizer] name = "
                '"nft".'
            )
        self._optimizer.load_state_dict(state["optimizer"])
        o = self.options
        for group in self._optimizer.param_groups:
            group.update(lr=o.learning_rate, betas=tuple(o.adam_betas), weight_decay=o.weight_decay, eps=o.adam_eps)
        self.global_step = int(state["global_step"])

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
        if self._optimizer is None:
            self.bind(backbone)
        o = self.options
        n, width = batch.log_probs.shape
        if advantages.shape != (n, width):
            raise ValueError(f"advantages must be [N, W] = [{n}, {width}], got {tuple(advantages.shape)}.")
        # Advantages are host bookkeeping (float64, CPU); they join the stored transitions on the rollout's device
        # here, once (tpflow.devices, rule 2), so every index and loss below stays on one device.
        adv = advantages.to(device=batch.device, dtype=torch.float32)  # [N, W], clipped by self.advantages
        if o.filter_zero_advantage:
            keep = informative_trajectories(adv)
        else:
            keep = torch.ones(n, dtype=torch.bool, device=batch.device)
        rows = keep.nonzero().squeeze(1)  # [M] on the rollout's device
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1

        first_ratio_dev = 0.0  # the largest |ratio - 1| before the first optimizer step: on-policy, exactly 0
        steps_before = self.global_step
        skipped = 0  # steps the fp16 gradient scaler skipped
        micro_batches = list(rows.split(o.micro_batch_size)) if rows.numel() else []
        accumulation = o.gradient_accumulation_steps
        # Every process takes the same number of optimizer steps (the gradients are all-reduced at each); one whose
        # filtered share is smaller contributes no loss to the last steps.
        num_steps = int(self._dist.max(-(-len(micro_batches) // accumulation)))
        for _ in range(o.num_inner_epochs):
            for step in range(num_steps):
                losses = 0
                for mb in micro_batches[step * accumulation : (step + 1) * accumulation]:
                    part = batch.index(mb)
                    for i in range(width):
                        out = self._step_loss(backbone, sampler, part, adv[mb, i], i)
                        if out is None:  # zero-std step: no likelihood ratio, nothing to train
                            continue
                        loss, info = out
                        if not torch.isfinite(loss):
                            add("nonfinite_losses", 1.0)
                            continue
                        if self._accelerator is not None:
                            self._accelerator.backward(loss)
                        else:
                            loss.backward()
                        losses += 1
                        for name, value in info.items():
                            add(name, value)
                        if self.global_step == steps_before:
                            first_ratio_dev = max(first_ratio_dev, info["ratio_max_deviation"])
                outcome = self._optimizer_step(losses)
                if outcome == "skipped":
                    skipped += 1
                elif outcome is not None:
                    add("grad_norm", outcome)
                    if on_step is not None:
                        on_step(self.global_step - 1)
        result = {name: sums[name] / counts[name] for name in sums if name != "nonfinite_losses"}
        result["nonfinite_losses"] = sums.get("nonfinite_losses", 0.0)
        result["trajectories_trained"] = float(rows.numel())
        result["first_ratio_max_deviation"] = first_ratio_dev
        result["optimizer_steps"] = float(self.global_step - steps_before)
        result["skipped_steps"] = float(skipped)
        return result

    def _step_loss(
        self, backbone: Backbone, sampler: Sampler, part: Rollout, adv: Tensor, i: int
    ) -> tuple[Tensor, dict[str, float]] | None:
        """Loss of window step i for one micro-batch and its diagnostics, over the rows whose transition std is
        not 0; None when no row's is."""
        o = self.options
        sigma, sigma_next = part.sigmas[:, i], part.sigmas[:, i + 1]
        z, z_next = part.latents[:, i], part.next_latents[:, i]
        v = backbone.velocity(z, sigma, part.cond, part.guidance)
        out = sampler.log_prob(z_next, z, v, sigma, sigma_next, part.noise_level)
        # Rows whose transition has std 0 (cps at σ⁺ = 0) carry no likelihood ratio and are never trained, row by
        # row: a micro-batch can mix rollout batches whose windows start differently, so some rows of step i may be
        # at σ⁺ = 0 while others are not. The surrogate and the KL are means over the live rows only.
        dead = out.std.reshape(-1) == 0  # [N] bool, on the rollout's device
        if bool(dead.all()):
            return None
        rows = dead.logical_not().nonzero().squeeze(1) if bool(dead.any()) else None  # None: every row (no copy)

        def pick(t: Tensor) -> Tensor:
            return t if rows is None else t[rows]

        policy = clipped_surrogate(pick(out.log_prob), pick(part.log_probs[:, i]), pick(adv), o.clip_range)
        loss = policy.loss
        kl = loss.new_zeros(())
        if o.beta > 0:
            with torch.no_grad(), backbone.reference():
                v_ref = backbone.velocity(z, sigma, part.cond, part.guidance)
                ref = sampler.log_prob(z_next, z, v_ref, sigma, sigma_next, part.noise_level)
            kl = kl_to_reference(pick(out.mean), pick(ref.mean), pick(out.std_dev_t)).mean()
            loss = loss + o.beta * kl
        info = {
            "loss": float(loss.detach()),
            "policy_loss": float(policy.loss.detach()),
            "kl": float(kl.detach()),
            "approx_kl": float(policy.approx_kl),
            "clip_fraction": float(policy.clip_fraction),
            "ratio_mean": float(policy.ratio.mean()),
            "ratio_max_deviation": float((policy.ratio - 1).abs().max()),
        }
        return loss, info

    def _optimizer_step(self, num_losses: int) -> float | str | None:
        """``tpflow.optim.step.optimizer_step`` on this optimizer's state; counts a step taken in ``global_step``."""
        out = optimizer_step(
            self._dist, self._params, self._optimizer, self._accelerator, self.options.max_grad_norm, num_losses
        )
        if out is not None and out != "skipped":
            self.global_step += 1
        return out
