"""DGPO, Direct Group Preference Optimization: flow matching on final samples, weighted per group by a sigmoid.

Luo et al., arXiv 2510.08425 (about 20× over Flow-GRPO in its abstract); public code Luo-Yihong/DGPO
(``scripts/train_sd3_dgpo.py``). Its loss and group weight are ``tpflow.optim.dgpo_loss``. What it shares with
DiffusionNFT (``tpflow.optim.nft``; both call ``tpflow.optim.final``, and each holds its own loop): training on the
epoch's final samples re-noised by the forward process, one outcome reward per image, a lagged copy of the adapter
with its seeds and checkpoint state, the KL to the adapter-disabled model. What differs, besides the loss:

* **Shared draws.** The M training times of a pass are one draw of M distinct indices of the backbone's K-step
  schedule among its first ``trunc_steps`` + 1 (every row trains at the same M times, as the code broadcasts them),
  and the noise ε is one per (group, time): a group's members are compared at the same (t, ε).
* **The group weight** w_g = σ(s_g) needs every member of a group at the step's starting weights, wherever the
  members lie (micro-batches, processes). A pass takes the rows group by group (the groups in random order), as
  the code deals them out, so that a micro-batch of G rows is one group. ``before_step`` (the loop's hook)
  computes w_g: a pass without gradient over the step's rows gives L_θ, L_old and L_ref, the per-group sums are
  added over processes, then the step's losses read w_g. The frozen velocities of that pass are kept for the
  losses, so the extra cost is one forward of v_θ without gradient per row. The code computes s_g in its gradient
  pass over whole groups; the weights are the same.
* **The lagged copy** ("EMA reference") moves by θ_old ← d·θ_old + (1 − d)·θ with d = min(rate·n, cap) (the first
  move copies θ); the rollouts sample with the live adapter until n > ``switch_ema_ref``, then with the copy. The
  code moves it after every optimizer step, n its steps before, and takes one step per epoch: in effect the copy
  moves once per epoch and n counts epochs, which is ``old_decay_unit = "epoch"`` (the default: one move after each
  update, n the updates before it). ``"step"`` moves it after every optimizer step, n the steps before it (what
  tpflow did before the option); the two differ only where an epoch takes several steps.
* **The group scores are logged**: ``group_score_mean``, ``group_score_abs_mean``, ``group_score_min``,
  ``group_score_max`` of s_g, and ``group_weight_std``, ``group_weight_min``, ``group_weight_max`` of w_g, over the
  (group, time) pairs of the update's steps (``group_weight`` is w_g's mean over the rows).
* Training forwards use ``train_guidance`` (the code: 1, the conditional prediction, whatever the rollout's CFG);
  the reference pass ``reference_guidance`` (the code's ``kl_cfg``).

Where tpflow departs from the code, and why (docs/algorithm.md, "DGPO"): the rollout is the recipe's (the code's
DPM-Solver++ rollout on the flow-sigmas grid is ``[plan] name = "dpm-solver"``, whose grid is assumed from Sana's
config: the code's file was not readable), the times come from the backbone's own schedule unless ``time_grid =
"flow-sigmas"`` reads them from the rollout's grid as the code does, and a group split over optimizer steps is
weighted by the members in each step (the code takes one step per epoch: set micro_batch_size ×
gradient_accumulation_steps ≥ the rows of a process's epoch to match it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from tpflow.devices import cpu_generator, to_device
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.dgpo_loss import DGPOLoss, dgpo_loss, group_scores, group_weights, matching_mse, score_metrics
from tpflow.optim.final import (
    LaggedCopy,
    MicroBatch,
    check_advantages,
    final_advantages,
    forward_noising,
    frozen_velocities,
    micro_batches,
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
    GlobalStd,
    KLWeight,
    MicroBatchSize,
    OldDecayMax,
)  # fmt: skip
from tpflow.plans.base import derived_generator
from tpflow.registry import register
from tpflow.samplers.schedules import flow_sigmas
from tpflow.types import BatchLayout, Rollout


class DGPOOptions(FinalSampleOptions):
    """Options of the ``dgpo`` optimizer; defaults are the public code's SD3.5-M GenEval config (``dgpo.py``). The
    AdamW, batching, advantage, KL, schedule, lagged-copy decay and seed fields are
    ``tpflow.optim.options.FinalSampleOptions``'; the code's values differ from NFT's in the defaults below."""

    micro_batch_size: MicroBatchSize = 16
    global_std: GlobalStd = False
    kl_weight: KLWeight = 0.02
    old_decay_max: OldDecayMax = 0.3
    old_decay_unit: DecayUnit = "epoch"
    beta_dpo: float = Field(100.0, gt=0, description="β_dpo: sharpness of the group weight σ(s_g) (GenEval 100).")
    clip_range: float = Field(1e-2, gt=0, description=CLIP_RANGE)
    use_ema_ref: bool = Field(False, description="L_ref from the lagged copy instead of the base model.")
    reference_guidance: float = Field(1.0, ge=1, description="CFG of the reference pass (the code's kl_cfg).")
    train_guidance: float = Field(1.0, ge=1, description=TRAIN_GUIDANCE)
    train_timesteps: int = Field(4, ge=1, le=1000, description=TRAIN_TIMESTEPS)
    trunc_steps: int = Field(4, ge=0, le=999, description="Times come from schedule indices 0..trunc_steps.")
    time_grid: Literal["schedule", "flow-sigmas"] = Field(
        "schedule", description="Nodes the times are read from: the backbone's schedule or the flow-sigmas grid."
    )
    flow_shift: float = Field(3.0, gt=0, le=100, description="Shift of time_grid = 'flow-sigmas' (the code: 3).")
    switch_ema_ref: int = Field(
        500, ge=0, description="The lagged copy samples the rollouts once n (in old_decay_unit) exceeds this."
    )

    @model_validator(mode="after")
    def _fits(self) -> DGPOOptions:
        if self.num_timesteps < 2:
            raise ValueError(f"num_timesteps={self.num_timesteps}: dgpo reads its times from K ≥ 2 nodes.")
        if self.trunc_steps >= self.num_timesteps:
            raise ValueError(f"trunc_steps={self.trunc_steps} must be below num_timesteps={self.num_timesteps}.")
        if self.train_timesteps > self.trunc_steps + 1:
            raise ValueError(
                f"train_timesteps={self.train_timesteps} distinct times do not fit schedule indices "
                f"0..{self.trunc_steps}: lower train_timesteps or raise trunc_steps."
            )
        return self


@register("optimizer", "dgpo", options=DGPOOptions)
class DGPO:
    """Direct Group Preference Optimization (module docstring; implements ``tpflow.interfaces.Optimizer``); every
    option is a field of :class:`DGPOOptions`. One update's passes are a :class:`_GroupPasses`; the lagged copy,
    the seeds and the forward process are ``tpflow.optim.final``'s; the loop is ``self.loop``."""

    consumes: Literal["transitions", "final_samples"] = "final_samples"
    layout_of = staticmethod(batch_layout)  # the layout from the options alone (tpflow validate)

    def __init__(self, options: DGPOOptions | None = None) -> None:
        self.options = options if options is not None else DGPOOptions()
        self.loop = AdamWLoop("dgpo", autocast_each_loss=False)  # the lagged copy is swapped in between forwards
        self.lagged = LaggedCopy("dgpo", self.options.seed)  # the EMA reference, the update count, the base seed

    global_step = held("global_step")  # the Optimizer protocol's, from the loop
    precision = held("precision", settable=True)

    @staticmethod
    def check_recipe(options: DGPOOptions, settings: dict) -> list[str]:
        """One reward per final image (``outcome``), and no sharding: the group weight's extra pass is not run in
        the lockstep a sharded step needs."""
        problems = outcome_only("dgpo", settings)
        if getattr(settings.get("train"), "shard", "none") == "fsdp":
            problems.append('[train] shard = "fsdp" is not supported by the dgpo optimizer yet; use shard = "none".')
        return problems

    def uses_reference(self) -> bool:
        o = self.options
        return o.kl_weight > 0 or not o.use_ema_ref

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("lagged copy of the trained parameters", "the EMA reference; samples after switch_ema_ref")]

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        """AdamW over the adapter, the lagged copy as a copy of it, the base seed (``tpflow.optim.final``)."""
        self.loop.bind(self.options, backbone, accelerator, precision)
        self.lagged.bind(self.loop.params)

    def batch_layout(self) -> BatchLayout:
        return batch_layout(self.options)

    def state_dict(self, gather: bool = True) -> dict:
        return self.loop.state_dict(self.lagged.state(), gather)

    def load_state_dict(self, state: dict) -> None:
        self.loop.load_state_dict(self.options, state, lambda s: self.lagged.load(s, self.loop.params))

    def time_nodes(self, backbone: Backbone) -> Tensor:
        """[K] host float32: the K nodes the training times are drawn from (index 0 the noisiest), the backbone's
        own K-step schedule or, with ``time_grid = "flow-sigmas"``, diffusers' flow-sigmas grid that the code's
        DPM-Solver rollout runs on (t = timesteps/1000: 0.9997, 0.9639, ... at K = 10, shift 3)."""
        o = self.options
        if o.time_grid == "flow-sigmas":
            return flow_sigmas(o.num_timesteps, o.flow_shift)[: o.num_timesteps]
        return backbone.sigmas(o.num_timesteps)[: o.num_timesteps].float().cpu()

    def frozen(self, backbone: Backbone, x_t: Tensor, t: Tensor, cond: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """(v_θ, v_old, v_ref) without grad at the step's starting weights: the live adapter, the lagged copy
        swapped in, the adapter disabled at ``reference_guidance`` (None when no reference is needed)."""
        o = self.options
        reference = o.reference_guidance if self.uses_reference() else None
        ((v_theta, v_old, v_ref),) = frozen_velocities(
            backbone, self.loop.precision, self.lagged.swapped(self.loop.params), [(x_t, t)], cond, o.train_guidance,
            live=True, reference=reference,
        )  # fmt: skip
        return v_theta, v_old, v_ref

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> DGPOLoss:
        """The DGPO loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and
        advantages r [M], every row at the group weight σ(0) = ½ (its value at the base model; ``update`` computes
        it per group before each step): the frozen forwards without grad, then v_θ with grad, as one (micro-batch,
        time) of ``update``. The memory estimate (``tpflow.memory``) runs it."""
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        _, v_old, v_ref = self.frozen(backbone, x_t, t, cond)
        target = noise.float() - x0.float()
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, self.options.train_guidance)
        half = torch.full((len(x0),), 0.5, device=x0.device)
        return dgpo_loss(v, target, r, half, matching_mse(v_old, target), self.options.clip_range, v_ref,
                         self.options.kl_weight)  # fmt: skip

    def advantages(self, step_rewards: Tensor, groups: Sequence) -> Tensor:
        """[N, 1] float64: the group-normalised final reward clipped at ±adv_clip_max, not rescaled."""
        return final_advantages(step_rewards, groups, self.options)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The live adapter samples until n (updates or optimizer steps so far) exceeds ``switch_ema_ref``, then the
        lagged copy."""
        n = self.lagged.updates if self.options.old_decay_unit == "epoch" else self.loop.global_step
        if self.loop.params and n > self.options.switch_ema_ref:
            return self.lagged.swapped(self.loop.params)
        return contextlib.nullcontext()

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """One pass (``num_inner_epochs`` passes) over the final samples of ``batch`` with advantages [N, 1] and its
        prompt groups (``batch.groups``); the lagged copy moves after every optimizer step or once after the update
        (``old_decay_unit``)."""
        if self.loop.optimizer is None:
            self.bind(backbone)
        o = self.options
        passes = _GroupPasses(self, backbone, batch, advantages)

        def stepped(k: int) -> None:  # after each optimizer step taken: the lagged copy moves ("step"), then the EMA
            if o.old_decay_unit == "step":
                self.lagged.soft_update(self.loop.params, self._decay(k))
            if on_step is not None:
                on_step(k)

        result = self.loop.run(o, passes.passes(), passes.losses, stepped, before_step=passes.prepare)
        if o.old_decay_unit == "epoch":  # once per update, n the updates before it
            result["old_decay"] = self._decay(self.lagged.updates)
            self.lagged.soft_update(self.loop.params, result["old_decay"])
        else:
            result["old_decay"] = self._decay(max(self.loop.global_step - 1, 0))
        self.lagged.updates += 1
        result["trajectories_trained"] = float(len(batch.final))
        result.update(score_metrics(passes.scores))
        return result

    def _decay(self, count: int) -> float:
        o = self.options
        return old_decay(count, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)

    def _row_loss(
        self, backbone: Backbone, x_t: Tensor, t: Tensor, cond: Any, target: Tensor, a: Tensor, weight: Tensor,
        l_old: Tensor, v_ref: Tensor | None,
    ) -> RowLoss:  # fmt: skip
        """One micro-batch at one time: v_θ with grad (its own autocast region), the loss summed over its rows."""
        o = self.options
        with self.loop.precision.autocast():
            v = backbone.velocity(x_t, t, cond, o.train_guidance)
        out = dgpo_loss(v, target, a, weight, l_old, o.clip_range, v_ref, o.kl_weight)
        sums = {
            "loss": out.rows.detach().sum().float(),
            "policy_loss": out.policy_rows.sum().float(),
            "matching_mse": out.mse.sum().float(),
            "kl": out.kl_rows.sum().float(),
            "clipped_fraction": out.clipped.sum().float(),
            "group_weight": weight.detach().sum().float(),
        }
        return row_loss(out.rows, sums)


class _GroupPasses:
    """One DGPO update's passes over ``batch`` (module docstring): the rows group by group, the pass's shared times
    and its noise per (group, time), and before each optimizer step the group weights of the step's rows (with the
    frozen velocities its losses then read)."""

    def __init__(self, owner: DGPO, backbone: Backbone, batch: Rollout, advantages: Tensor) -> None:
        n = len(batch.final)
        check_advantages(advantages, n)
        if batch.groups is None or len(batch.groups) != n:
            raise UserError(
                "the dgpo optimizer weighs each prompt group as a whole and needs the rows' group ids "
                "(Rollout.groups, which tpflow's trainer sets before the update); this rollout has none."
            )
        self.owner, self.backbone, self.batch, self.o = owner, backbone, batch, owner.options
        self.device = device = batch.final.device
        self.a = advantages[:, -1].to(device=device, dtype=torch.float32)  # [N]
        self.groups = batch.groups.to(device="cpu", dtype=torch.long)  # [N] host, global ids
        self.num_groups = int(owner.loop.dist.max(float(self.groups.max()) + 1 if n else 0.0))
        self.schedule = owner.time_nodes(backbone).to(device=device, dtype=torch.float32)  # [K]
        self.order_generator = cpu_generator(owner.lagged.order_seed(owner.loop.dist.rank))
        self.shape = tuple(batch.final.shape[1:])
        self.key: tuple[int, ...] = ()  # the current pass's (seed, update, pass)
        self.times: list[int] = []  # its M schedule indices, shared by every row
        self.noise: dict[tuple[int, int], Tensor] = {}  # ε [...] per (group, j), drawn on the CPU when first read
        self.weights: Tensor | None = None  # [G, M] the step's group weights
        self.cache: dict[int, list[tuple[Tensor, Tensor | None]]] = {}  # the step's (L_old, v_ref) per micro-batch
        self.scores: list[Tensor] = []  # each step's s_g of the (group, time) pairs with rows, for the metrics

    def passes(self) -> Iterator[list[MicroBatch]]:
        o, n = self.o, len(self.batch.final)
        for p in range(o.num_inner_epochs):
            order = self._group_order()  # [N] host
            self.key = (self.owner.lagged.seed, self.owner.lagged.updates, p)
            pick = torch.randperm(o.trunc_steps + 1, generator=derived_generator(*self.key, "dgpo-t"), device="cpu")
            self.times, self.noise = pick[: o.train_timesteps].tolist(), {}
            yield micro_batches(order, o.micro_batch_size, self.device) if n else []

    def prepare(self, step: list[MicroBatch]) -> None:
        """The group weights of the step's rows over every process, and the frozen velocities its losses read."""
        o, m, batch = self.o, self.o.train_timesteps, self.batch
        sums = torch.zeros(self.num_groups, m, dtype=torch.float64, device=self.device)
        counts = torch.zeros(self.num_groups, m, dtype=torch.float64, device=self.device)
        self.cache = {}
        for mb, host_rows in step:
            cond, x0 = batch.cond.index(mb), batch.final[mb]
            self.cache[id(host_rows)] = []
            for j in range(m):
                t, eps, x_t = self._noised(mb, host_rows, j)
                v_theta, v_old, v_ref = self.owner.frozen(self.backbone, x_t, t, cond)
                target = eps - x0.float()
                l_ref = matching_mse(v_old if o.use_ema_ref else v_ref, target)
                s, c = group_scores(self.a[mb], matching_mse(v_theta, target), l_ref, self.groups[host_rows],
                                    o.beta_dpo, self.num_groups)  # fmt: skip
                sums[:, j] += s
                counts[:, j] += c
                self.cache[id(host_rows)].append((matching_mse(v_old, target), v_ref if o.kl_weight > 0 else None))
        dist = self.owner.loop.dist
        if dist.enabled:  # every process's partial sums of every group
            both = dist.gather(torch.stack([sums, counts])[None])  # [P, 2, G, M]
            sums, counts = both[:, 0].sum(0), both[:, 1].sum(0)
        self.weights = group_weights(sums, counts)  # [G, M]
        self.scores.append(sums[counts > 0] / counts[counts > 0])

    def losses(self, rows: MicroBatch) -> Iterator[Callable[[], RowLoss]]:
        mb, host_rows = rows
        cond = self.batch.cond.index(mb)
        weights = self.weights[self.groups[host_rows].to(self.device)]  # [M_rows, M]
        for j, (l_old, v_ref) in enumerate(self.cache[id(host_rows)]):
            t, eps, x_t = self._noised(mb, host_rows, j)
            target = eps - self.batch.final[mb].float()
            yield functools.partial(self.owner._row_loss, self.backbone, x_t, t, cond, target, self.a[mb],
                                    weights[:, j], l_old, v_ref)  # fmt: skip

    def _noise_of(self, g: int, j: int) -> Tensor:
        """ε [...] of group g at the pass's j-th time (a CPU draw, kept for the pass)."""
        if (g, j) not in self.noise:
            generator = derived_generator(*self.key, g, j, "dgpo-eps")
            self.noise[g, j] = torch.randn(self.shape, generator=generator, device="cpu")
        return self.noise[g, j]

    def _noised(self, mb: Tensor, host_rows: list[int], j: int) -> tuple[Tensor, Tensor, Tensor]:
        """(t [M], ε [M, ...], x_t [M, ...]) of the micro-batch's rows at the pass's j-th time."""
        t = self.schedule[self.times[j]].expand(len(host_rows))  # [M] the pass's j-th time, every row
        eps = to_device(torch.stack([self._noise_of(int(self.groups[i]), j) for i in host_rows]), self.device)
        x0 = self.batch.final[mb]
        return t, eps, forward_noising(x0.float(), t, eps).to(x0.dtype)

    def _group_order(self) -> Tensor:
        """[N] long host: the rows group by group, the groups in random order (the code deals a prompt's copies out
        contiguously and does not shuffle them), so that micro-batches of G rows hold whole groups."""
        groups = self.groups
        ids = groups.unique()  # sorted
        shuffled = ids[torch.randperm(len(ids), generator=self.order_generator, device="cpu")]
        return torch.cat([(groups == g).nonzero().squeeze(1) for g in shuffled.tolist()]) if len(ids) else groups
