"""DiffusionNFT: policy optimisation on the forward (noising) process, from final samples only.

Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117), docs/nft.md.
Each final latent x₀ of the epoch is noised again and the trained velocity is pulled towards an implicit positive
policy and away from an implicit negative one around a frozen "old" velocity: the loss is ``tpflow.optim.nft_loss``.
The factor adv_clip_max / β in it is the public code's: it sets the gradient's size, which the norm clip sees. The
old policy is a copy of the adapter, soft-updated after each epoch's update
(θ_old ← η·θ_old + (1 − η)·θ with η = min(max(step − flat, 0)·rate, cap)), and the rollouts sample with it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.devices import cpu_generator, to_device
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, Sampler
from tpflow.optim.advantages import group_advantages
from tpflow.optim.loop import AdamWLoop, LossThunk, RowLoss
from tpflow.optim.nft_loss import NFTLoss, forward_noising, nft_loss, old_decay, optimality
from tpflow.optim.swap import swapped
from tpflow.plans.base import derived_generator
from tpflow.registry import register
from tpflow.types import Conditioning, Rollout

SEED_LIMIT = 2**62  # the base seed of the forward-process draws is below this


class NFTOptions(BaseModel):
    """Options of the ``nft`` optimizer; defaults are the public code's SD3.5-M GenEval settings (docs/nft.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(3e-4, gt=0, description="AdamW learning rate, constant (the public code: 3e-4).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β1, β2).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip at each optimizer step.")
    beta: float = Field(
        1.0,
        gt=0,
        description="NFT's β: how far the implicit policies v± = v_old ± β·(v_θ − v_old) move with v_θ; also scales "
        "the loss by 1/β. 1 in the public GenEval and PickScore configs, 0.1 for OCR (arXiv 2509.16117, §4).",
    )
    kl_weight: float = Field(
        1e-4,
        ge=0,
        description="Weight of the KL term mean((v_θ − v_ref)²) to the adapter-disabled model (the public code's "
        "train.beta = 1e-4); 0 skips the reference pass.",
    )
    adv_clip_max: float = Field(
        5.0,
        gt=0,
        description="Advantages are clipped to ±adv_clip_max and mapped to r = A / adv_clip_max / 2 + 1/2 in [0, 1]; "
        "it also scales the loss (the public code: 5).",
    )
    global_std: bool = Field(
        True,
        description="Normalise the rewards by the std of the whole epoch instead of the prompt's (the mean stays per "
        "prompt); True in the public code.",
    )
    num_timesteps: int = Field(
        10,
        ge=1,
        le=1000,
        description="K of the backbone's own schedule σ_0..σ_{K-1} from which each sample's training times t are "
        "drawn (the public code trains at its K = 10 sampling timesteps).",
    )
    timesteps_per_sample: int = Field(
        9,
        ge=1,
        le=1000,
        description="Distinct times t (without replacement, in random order) each sample is trained at per inner "
        "epoch, each with fresh noise ε: int(K · 0.99) = 9 in the public code.",
    )
    old_decay_flat: int = Field(
        0, ge=0, description="Optimizer steps before the old policy starts to lag (decay η = 0 until then)."
    )
    old_decay_rate: float = Field(
        1e-3, ge=0, description="Growth of the old policy's decay η per optimizer step after old_decay_flat."
    )
    old_decay_max: float = Field(
        0.5, ge=0, lt=1, description="Cap of η: θ_old ← η·θ_old + (1 − η)·θ after each update (GenEval: 0.5)."
    )
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward pass.")
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step; a step's gradient is the mean over every (sample, time t) row "
        "of its micro-batches, on every process (docs/algorithm.md §8 D10).",
    )
    num_inner_epochs: int = Field(1, ge=1, description="Passes over the epoch's samples per update.")
    seed: int | None = Field(
        None,
        ge=0,
        lt=SEED_LIMIT,
        description="Seed of the sample order, the times t and the noise ε of the update; None derives it from the "
        "run's seed. Saved in checkpoints, so a resumed run draws what the uninterrupted one would.",
    )
    recompute: str = Field(
        "native",
        description="Only 'native': NFT trains on final samples at fresh times t and noise, not on stored "
        "transitions, so the rollout computes nothing its update could reuse (GRPO's 'retain' has nothing to keep).",
    )

    @model_validator(mode="after")
    def _timesteps_fit(self) -> NFTOptions:
        if self.recompute != "native":
            raise ValueError(
                f'recompute = "{self.recompute}" reuses the rollout\'s forward passes of the stored SDE steps in the '
                "update, and NFT has none to reuse: it stores no transitions, and trains the final samples at times t "
                "and noise it draws afresh, which no rollout forward computed. Drop recompute (or use [optimizer] "
                'name = "grpo" with recompute = "retain").'
            )
        if self.timesteps_per_sample > self.num_timesteps:
            raise ValueError(
                f"timesteps_per_sample={self.timesteps_per_sample} exceeds num_timesteps={self.num_timesteps}: each "
                "sample is trained at distinct times of a K-step schedule; lower it or raise num_timesteps."
            )
        return self


@register("optimizer", "nft", options=NFTOptions)
class NFT(AdamWLoop):
    """DiffusionNFT update (implements ``tpflow.interfaces.Optimizer``); every option is a field of
    :class:`NFTOptions`.

    Options: learning_rate, adam_betas, weight_decay, adam_eps, max_grad_norm, beta, kl_weight, adv_clip_max,
    global_std, num_timesteps, timesteps_per_sample, old_decay_flat, old_decay_rate, old_decay_max,
    micro_batch_size, gradient_accumulation_steps, num_inner_epochs, seed, recompute ("native" only).

    It consumes final samples (``consumes``): the rollout stores no transitions, log-probs or completions, and the
    credit must be ``outcome`` (one reward per image). The rollouts sample with the old policy (``sampling_policy``).
    One ``update`` shuffles the samples, cuts micro-batches, and trains each at ``timesteps_per_sample`` times
    drawn from the backbone's schedule, each with fresh noise; the loop, its uniform row weights (every (sample, t)
    of an optimizer step weighs the same), precision and AdamW are ``tpflow.optim.loop``'s. After the pass the old
    policy moves towards the adapter (:func:`old_decay`). The old copy, the base seed and the number of updates are
    part of ``state_dict``, so a resumed run continues exactly.
    """

    consumes: Literal["transitions", "final_samples"] = "final_samples"
    registered_name = "nft"
    autocast_each_loss = False  # loss() opens a region per forward: the old-policy swap happens between them

    def __init__(self, options: NFTOptions | None = None) -> None:
        super().__init__()
        self.options = options if options is not None else NFTOptions()
        self.updates = 0  # update() calls finished: with the base seed, what the next update draws
        self.old: list[Tensor] = []  # the old policy's adapter values, in trainable_parameters() order
        self._seed: int | None = self.options.seed

    def uses_reference(self) -> bool:
        """The KL reference pass runs only with kl_weight > 0."""
        return self.options.kl_weight > 0

    def kept_copies(self) -> list[tuple[str, str]]:
        return [("old policy: a copy of the trained parameters", "samples the rollouts")]

    @staticmethod
    def check_recipe(options: NFTOptions, settings: dict) -> list[str]:
        """NFT trains on one reward per final image: a credit assigner that spreads rewards over window steps has
        no steps to credit here, so only ``outcome`` is accepted."""
        credit = settings.get("credit")
        if credit is not None and credit.name != "outcome":
            return [
                f'[credit] name = "{credit.name}": the nft optimizer trains on final samples only, one reward per '
                "image (it re-noises the image by the forward process; there are no SDE window steps whose rewards "
                "a credit assigner could tell apart), so per-step credit cannot be used. "
                'Set [credit] name = "outcome".'
            ]
        return []

    def bind(self, backbone: Backbone, accelerator=None, precision=None) -> None:
        """AdamW over the adapter (``AdamWLoop.bind``), the old policy as a copy of it, and the base seed (from the
        global RNG, which the trainer seeds with the run's seed, unless the ``seed`` option is set)."""
        super().bind(backbone, accelerator, precision)
        self.old = [p.detach().clone() for p in self._params]
        if self._seed is None:
            self._seed = int(torch.randint(SEED_LIMIT, (1,), device="cpu"))

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """[N, 1] float64: the group-normalised final reward (the last column of the step rewards, which ``outcome``
        fills with R_W), with ``global_std`` and clipped at ``adv_clip_max``."""
        o = self.options
        return group_advantages(step_rewards[:, -1:], groups, global_std=o.global_std, clip=o.adv_clip_max)

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The rollouts collect data with the old policy v_old, as the paper's algorithm does."""
        return swapped(self._params, self.old) if self._params else contextlib.nullcontext()

    def extra_state(self) -> dict:
        """The update count, the base seed and the old policy (CPU copies; a sharded run's shards as they are, for
        ``state_dict`` to gather)."""
        from tpflow.shards import is_sharded

        old = [t.detach().clone() if is_sharded(t) else t.detach().cpu().clone() for t in self.old]
        return {"updates": self.updates, "seed": self._seed, "old": old}

    def load_extra_state(self, state: dict) -> None:
        missing = [key for key in ("updates", "seed", "old") if key not in state]
        if missing:
            raise UserError(
                f"the optimizer state lacks {', '.join(map(repr, missing))}: it was not written by the nft "
                "optimizer's state_dict (a checkpoint of another optimizer cannot continue as nft)."
            )
        old = list(state["old"])
        shapes = [tuple(p.shape) for p in self._params]
        if [tuple(t.shape) for t in old] != shapes:
            raise UserError(
                f"the checkpoint's old policy has {len(old)} tensors that do not match the {len(shapes)} trained "
                "parameters; was the LoRA rank or target list changed since it was written?"
            )
        from tpflow.shards import like  # a sharded run's parameters: the old policy sharded as they are

        self.old = [like(t.to(dtype=p.dtype), p).to(device=p.device).clone() for t, p in zip(old, self._params,
                                                                                          strict=True)]  # fmt: skip
        self.updates = int(state["updates"])
        self._seed = int(state["seed"]) if self.options.seed is None else self.options.seed

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
        if self._optimizer is None:
            self.bind(backbone)
        o = self.options
        n = len(batch.final)
        if advantages.dim() != 2 or advantages.shape[0] != n or advantages.shape[1] < 1:
            raise ValueError(f"advantages must be [N, 1] with N = {n}, got {tuple(advantages.shape)}.")
        device = batch.final.device
        r = self._sample_weights(advantages[:, -1].to(device=device, dtype=torch.float32))  # [N]
        schedule = backbone.sigmas(o.num_timesteps)[: o.num_timesteps].to(device=device, dtype=torch.float32)
        seed = self._draw_seed()
        order_generator = cpu_generator(seed)  # the sample order only: it decides which samples share a step
        first = self._first_row(n)  # this process's first row in the update's rows over every process
        shape = tuple(batch.final.shape[1:])
        times: list[Tensor] = []  # the current pass's [N, T] schedule indices
        keys: list[tuple[int, ...]] = []  # the current pass's (seed, update, pass) key of every draw

        def passes() -> Iterator[list[Tensor]]:
            for p in range(o.num_inner_epochs):
                order = torch.randperm(n, generator=order_generator, device="cpu")  # [N] host
                keys[:] = [(self._seed, self.updates, p)]
                times[:] = [self._draw_times(keys[0], first, n).to(device)]  # [N, T] schedule indices
                host = order.tolist()  # a host tensor's values: no wait for a device
                host = [host[i : i + o.micro_batch_size] for i in range(0, n, o.micro_batch_size)]
                yield list(zip(to_device(order, device).split(o.micro_batch_size), host, strict=True))

        def losses(rows: tuple[Tensor, list[int]]) -> Iterator[LossThunk]:
            mb, host_rows = rows  # the micro-batch's samples, on the device and on the host
            x0, cond = batch.final[mb], batch.cond.index(mb)
            t = [schedule[times[0][mb, j]] for j in range(times[0].shape[1])]  # T × [M]
            noise = [draw_noise(keys[0], [first + i for i in host_rows], j, shape, device) for j in range(len(t))]
            x_t = [forward_noising(x0.float(), tj, ej).to(x0.dtype) for tj, ej in zip(t, noise, strict=True)]
            # v_old and v_ref of every time first, under one swap of the old policy per micro-batch (no graph of
            # v_θ is pending here: the loop advances this generator between backward passes)
            frozen = self._frozen(backbone, x_t, t, cond, batch.guidance)
            for j, (v_old, v_ref) in enumerate(frozen):
                yield functools.partial(self._row_loss, backbone, x0, x_t[j], t[j], cond, batch.guidance, r[mb],
                                        v_old, v_ref, noise[j])  # fmt: skip

        filler = (torch.zeros(1, dtype=torch.long, device=device), [0])  # a sharded step's padding: sample 0, weight 0
        result = self.run(passes(), losses, on_step, filler=filler)
        decay = self._old_decay()
        self._update_old(decay)
        self.updates += 1
        result["trajectories_trained"] = float(n)
        result.update(self._pass_metrics(r, decay))
        return result

    # ---- what a sibling on final samples replaces (tpflow.optim.awm) --------------------------------------------

    def _sample_weights(self, advantages: Tensor) -> Tensor:
        """[N] per-sample weight of the loss from the advantages [N]: NFT's optimality r in [0, 1]."""
        return optimality(advantages, self.options.adv_clip_max)

    def _draw_times(self, key: tuple[int, ...], first: int, n: int) -> Tensor:
        """[n, T] long schedule indices of the samples' training times (from their global rows: layout-free)."""
        o = self.options
        return draw_times(key, first, n, o.num_timesteps, o.timesteps_per_sample)

    def _pass_metrics(self, r: Tensor, decay: float) -> dict[str, float]:
        return {"optimality_mean": float(r.mean()) if len(r) else 0.5, "old_decay": decay}

    def _old_decay(self) -> float:
        """η of the soft update that ends this update: :func:`old_decay` of the optimizer steps taken so far."""
        o = self.options
        return old_decay(self.global_step, o.old_decay_flat, o.old_decay_rate, o.old_decay_max)

    def loss(self, backbone: Backbone, batch: Rollout, rows: Tensor, r: Tensor, t: Tensor, noise: Tensor) -> NFTLoss:
        """The loss of the samples ``rows`` [M] of ``batch`` at times t [M] with noise ε [M, ...] and optimality r
        [M]: v_old (old policy) and v_ref (adapter disabled) without grad, then v_θ with grad."""
        x0, cond = batch.final[rows], batch.cond.index(rows)
        x_t = forward_noising(x0.float(), t, noise).to(x0.dtype)
        ((v_old, v_ref),) = self._frozen(backbone, [x_t], [t], cond, batch.guidance)
        return self._loss(backbone, x0, x_t, t, cond, batch.guidance, r, v_old, v_ref)

    # ---- private -----------------------------------------------------------------------------------------------

    def _frozen(
        self, backbone: Backbone, x_t: list[Tensor], t: list[Tensor], cond: Conditioning, guidance: float
    ) -> list[tuple[Tensor, Tensor | None]]:
        """(v_old, v_ref) of each noised batch x_t[j] at t[j], without grad: the old policy's values swapped into
        the adapter once for all of them, then the adapter disabled for the KL reference (None when kl_weight = 0).
        Each forward has its own autocast region, entered after the swap and left before the values come back: no
        weight changes inside a region (tpflow.precision)."""
        autocast = self.precision.autocast
        with torch.no_grad():
            with swapped(self._params, self.old):
                olds = []
                for xj, tj in zip(x_t, t, strict=True):
                    with autocast():
                        olds.append(backbone.velocity(xj, tj, cond, guidance))
            refs: list[Tensor | None] = [None] * len(x_t)
            if self.options.kl_weight > 0:
                with backbone.reference():
                    for j, (xj, tj) in enumerate(zip(x_t, t, strict=True)):
                        with autocast():
                            refs[j] = backbone.velocity(xj, tj, cond, guidance)
        return list(zip(olds, refs, strict=True))

    def _loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor | None = None,
    ) -> NFTLoss:  # fmt: skip
        """The NFT loss from v_θ (the one forward with grad, in its own autocast region) and the frozen velocities."""
        o = self.options
        with self.precision.autocast():
            v = backbone.velocity(x_t, t, cond, guidance)
        return nft_loss(x0, x_t, t, v, v_old, r, o.beta, o.adv_clip_max, v_ref, o.kl_weight)

    def _row_loss(
        self, backbone: Backbone, x0: Tensor, x_t: Tensor, t: Tensor, cond: Conditioning, guidance: float, r: Tensor,
        v_old: Tensor, v_ref: Tensor | None, noise: Tensor | None = None,
    ) -> RowLoss:  # fmt: skip
        """:meth:`_loss` as the loop takes it: summed over the M samples, with its parts as row sums."""
        out = self._loss(backbone, x0, x_t, t, cond, guidance, r, v_old, v_ref, noise)
        sums = {
            "loss": out.rows.detach().sum(),
            "policy_loss": out.policy_rows.sum(),
            "positive_loss": out.positive.sum(),
            "negative_loss": out.negative.sum(),
            "kl": out.kl_rows.sum(),
        }
        count = torch.full((), float(out.rows.shape[0]), device=out.rows.device)  # filled there: no host copy
        return RowLoss(out.rows.sum(), count, sums)

    @torch.no_grad()
    def _update_old(self, decay: float) -> None:
        """θ_old ← η·θ_old + (1 − η)·θ (η = 0 copies the adapter exactly)."""
        for old, param in zip(self.old, self._params, strict=True):
            old.copy_(param.detach() if decay == 0 else old * decay + param.detach() * (1.0 - decay))

    def _draw_seed(self) -> int:
        """The seed of this update's sample order: the base seed, the update's index and this process's rank."""
        if self._seed is None:
            self._seed = int(torch.randint(SEED_LIMIT, (1,), device="cpu"))
        return (self._seed + 1_000_003 * self.updates + 7919 * self._dist.rank) % SEED_LIMIT

    def _first_row(self, n: int) -> int:
        """The index of this process's first sample among the update's samples of every process (rank order)."""
        if not self._dist.enabled:
            return 0
        counts = self._dist.gather(torch.tensor([n], dtype=torch.long, device="cpu")).tolist()
        return int(sum(counts[: self._dist.rank]))


def draw_times(key: tuple[int, ...], first: int, n: int, num_timesteps: int, per_sample: int) -> Tensor:
    """[n, T] long: each sample's T distinct schedule indices in random order, drawn from (key, its global row).

    A sample's times depend on its own index only, not on the micro-batch or the process it falls in."""
    rows = [derived_generator(*key, first + i, "t") for i in range(n)]
    drawn = [torch.rand(num_timesteps, generator=g, device="cpu").argsort()[:per_sample] for g in rows]
    return torch.stack(drawn) if drawn else torch.zeros((0, per_sample), dtype=torch.long, device="cpu")


def draw_noise(key: tuple[int, ...], rows: list[int], j: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """[M, ...] float32 on ``device``: ε of the samples ``rows`` (global indices) at their j-th time, each drawn on
    the CPU from (key, row, j) (``tpflow.devices``, rule 1): the same ε whatever the micro-batch layout or the number
    of processes (an earlier release drew one ε per micro-batch, so the gradient moved with ``micro_batch_size``)."""
    draws = [torch.randn(shape, generator=derived_generator(*key, row, j, "eps"), device="cpu") for row in rows]
    return to_device(torch.stack(draws), device)
