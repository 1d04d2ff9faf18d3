"""What the methods that train final samples share (``nft``, ``awm``, ``dgpo``), as functions and small classes each
method calls; none of them inherits another.

DiffusionNFT (docs/nft.md), AWM and DGPO (docs/algorithm.md §10.7, §10.8) train the epoch's final latents x₀, noised
again by the forward process x_t = (1 − t)·x₀ + t·ε at times t read from a K-step schedule, with one outcome reward
per image, a lagged copy of the adapter soft-updated by θ_old ← η·θ_old + (1 − η)·θ, and the KL to the
adapter-disabled model. Here:

* :func:`forward_noising`, :func:`draw_times`, :func:`draw_noise`: the forward process and the draws of t and ε, each
  keyed by the global row, so a step's gradient does not depend on the micro-batch layout or the number of processes;
* :class:`LaggedCopy`: the copy with its soft update, its swap into the adapter, the update count and base seed that
  key the draws, and their checkpoint keys (``old``, ``seed``, ``updates``: the names checkpoints always had);
* :func:`frozen_velocities`: the forwards without grad a loss compares against (the live adapter, the lagged copy
  swapped in, the reference), each in its own autocast region, no weight changing inside one;
* :func:`noised_update`: the update of NFT and AWM (shuffled samples, each trained at its own times with its own
  noise), parameterised by the method's times, weights and loss; DGPO draws shared times and noise per group and
  runs its own passes on the same parts;
* :func:`outcome_only`, :func:`check_advantages`, :func:`row_loss`: the recipe check, the advantages' shape, the
  per-row loss as the loop takes it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tpflow.devices import cpu_generator, to_device
from tpflow.errors import UserError
from tpflow.interfaces import Backbone
from tpflow.optim.advantages import group_advantages
from tpflow.optim.loop import AdamWLoop, LossThunk, RowLoss
from tpflow.optim.options import SEED_LIMIT
from tpflow.optim.swap import swapped
from tpflow.plans.base import derived_generator
from tpflow.precision import Precision
from tpflow.types import Conditioning, Rollout

MicroBatch = tuple[Tensor, list[int]]  # a micro-batch's sample indices on the device and on the host


def forward_noising(x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """x_t = (1 − t)·x₀ + t·ε for x₀, ε [N, ...] and t [N] (t = 1: pure noise), in the dtype of ``x0``."""
    tt = t.to(x0.dtype).reshape(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise.to(x0.dtype)


def old_decay(step: int, flat: int, rate: float, cap: float) -> float:
    """η of the lagged copy's soft update after ``step`` units (optimizer steps or updates): 0 before ``flat``, then
    rising by ``rate`` per unit up to ``cap`` (DiffusionNFT's schedules: (0, 0.001, 0.5) for GenEval, (75, 0.0075,
    0.999) for OCR)."""
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def draw_times(key: tuple[int, ...], rows: Sequence[int], num_timesteps: int, per_sample: int) -> Tensor:
    """[n, T] long: each sample's T distinct schedule indices in random order, drawn from (key, its epoch row).

    A sample's times depend on its own row only, not on the micro-batch or the process it falls in."""
    generators = [derived_generator(*key, row, "t") for row in rows]
    drawn = [torch.rand(num_timesteps, generator=g, device="cpu").argsort()[:per_sample] for g in generators]
    return torch.stack(drawn) if drawn else torch.zeros((0, per_sample), dtype=torch.long, device="cpu")


def draw_noise(key: tuple[int, ...], rows: list[int], j: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """[M, ...] float32 on ``device``: ε of the samples ``rows`` (global indices) at their j-th time, each drawn on
    the CPU from (key, row, j) (``tpflow.devices``, rule 1): the same ε whatever the micro-batch layout or the number
    of processes (an earlier release drew one ε per micro-batch, so the gradient moved with ``micro_batch_size``)."""
    draws = [torch.randn(shape, generator=derived_generator(*key, row, j, "eps"), device="cpu") for row in rows]
    return to_device(torch.stack(draws), device)


def micro_batches(order: Tensor, size: int, device: torch.device) -> list[MicroBatch]:
    """The samples ``order`` [N] (host) cut into micro-batches of ``size``: each as (device indices, host list)."""
    host = order.tolist()  # a host tensor's values: no wait for a device
    host = [host[i : i + size] for i in range(0, len(host), size)]
    return list(zip(to_device(order, device).split(size), host, strict=True))


def first_row(loop: AdamWLoop, n: int) -> int:
    """The index of this process's first sample among the update's samples of every process (rank order)."""
    if not loop.dist.enabled:
        return 0
    counts = loop.dist.gather(torch.tensor([n], dtype=torch.long, device="cpu")).tolist()
    return int(sum(counts[: loop.dist.rank]))


def final_advantages(step_rewards: Tensor, groups: Sequence[Hashable], options: Any) -> Tensor:
    """[N, 1] float64: the final reward R_W (``step_rewards`` [N, W]'s last column) normalised within its prompt
    group, with the options' ``global_std`` and clipped at their ``adv_clip_max``: what every optimizer on final
    samples trains on (one advantage per image). An ``advantage_std`` option (nft's) picks the std's ddof, or none
    (the reward minus its group's mean: GARDO's, docs/algorithm.md §10.9)."""
    std = getattr(options, "advantage_std", "population")
    return group_advantages(step_rewards[:, -1:], groups, global_std=options.global_std, clip=options.adv_clip_max,
                            correction=1 if std == "sample" else 0, divide=std != "none")  # fmt: skip


def check_advantages(advantages: Tensor, n: int) -> None:
    """Final-sample advantages are [N, 1] (or [N, W]: the last column is read)."""
    if advantages.dim() != 2 or advantages.shape[0] != n or advantages.shape[1] < 1:
        raise ValueError(f"advantages must be [N, 1] with N = {n}, got {tuple(advantages.shape)}.")


def row_loss(rows: Tensor, sums: dict[str, Tensor]) -> RowLoss:
    """A per-row loss [M] as the loop takes it: summed, with its M rows and the method's metric sums."""
    count = torch.full((), float(rows.shape[0]), device=rows.device)  # filled there: no host copy
    return RowLoss(rows.sum(), count, sums)


def outcome_only(name: str, settings: dict) -> list[str]:
    """A method on final samples trains one reward per image: a credit assigner that spreads rewards over window
    steps has no steps to credit here, so only ``outcome`` is accepted (the recipe check of ``name``)."""
    credit = settings.get("credit")
    if credit is None or credit.name == "outcome":
        return []
    return [
        f'[credit] name = "{credit.name}": the {name} optimizer trains on final samples only, one reward per image '
        "(it re-noises the image by the forward process; there are no SDE window steps whose rewards a credit "
        'assigner could tell apart), so per-step credit cannot be used. Set [credit] name = "outcome".'
    ]


class LaggedCopy:
    """A lagged copy of the trained parameters (NFT's old policy, AWM's KL-EMA anchor, DGPO's EMA reference), and the
    update count and base seed that key a final-sample update's draws: what such an optimizer keeps beside AdamW's
    moments, under the checkpoint keys ``old``, ``updates`` and ``seed``."""

    def __init__(self, name: str, seed: int | None, copy: bool = True) -> None:
        self.name = name  # the owner's registry name, for messages
        self.option_seed = seed  # the ``seed`` option: it wins over a checkpoint's
        self.seed = seed
        self.updates = 0  # update() calls finished: with the base seed, what the next update draws
        self.copy = copy  # False: a method without a lagged copy keeps the seed and the update count only
        self.old: list[Tensor] = []  # the copy's values, in trainable_parameters() order

    def bind(self, params: Sequence[Tensor]) -> None:
        """The copy starts as the parameters; the base seed, unless set, comes from the global RNG (which the trainer
        seeds with the run's seed)."""
        self.old = [p.detach().clone() for p in params] if self.copy else []
        if self.seed is None:
            self.seed = int(torch.randint(SEED_LIMIT, (1,), device="cpu"))

    def order_seed(self, rank: int) -> int:
        """The seed of this update's sample order: the base seed, the update's index and this process's rank."""
        if self.seed is None:
            self.seed = int(torch.randint(SEED_LIMIT, (1,), device="cpu"))
        return (self.seed + 1_000_003 * self.updates + 7919 * rank) % SEED_LIMIT

    def swapped(self, params: Sequence[torch.nn.Parameter]) -> contextlib.AbstractContextManager[None]:
        """The copy's values in the parameters for a block (none bound yet: nothing changes)."""
        return swapped(params, self.old) if params else contextlib.nullcontext()

    @torch.no_grad()
    def soft_update(self, params: Sequence[Tensor], decay: float) -> None:
        """θ_old ← η·θ_old + (1 − η)·θ (η = 0 copies the parameters exactly)."""
        for old, param in zip(self.old, params, strict=True):
            old.copy_(param.detach() if decay == 0 else old * decay + param.detach() * (1.0 - decay))

    def state(self) -> dict:
        """The update count, the base seed and the copy (CPU copies; a sharded run's shards as they are, for the
        loop's ``state_dict`` to gather)."""
        from tpflow.shards import is_sharded

        old = [t.detach().clone() if is_sharded(t) else t.detach().cpu().clone() for t in self.old]
        return {"updates": self.updates, "seed": self.seed, "old": old}

    def load(self, state: dict, params: Sequence[Tensor]) -> None:
        """Check and restore :meth:`state` (``UserError`` for another optimizer's or another adapter's)."""
        missing = [key for key in ("updates", "seed", "old") if key not in state]
        if missing:
            raise UserError(
                f"the optimizer state lacks {', '.join(map(repr, missing))}: it was not written by the {self.name} "
                f"optimizer's state_dict (a checkpoint of another optimizer cannot continue as {self.name})."
            )
        params = list(params) if self.copy else []
        old, shapes = list(state["old"]), [tuple(p.shape) for p in params]
        if [tuple(t.shape) for t in old] != shapes:
            raise UserError(
                f"the checkpoint's lagged copy has {len(old)} tensors that do not match the {len(shapes)} trained "
                "parameters; was the LoRA rank or target list changed since it was written?"
            )
        from tpflow.shards import like  # a sharded run's parameters: the copy sharded as they are

        self.old = [like(t.to(dtype=p.dtype), p).to(device=p.device).clone() for t, p in zip(old, params,
                                                                                          strict=True)]  # fmt: skip
        self.updates = int(state["updates"])
        self.seed = int(state["seed"]) if self.option_seed is None else self.option_seed


def frozen_velocities(
    backbone: Backbone, precision: Precision, lagged: contextlib.AbstractContextManager[None] | None,
    inputs: Sequence[tuple[Tensor, Tensor]], cond: Conditioning, guidance: float, *, live: bool = False,
    reference: float | None = None, held: contextlib.AbstractContextManager[None] | None = None,
) -> list[tuple[Tensor | None, Tensor | None, Tensor | None]]:  # fmt: skip
    """(v_θ, v_old, v_ref) without grad of each (x_t, t) of ``inputs``: the live adapter's (only with ``live``,
    else None), the lagged copy's under the one swap ``lagged`` (``LaggedCopy.swapped``; None: not run), the
    reference's at guidance ``reference`` (None: not run): the adapter-disabled model, or under ``held`` (GARDO's
    adaptive reference copy swapped in, ``tpflow.optim.adaptive_reference``). Each forward has its own autocast region,
    entered after the swap and left before the values come back: no weight changes inside a region
    (tpflow.precision)."""
    autocast, n = precision.autocast, len(inputs)
    lives: list[Tensor | None] = [None] * n
    olds: list[Tensor | None] = [None] * n
    refs: list[Tensor | None] = [None] * n
    with torch.no_grad():
        if live:
            for j, (x_t, t) in enumerate(inputs):
                with autocast():
                    lives[j] = backbone.velocity(x_t, t, cond, guidance)
        with lagged if lagged is not None else contextlib.nullcontext():
            for j, (x_t, t) in enumerate(inputs if lagged is not None else ()):
                with autocast():
                    olds[j] = backbone.velocity(x_t, t, cond, guidance)
        if reference is not None:
            with held if held is not None else backbone.reference():
                for j, (x_t, t) in enumerate(inputs):
                    with autocast():
                        refs[j] = backbone.velocity(x_t, t, cond, reference)
    return list(zip(lives, olds, refs, strict=True))


@dataclass(frozen=True)
class NoisedMethod:
    """What a method supplies to :func:`noised_update`: its per-sample weights of the advantages, its training times
    (``times(key, rows)``: [n, T] schedule indices by epoch row), and its loss of one (micro-batch, time) as the
    loop takes it: ``loss(backbone, x0, x_t, t, cond, guidance, weights, v_old, v_ref, noise)``."""

    weights: Callable[[Tensor], Tensor]
    times: Callable[[tuple[int, ...], Sequence[int]], Tensor]
    loss: Callable[..., RowLoss]
    kl: bool  # whether the loss reads v_ref (the reference pass runs only then)
    old: bool = True  # whether the loss reads v_old (the lagged copy's pass runs only then)
    # the reference's weights for the pass (a fresh context per micro-batch, e.g. a held copy swapped in); None: the
    # adapter-disabled model
    reference: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    kl_weights: Tensor | None = None  # [N] per-sample KL weights on the device (GARDO's gate), the loss's kl_weights


def noised_update(
    loop: AdamWLoop, options: Any, lagged: LaggedCopy, backbone: Backbone, batch: Rollout, advantages: Tensor,
    method: NoisedMethod, on_step: Callable[[int], object] | None,
    before_step: Callable[[list[Any]], None] | None = None,
) -> tuple[dict[str, float], Tensor]:  # fmt: skip
    """One pass (``num_inner_epochs`` passes) over the final samples of ``batch``: each pass shuffles them, cuts
    micro-batches, and trains each sample at its own times (``method.times``), each with its own noise, against the
    lagged copy's velocity (and the reference's); the loop's uniform row weights, precision and AdamW do the rest.
    Returns the loop's metrics with ``trajectories_trained``, and the samples' weights [N] (for the method's own
    metrics). The lagged copy does not move here: the method moves it after. ``before_step``: the loop's."""
    o, n = options, len(batch.final)
    check_advantages(advantages, n)
    device = batch.final.device
    r = method.weights(advantages[:, -1].to(device=device, dtype=torch.float32))  # [N]
    schedule = backbone.sigmas(o.num_timesteps)[: o.num_timesteps].to(device=device, dtype=torch.float32)
    order_generator = cpu_generator(lagged.order_seed(loop.dist.rank))  # which samples share a step
    if batch.epoch_rows is not None:  # each sample's row in the epoch keys its times and noise: any process count
        ids = batch.epoch_rows.tolist()
    else:  # an update called without the trainer: rows in process order
        first = first_row(loop, n)
        ids = list(range(first, first + n))
    shape = tuple(batch.final.shape[1:])
    drawn: dict[str, Any] = {}  # the current pass's (seed, update, pass) key and [N, T] schedule indices

    def passes() -> Iterator[list[MicroBatch]]:
        for p in range(o.num_inner_epochs):
            order = torch.randperm(n, generator=order_generator, device="cpu")  # [N] host
            drawn["key"] = (lagged.seed, lagged.updates, p)
            drawn["times"] = method.times(drawn["key"], ids).to(device)  # [N, T] schedule indices
            yield micro_batches(order, o.micro_batch_size, device)

    def losses(rows: MicroBatch) -> Iterator[LossThunk]:
        mb, host_rows = rows
        x0, cond, times = batch.final[mb], batch.cond.index(mb), drawn["times"]
        t = [schedule[times[mb, j]] for j in range(times.shape[1])]  # T × [M]
        noise = [draw_noise(drawn["key"], [ids[i] for i in host_rows], j, shape, device) for j in range(len(t))]
        x_t = [forward_noising(x0.float(), tj, ej).to(x0.dtype) for tj, ej in zip(t, noise, strict=True)]
        # v_old and v_ref of every time first, under one swap of the lagged copy per micro-batch (no graph of v_θ is
        # pending here: the loop advances this generator between backward passes)
        swap = lagged.swapped(loop.params) if method.old else None
        inputs, reference = list(zip(x_t, t, strict=True)), batch.guidance if method.kl else None
        held = method.reference() if method.reference is not None and method.kl else None
        frozen = frozen_velocities(backbone, loop.precision, swap, inputs, cond, batch.guidance, reference=reference,
                                   held=held)  # fmt: skip
        extra = {} if method.kl_weights is None else {"kl_weights": method.kl_weights[mb]}
        for j, (_, v_old, v_ref) in enumerate(frozen):
            yield functools.partial(method.loss, backbone, x0, x_t[j], t[j], cond, batch.guidance, r[mb], v_old, v_ref,
                                    noise[j], **extra)  # fmt: skip

    filler = (torch.zeros(1, dtype=torch.long, device=device), [0])  # a sharded step's padding: sample 0, weight 0
    result = loop.run(o, passes(), losses, on_step, filler=filler, before_step=before_step)
    result["trajectories_trained"] = float(n)
    return result, r
