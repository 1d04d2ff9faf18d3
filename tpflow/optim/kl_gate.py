"""GARDO's gate: which trajectories get the KL term (docs/algorithm.md §10.9), as pure functions and one small state.

GARDO regularises only the samples whose reward it trusts least. It ranks every sample of the epoch under the main
reward and under auxiliary rewards (rank 1 the highest), takes u = rank_main − mean of the auxiliary ranks (u > 0:
the main reward ranks the sample lower than the others do), and keeps the KL for the fraction φ of the samples with
u ≥ 0 whose u is largest. φ moves with how large u has been lately (:class:`GateFraction`, the reference's
``RiskCompensator``), within [0.02, 0.2].

``[optimizer] kl_gate`` (grpo, nft) wires it: :class:`KLGate` reads the rewards from the update's
``Rollout.reward_details`` (the final samples' reward parts, which the sampling stage keeps for an optimizer that
declares ``reads_reward_details``), ranks the N samples of every process, and gives each row the KL weight g / f, f the
epoch's gated fraction, so that a step's KL term is the mean KL of its gated rows in expectation, whatever the
micro-batches (the reference averages over each micro-batch's gated rows instead). Tied scores share their mean rank,
so the gate does not depend on the order of the rows (the reference's ``torch.sort`` orders ties as it may).

GARDO's DiffusionNFT script (tinnerhrhe/GARDO at 52fd5e7, ``scripts/train_sd3_nft_gardo.py``) has one more rule: a
micro-batch without a gated row takes the KL over all its rows. ``kl_gate_batch`` (nft) gives that rule's
expectation over micro-batches of B rows drawn from the epoch instead (:func:`fallback_weights`), again the same
whatever the micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError

STATE_KEY = "kl_gate"  # its entry in the optimizer's state


def descending_ranks(scores: Tensor) -> Tensor:
    """[N] float64 ranks of ``scores`` [N], 1 for the highest; tied scores share their mean rank (the reference's
    ``torch.sort`` orders ties as the implementation does; a mean rank keeps the gate independent of the rows'
    order, e.g. of how an epoch's rows fall over processes)."""
    _, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)  # ascending values
    higher = counts.flip(0).cumsum(0).flip(0) - counts  # per distinct value: how many scores exceed it
    return (higher + (counts + 1) / 2).double()[inverse]


def rank_disagreement(main: Tensor, auxiliary: Sequence[Tensor]) -> Tensor:
    """u [N] float64: the main reward's rank minus the mean of the auxiliary rewards' ranks (each [N])."""
    if not auxiliary:
        raise ValueError("the gate compares the main reward with at least one auxiliary reward; none was given.")
    others = torch.stack([descending_ranks(a) for a in auxiliary]).mean(dim=0)
    return descending_ranks(main) - others


def gated_rows(u: Tensor, fraction: float) -> Tensor:
    """[N] bool: u above the (1 − fraction) quantile, linear interpolation, of the u ≥ 0 (numpy's ``percentile``
    default). None is gated when no u is ≥ 0."""
    kept = u[u >= 0].double()
    if not kept.numel():
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = torch.quantile(kept, 1.0 - fraction, interpolation="linear")
    return u > threshold


def fallback_weights(gated: Tensor, batch: int) -> Tensor:
    """[N] float64 KL weights whose row mean is, for any KL values, the expectation of the DiffusionNFT script's
    micro-batch term over micro-batches of ``batch`` rows drawn without replacement from the N rows of ``gated``
    [N] bool: the mean KL over the micro-batch's gated rows, or over all its rows when it holds none. With G gated
    rows, f = G / N and q = C(N − G, B) / C(N, B) the chance that B rows hold no gated one, that expectation is
    (1 − q)·mean_gated KL + q·mean_ungated KL: a gated row weighs (1 − q) / f, another q / (1 − f)."""
    n, g = gated.numel(), int(gated.sum())
    b = min(batch, n)
    q = math.comb(n - g, b) / math.comb(n, b) if n else 1.0  # exact integers, one rounding
    if g == 0 or g == n:  # every micro-batch alike: none gated (all rows) or all gated
        return torch.ones(n, dtype=torch.float64, device="cpu")
    weights = torch.full((n,), q * n / (n - g), dtype=torch.float64, device="cpu")
    return weights.masked_fill(gated.cpu(), (1 - q) * n / g)


@dataclass
class GateFraction:
    """φ, the share of the u ≥ 0 that the gate keeps, and the recent means of those u it moves by: up by ``step``
    (×1.1) when this epoch's mean exceeds every kept mean, down (×0.9) when it is below every one, held in [low,
    high]; ``window`` means kept. The first epoch sets φ = ``base``."""

    base: float = 0.1
    step: float = 0.1
    low: float = 0.02
    high: float = 0.2
    window: int = 20
    fraction: float = 0.1
    history: list[float] = field(default_factory=list)

    def update(self, u: Tensor) -> float:
        """Move φ by this epoch's u [N] (only the u ≥ 0 count) and return it."""
        kept = u[u >= 0].double()
        mean = float(kept.mean()) if kept.numel() else float("nan")  # the reference's np.mean of nothing: NaN
        if not self.history:
            self.fraction = self.base
        elif mean > max(self.history):
            self.fraction *= 1 + self.step
        elif mean < min(self.history):
            self.fraction *= 1 - self.step
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = [*self.history, mean][-self.window :]
        return self.fraction

    def state_dict(self) -> dict:
        return {"fraction": self.fraction, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.fraction, self.history = float(state["fraction"]), [float(x) for x in state["history"]]


class KLGate:
    """The gate of one run (``kl_gate``): the detail keys it ranks and φ's controller, checkpointed with the
    optimizer (:meth:`state`), so a resumed run gates as the uninterrupted one; ``batch`` > 0: the weights of
    :func:`fallback_weights` (nft's ``kl_gate_batch``) instead of g / f."""

    def __init__(self, main: str, auxiliary: Sequence[str], controller: GateFraction, batch: int = 0) -> None:
        self.main, self.auxiliary, self.controller, self.batch = main, list(auxiliary), controller, batch

    def row_weights(self, details: dict[str, Tensor] | None, dist: Any) -> tuple[Tensor, dict[str, float]]:
        """This process's KL weights [n] float32 on the CPU, g / f over the epoch's rows of every process
        (``dist``: the run's ``tpflow.distributed.Distributed``; its gather puts rank 0's rows first), and the
        metrics: φ and the gated fraction f (every weight 0 when nothing is gated)."""
        if details is None:
            raise ValueError("kl_gate reads Rollout.reward_details, which this rollout lacks (reads_reward_details).")
        missing = [key for key in (self.main, *self.auxiliary) if key not in details]
        if missing:
            raise UserError(
                f"[optimizer] kl_gate ranks the reward details {', '.join(map(repr, missing))}, which the reward did "
                f"not return (it returned {', '.join(map(repr, sorted(details))) or 'none'}). Name keys of the "
                "reward's details in kl_gate_main and kl_gate_aux, e.g. a weighted reward's part labels."
            )
        n = details[self.main].shape[0]
        counts = dist.gather(torch.tensor([n], dtype=torch.int64, device="cpu")).tolist()
        start = sum(counts[: dist.rank])
        every = {key: dist.gather(details[key].float().cpu()).double() for key in (self.main, *self.auxiliary)}
        u = rank_disagreement(every[self.main], [every[key] for key in self.auxiliary])  # [N] every process's
        phi = self.controller.update(u)
        gated = gated_rows(u, phi)
        fraction = float(gated.double().mean())
        if self.batch:
            weights = fallback_weights(gated, self.batch)
        else:
            weights = gated.double() / fraction if fraction > 0 else torch.zeros_like(u)
        return weights[start : start + n].float(), {"kl_gate_phi": phi, "kl_gated_fraction": fraction}

    def state(self) -> dict:
        return {STATE_KEY: self.controller.state_dict()}

    def load(self, state: dict) -> None:
        """Restore :meth:`state` (``UserError`` when the checkpoint was written without the gate)."""
        if STATE_KEY not in state:
            raise UserError(
                "[optimizer] kl_gate = true, but the checkpoint holds no gate state: it was written by a run without "
                "the option, whose KL applied to every sample. Resume it as it was written (drop kl_gate), or start "
                "a new run."
            )
        self.controller.load_state_dict(state[STATE_KEY])


def gate_problems(options: Any, keys: Sequence[str] | None, weight: tuple[str, float, str] | None = None) -> list[str]:
    """The recipe's limits for ``kl_gate`` (grpo, nft), before anything loads. ``keys``: the detail keys the recipe's
    reward declares (a key ending in "/" stands for any key under it), or None when only its scores can tell;
    ``weight``: the KL weight's (name, value, GARDO's value), grpo's beta unless given."""
    if not options.kl_gate:
        return []
    name, value, gardo = weight if weight is not None else ("beta", options.beta, "GARDO's OCR config: 0.04")
    if value == 0:
        return [
            f"[optimizer] kl_gate = true with {name} = 0: the gate chooses which samples get the KL term, which "
            f"{name} = 0 turns off, so the option would change nothing. Set {name} > 0 ({gardo}) or drop kl_gate."
        ]
    named = [options.kl_gate_main, *options.kl_gate_aux]
    if options.kl_gate_main is None or not options.kl_gate_aux or options.kl_gate_main in options.kl_gate_aux:
        return [
            "[optimizer] kl_gate = true needs the reward details it ranks: kl_gate_main (the trained reward's key) "
            "and kl_gate_aux (at least one other key, not the main one); GARDO ranks the OCR reward against "
            'aesthetic and ImageReward, e.g. kl_gate_main = "ocr", kl_gate_aux = ["aesthetic", "imagereward"] with a '
            "weighted reward of those parts."
        ]
    unknown = [k for k in named if keys is not None and k not in keys
               and not any(d.endswith("/") and k.startswith(d) for d in keys)]  # fmt: skip
    if unknown:
        return [
            f"[optimizer] kl_gate ranks the reward details {', '.join(map(repr, unknown))}, which the recipe's "
            f"reward does not return (its details: {', '.join(repr(k) for k in keys or [] if not k.endswith('/'))}). "
            "Name keys of its details in kl_gate_main and kl_gate_aux, or give the reward those parts (a weighted "
            "reward of them, an auxiliary part at weight 0 when it is only ranked)."
        ]
    return []
