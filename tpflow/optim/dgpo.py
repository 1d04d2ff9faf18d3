"""DGPO, Direct Group Preference Optimization: flow matching on final samples, weighted per group by a sigmoid.

Luo et al., arXiv 2510.08425 (about 20× over Flow-GRPO in its abstract); public code Luo-Yihong/DGPO
(``scripts/train_sd3_dgpo.py``). Its loss and group weight are ``tpflow.optim.dgpo_loss``. What it shares with
DiffusionNFT (``tpflow.optim.nft``, whose old copy, seeds, state and loop it inherits): training on the epoch's final
samples re-noised by the forward process, one outcome reward per image, a lagged copy of the adapter, the KL to the
adapter-disabled model. What differs, besides the loss:

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
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.devices import cpu_generator, to_device
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.advantages import group_advantages
from tpflow.optim.dgpo_loss import DGPOLoss, dgpo_loss, group_scores, group_weights, matching_mse, score_metrics
from tpflow.optim.loop import RowLoss
from tpflow.optim.nft import NFT, SEED_LIMIT
from tpflow.optim.nft_loss import forward_noising, old_decay
from tpflow.optim.swap import swapped
from tpflow.plans.base import derived_generator
from tpflow.registry import register
from tpflow.samplers.schedules import flow_sigmas
from tpflow.types import Rollout


class DGPOOptions(BaseModel):
    """Options of the ``dgpo`` optimizer; defaults are the public code's SD3.5-M GenEval config (``dgpo.py``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(3e-4, gt=0, description="AdamW learning rate (the code: 3e-4, constant).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β1, β2).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip at each optimizer step.")
    beta_dpo: float = Field(100.0, gt=0, description="β_dpo: sharpness of the group weight σ(s_g) (GenEval 100).")
    clip_range: float = Field(1e-2, gt=0, description="c of the trust region on exp(L_old − L_θ) (GenEval 1e-2).")
    kl_weight: float = Field(0.02, ge=0, description="β: weight of mean((v_θ − v_ref)²) (GenEval 0.02).")
    use_ema_ref: bool = Field(False, description="L_ref from the lagged copy instead of the base model.")
    reference_guidance: float = Field(1.0, ge=1, description="CFG of the reference pass (the code's kl_cfg).")
    train_guidance: float = Field(1.0, ge=1, description="CFG of v_θ and v_old in training (the code: 1).")
    adv_clip_max: float = Field(5.0, gt=0, description="Advantages are clipped to ±this (the code: 5).")
    global_std: bool = Field(False, description="Normalise by the epoch's std (OCR, PickScore) not the prompt's.")
    num_timesteps: int = Field(10, ge=2, le=1000, description="K of the schedule the times are read from (10).")
    train_timesteps: int = Field(4, ge=1, le=1000, description="M: times per pass, shared by every row (4).")
    trunc_steps: int = Field(4, ge=0, le=999, description="Times come from schedule indices 0..trunc_steps.")
    time_grid: Literal["schedule", "flow-sigmas"] = Field(
        "schedule", description="Nodes the times are read from: the backbone's schedule or the flow-sigmas grid."
    )
    flow_shift: float = Field(3.0, gt=0, le=100, description="Shift of time_grid = 'flow-sigmas' (the code: 3).")
    switch_ema_ref: int = Field(
        500, ge=0, description="The lagged copy samples the rollouts once n (in old_decay_unit) exceeds this."
    )
    old_decay_flat: int = Field(0, ge=0, description="n (in old_decay_unit) before the lagged copy starts to lag.")
    old_decay_rate: float = Field(1e-3, ge=0, description="Growth of the copy's decay d per unit of n.")
    old_decay_max: float = Field(0.3, ge=0, lt=1, description="Cap of d (the code: 0.3).")
    old_decay_unit: Literal["epoch", "step"] = Field(
        "epoch",
        description="'epoch': the copy moves once after each update and n counts updates (epochs), what the code "
        "does in effect (it moves the copy after every optimizer step, n its steps, and takes one step per epoch); "
        "'step': it moves after every optimizer step and n counts steps, what tpflow did before this option "
        "(docs/results.md §2.8: 8 steps an epoch). n also times switch_ema_ref.",
    )
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward pass (the code: 16).")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step (the code: one step per epoch)."
    )
    num_inner_epochs: int = Field(1, ge=1, description="Passes over the epoch's samples per update.")
    seed: int | None = Field(
        None, ge=0, lt=SEED_LIMIT, description="Seed of the update's draws; None derives it from the run's seed."
    )
    recompute: str = Field("native", description="Only 'native' (DGPO trains on final samples, as NFT).")

    @model_validator(mode="after")
    def _fits(self) -> DGPOOptions:
        if self.recompute != "native":
            raise ValueError(f'recompute = "{self.recompute}": dgpo trains on final samples (only "native").')
        if self.trunc_steps >= self.num_timesteps:
            raise ValueError(f"trunc_steps={self.trunc_steps} must be below num_timesteps={self.num_timesteps}.")
        if self.train_timesteps > self.trunc_steps + 1:
            raise ValueError(
                f"train_timesteps={self.train_timesteps} distinct times do not fit schedule indices "
                f"0..{self.trunc_steps}: lower train_timesteps or raise trunc_steps."
            )
        return self


@register("optimizer", "dgpo", options=DGPOOptions)
class DGPO(NFT):
    """Direct Group Preference Optimization (module docstring); every option is a field of :class:`DGPOOptions`."""

    registered_name = "dgpo"

    def __init__(self, options: DGPOOptions | None = None) -> None:
        super().__init__(options if options is not None else DGPOOptions())  # type: ignore[arg-type]
        self._prepare: Callable[[list[Any]], None] | None = None

    @staticmethod
    def check_recipe(options: DGPOOptions, settings: dict) -> list[str]:
        """One reward per final image (``outcome``), and no sharding: the group weight's extra pass is not run in
        the lockstep a sharded step needs."""
        problems = []
        credit, train = settings.get("credit"), settings.get("train")
        if credit is not None and credit.name != "outcome":
            problems.append(
                f'[credit] name = "{credit.name}": the dgpo optimizer trains on final samples, one reward per image '
                "(re-noised by the forward process: no SDE window steps to credit apart). Set [credit] name = "
                '"outcome".'
            )
        if getattr(train, "shard", "none") == "fsdp":
            problems.append('[train] shard = "fsdp" is not supported by the dgpo optimizer yet; use shard = "none".')
        return problems

    def uses_reference(self) -> bool:
        o = self.options
        return o.kl_weight > 0 or not o.use_ema_ref

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("lagged copy of the trained parameters", "the EMA reference; samples after switch_ema_ref")]

    def time_nodes(self, backbone: Backbone) -> Tensor:
        """[K] host float32: the K nodes the training times are drawn from (index 0 the noisiest), the backbone's
        own K-step schedule or, with ``time_grid = "flow-sigmas"``, diffusers' flow-sigmas grid that the code's
        DPM-Solver rollout runs on (t = timesteps/1000: 0.9997, 0.9639, ... at K = 10, shift 3)."""
        o = self.options
        if o.time_grid == "flow-sigmas":
            return flow_sigmas(o.num_timesteps, o.flow_shift)[: o.num_timesteps]
        return backbone.sigmas(o.num_timesteps)[: o.num_timesteps].float().cpu()

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> DGPOLoss:
        """The DGPO loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and
        advantages r [M], every row at the group weight σ(0) = ½ (its value at the base model; ``update`` computes
        it per group in ``before_step``): the frozen forwards without grad, then v_θ with grad, as one (micro-batch,
        time) of ``update``. The memory estimate (``tpflow.memory``) runs it."""
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        _, v_old, v_ref = self._frozen_three(backbone, x_t, t, cond)
        target = noise.float() - x0.float()
        with self.precision.autocast():
            v = backbone.velocity(x_t, t, cond, self.options.train_guidance)
        half = torch.full((len(x0),), 0.5, device=x0.device)
        return dgpo_loss(v, target, r, half, matching_mse(v_old, target), self.options.clip_range, v_ref,
                         self.options.kl_weight)  # fmt: skip

    def advantages(self, step_rewards: Tensor, groups: Sequence) -> Tensor:
        """[N, 1] float64: the group-normalised final reward clipped at ±adv_clip_max, not rescaled."""
        o = self.options
        return group_advantages(step_rewards[:, -1:], groups, global_std=o.global_std, clip=o.adv_clip_max)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The live adapter samples until n (updates or optimizer steps so far) exceeds ``switch_ema_ref``, then the
        lagged copy."""
        n = self.updates if self.options.old_decay_unit == "epoch" else self.global_step
        if self._params and n > self.options.switch_ema_ref:
            return swapped(self._params, self.old)
        return contextlib.nullcontext()

    def before_step(self, micro_batches: list[Any]) -> None:
        """The group weights of the step (module docstring), through the pass ``update`` set up."""
        if self._prepare is not None:
            self._prepare(micro_batches)

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
        if self._optimizer is None:
            self.bind(backbone)
        o = self.options
        n = len(batch.final)
        if advantages.dim() != 2 or advantages.shape[0] != n or advantages.shape[1] < 1:
            raise ValueError(f"advantages must be [N, 1] with N = {n}, got {tuple(advantages.shape)}.")
        if batch.groups is None or len(batch.groups) != n:
            raise UserError(
                "the dgpo optimizer weighs each prompt group as a whole and needs the rows' group ids "
                "(Rollout.groups, which tpflow's trainer sets before the update); this rollout has none."
            )
        device = batch.final.device
        a = advantages[:, -1].to(device=device, dtype=torch.float32)  # [N]
        groups = batch.groups.to(device="cpu", dtype=torch.long)  # [N] host, global ids
        num_groups = int(self._dist.max(float(groups.max()) + 1 if n else 0.0))
        schedule = self.time_nodes(backbone).to(device=device, dtype=torch.float32)  # [K]
        order_generator = cpu_generator(self._draw_seed())
        shape = tuple(batch.final.shape[1:])
        state: dict[str, Any] = {}  # the current pass: its key, times [M], noise per (group, j); the step's cache
        scores: list[Tensor] = []  # each step's s_g of the (group, time) pairs with rows, for the metrics

        def noise_of(g: int, j: int) -> Tensor:  # ε [...] of group g at the pass's j-th time (CPU draw, cached)
            table = state["noise"]
            if (g, j) not in table:
                table[g, j] = torch.randn(shape, generator=derived_generator(*state["key"], g, j, "dgpo-eps"),
                                          device="cpu")  # fmt: skip
            return table[g, j]

        def noised(mb: Tensor, host_rows: list[int], j: int) -> tuple[Tensor, Tensor, Tensor]:
            t = schedule[state["times"][j]].expand(len(host_rows))  # [M] the pass's j-th time, every row
            eps = to_device(torch.stack([noise_of(int(groups[i]), j) for i in host_rows]), device)
            x0 = batch.final[mb]
            return t, eps, forward_noising(x0.float(), t, eps).to(x0.dtype)

        def prepare(micro_batches: list[Any]) -> None:
            m = o.train_timesteps
            sums = torch.zeros(num_groups, m, dtype=torch.float64, device=device)
            counts = torch.zeros(num_groups, m, dtype=torch.float64, device=device)
            cache: dict[int, list[tuple[Tensor, Tensor | None]]] = {}
            for mb, host_rows in micro_batches:
                cond, x0 = batch.cond.index(mb), batch.final[mb]
                cache[id(host_rows)] = []
                for j in range(m):
                    t, eps, x_t = noised(mb, host_rows, j)
                    v_theta, v_old, v_ref = self._frozen_three(backbone, x_t, t, cond)
                    target = eps - x0.float()
                    l_ref = matching_mse(v_old if o.use_ema_ref else v_ref, target)
                    s, c = group_scores(a[mb], matching_mse(v_theta, target), l_ref, groups[host_rows], o.beta_dpo,
                                        num_groups)  # fmt: skip
                    sums[:, j] += s
                    counts[:, j] += c
                    cache[id(host_rows)].append((matching_mse(v_old, target), v_ref if o.kl_weight > 0 else None))
            if self._dist.enabled:  # every process's partial sums of every group
                both = self._dist.gather(torch.stack([sums, counts])[None])  # [P, 2, G, M]
                sums, counts = both[:, 0].sum(0), both[:, 1].sum(0)
            state["weights"], state["cache"] = group_weights(sums, counts), cache  # [G, M]
            scores.append(sums[counts > 0] / counts[counts > 0])

        def passes() -> Iterator[list[Any]]:
            for p in range(o.num_inner_epochs):
                order = self._group_order(groups, order_generator)  # [N] host
                state["key"] = (self._seed, self.updates, p)
                pick = torch.randperm(o.trunc_steps + 1, generator=derived_generator(*state["key"], "dgpo-t"),
                                      device="cpu")  # fmt: skip
                state["times"], state["noise"] = pick[: o.train_timesteps].tolist(), {}
                host = order.tolist()
                host = [host[i : i + o.micro_batch_size] for i in range(0, n, o.micro_batch_size)]
                yield list(zip(to_device(order, device).split(o.micro_batch_size), host, strict=True))

        def losses(rows: tuple[Tensor, list[int]]) -> Iterator[Callable[[], RowLoss]]:
            mb, host_rows = rows
            cond = batch.cond.index(mb)
            weights = state["weights"][groups[host_rows].to(device)]  # [M_rows, M]
            for j, (l_old, v_ref) in enumerate(state["cache"][id(host_rows)]):
                t, eps, x_t = noised(mb, host_rows, j)
                target = eps - batch.final[mb].float()
                yield functools.partial(self._row_loss_dgpo, backbone, x_t, t, cond, target, a[mb],
                                        weights[:, j], l_old, v_ref)  # fmt: skip

        def decay(count: int) -> float:
            return old_decay(count, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)

        def stepped(k: int) -> None:  # after each optimizer step taken: the lagged copy moves ("step"), then the EMA
            if o.old_decay_unit == "step":
                self._update_old(decay(k))
            if on_step is not None:
                on_step(k)

        self._prepare = prepare
        try:
            result = self.run(passes(), losses, stepped)
        finally:
            self._prepare = None
        if o.old_decay_unit == "epoch":  # once per update, n the updates before it
            result["old_decay"] = decay(self.updates)
            self._update_old(result["old_decay"])
        else:
            result["old_decay"] = decay(max(self.global_step - 1, 0))
        self.updates += 1
        result["trajectories_trained"] = float(n)
        result.update(score_metrics(scores))
        return result

    # ---- private -----------------------------------------------------------------------------------------------

    @staticmethod
    def _group_order(groups: Tensor, generator: torch.Generator) -> Tensor:
        """[N] long host: the rows group by group, the groups in random order (the code deals a prompt's copies out
        contiguously and does not shuffle them), so that micro-batches of G rows hold whole groups."""
        ids = groups.unique()  # sorted
        shuffled = ids[torch.randperm(len(ids), generator=generator, device="cpu")]
        return torch.cat([(groups == g).nonzero().squeeze(1) for g in shuffled.tolist()]) if len(ids) else groups

    def _frozen_three(
        self, backbone: Backbone, x_t: Tensor, t: Tensor, cond: Any
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(v_θ, v_old, v_ref) without grad at the step's starting weights: the live adapter, the lagged copy
        swapped in, the adapter disabled (None when no reference is needed). One autocast region per forward, none
        open across the swap (tpflow.precision)."""
        o, autocast = self.options, self.precision.autocast
        with torch.no_grad():
            with autocast():
                v_theta = backbone.velocity(x_t, t, cond, o.train_guidance)
            with swapped(self._params, self.old):
                with autocast():
                    v_old = backbone.velocity(x_t, t, cond, o.train_guidance)
            v_ref = None
            if self.uses_reference():
                with backbone.reference():
                    with autocast():
                        v_ref = backbone.velocity(x_t, t, cond, o.reference_guidance)
        return v_theta, v_old, v_ref

    def _row_loss_dgpo(
        self, backbone: Backbone, x_t: Tensor, t: Tensor, cond: Any, target: Tensor, a: Tensor, weight: Tensor,
        l_old: Tensor, v_ref: Tensor | None,
    ) -> RowLoss:  # fmt: skip
        """One micro-batch at one time: v_θ with grad (its own autocast region), the loss summed over its rows."""
        o = self.options
        with self.precision.autocast():
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
        count = torch.full((), float(out.rows.shape[0]), device=out.rows.device)
        return RowLoss(out.rows.sum(), count, sums)
