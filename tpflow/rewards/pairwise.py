"""Reward ``pairwise``: each image's reward is its win rate against its siblings under a pairwise judge (Pref-GRPO,
arXiv 2508.20751), both orders of every pair averaged, so no reward scale can be hacked.

    [reward]
    name = "pairwise"
    judge = { name = "shapes-geneval" }   # any registered reward: its scores are compared pair by pair
    max_pairs_per_image = 4               # optional cap: each image meets 4 siblings (seeded), not G − 1

For a group of G images (one prompt's, at one trace column) and a judge giving p(a, b) = P(a is better than b):

    R_i = 1/|S_i| · Σ_{j ∈ S_i} ½ (p(i, j) + 1 − p(j, i))

where S_i is every sibling (G − 1 of them: G(G−1) judgements per group, both orders) or, with
``max_pairs_per_image = m``, m siblings from a seeded balanced design (G·m judgements; every image meets the same
number, so every win rate is a mean over as many comparisons). A lone image (no sibling) gets ½.

The judge is a registered reward. One that implements ``PairwiseJudge.compare`` (a VLM asked which of two images is
better) is called on the ordered pairs, ``judge_batch`` pairs per call. Any other reward is a scalar judge: it
scores each image once and p(a, b) = 1, ½, 0 as r(a) >, =, < r(b) (``temperature = 0``: invariant under every
strictly increasing transform of r, which is the point), or σ((r(a) − r(b)) / τ) with ``temperature = τ > 0``.

The reward declares ``needs_whole_groups`` (``tpflow.scoring.groups``): the scoring stage calls it once per trace
column with the whole rollout batch at that column, and a recipe whose rollout batches can cut a group is refused
when validated. Groups inside a call are its rows with the same prompt text (``groups.group_key``, the trainer's
key).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from tpflow import registry
from tpflow.errors import RewardError
from tpflow.registry import register
from tpflow.rewards.inner import checked_inner
from tpflow.scoring.call import check_output, reward_name
from tpflow.scoring.groups import group_rows
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource


@runtime_checkable
class PairwiseJudge(Protocol):
    """What a reward implements to be asked about pairs rather than single images (a VLM judge: "which of these two
    images fits the prompt better?"). The ``pairwise`` reward calls it on each ordered pair, both orders."""

    def compare(
        self, images_a: Tensor, images_b: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> Tensor:
        """P(a is better than b) for N pairs: images_a, images_b [N, 3, H, W] in [0, 1] of one prompt each (the
        pair's shared prompt and metadata); returns [N] floats in [0, 1], 1 when a is surely better."""
        ...


class JudgeSpec(BaseModel):
    """The reward that judges the pairs."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Registered reward name, e.g. 'pickscore'.")
    options: dict[str, Any] = Field(default_factory=dict, description="The reward's own options.")


class PairwiseOptions(BaseModel):
    """Options of the pairwise win-rate reward."""

    model_config = ConfigDict(extra="forbid")

    judge: JudgeSpec = Field(
        ...,
        description="The judge, {name, options}: a reward with a PairwiseJudge compare (asked about each ordered "
        "pair), or any reward, whose scores are compared pair by pair.",
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        description="Scalar judge only: 0 compares scores exactly (1, 0.5 on a tie, 0; any increasing transform of "
        "the scores gives the same rewards); > 0 gives sigmoid((r_a - r_b) / temperature).",
    )
    max_pairs_per_image: int | None = Field(
        None,
        ge=1,
        description="Cap: each image meets this many siblings (a seeded balanced design) instead of all G - 1; a "
        "group then costs G x cap judgements instead of G(G - 1).",
    )
    seed: int = Field(0, ge=0, description="Seeds the capped design (with the group's prompt and size).")
    judge_batch: int = Field(64, ge=1, description="Pairs per call of a PairwiseJudge's compare.")

    @field_validator("judge")
    @classmethod
    def _check_judge(cls, judge: JudgeSpec) -> JudgeSpec:
        """The judge's name and options valid for its reward (raises UserError otherwise), before anything loads."""
        checked_inner(judge.name, judge.options, f"reward 'pairwise', judge ({judge.name!r})")
        return judge


def pair_design(size: int, cap: int | None, rng: random.Random) -> list[tuple[int, int]]:
    """Unordered pairs (a, b), a ≠ b, of a group's positions 0..size-1: all of them, or with ``cap`` < size − 1 a
    balanced random design where every position is in exactly ``cap`` pairs (one position in cap − 1 when cap and
    size are odd: the pair count size·cap/2 must be whole). The design: a shuffled cycle, each position joined to
    the next ⌊cap/2⌋, plus, when cap is odd, a matching of positions ⌊size/2⌋ apart along it."""
    if cap is None or cap >= size - 1:
        return list(itertools.combinations(range(size), 2))
    order = list(range(size))
    rng.shuffle(order)
    pairs = [(order[t], order[(t + d) % size]) for d in range(1, cap // 2 + 1) for t in range(size)]
    if cap % 2:  # offset ⌊size/2⌋ > ⌊cap/2⌋ since cap ≤ size − 2: no pair twice
        pairs += [(order[t], order[t + size // 2]) for t in range(size // 2)]
    return pairs


def win_rates(p_ab: Tensor, p_ba: Tensor, first: Tensor, second: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Each row's mean preference over its pairs: p_ab, p_ba [P] P(first better), P(second better) as judged in each
    order; first, second [P] the rows of each pair. Returns ([n] float64 win rates, ½ for a row in no pair; [n]
    float64 number of pairs of each row), on the CPU."""
    prefer = (p_ab.double() + 1 - p_ba.double()) / 2  # [P] P(first better), both orders averaged
    wins = torch.zeros(n, dtype=torch.float64, device="cpu")
    count = torch.zeros(n, dtype=torch.float64, device="cpu")
    wins.index_add_(0, first, prefer).index_add_(0, second, 1 - prefer)
    ones = torch.ones_like(prefer)
    count.index_add_(0, first, ones).index_add_(0, second, ones)
    rates = torch.where(count > 0, wins / count.clamp(min=1), torch.full_like(wins, 0.5))
    return rates, count


def scalar_preference(r_a: Tensor, r_b: Tensor, temperature: float) -> Tensor:
    """P(a better) [P] float64 of scores r_a, r_b [P]: 1, ½, 0 as r_a >, =, < r_b, or σ((r_a − r_b) / τ)."""
    diff = r_a.double() - r_b.double()
    return torch.sigmoid(diff / temperature) if temperature > 0 else (torch.sign(diff) + 1) / 2


@register("reward", "pairwise", options=PairwiseOptions)
class PairwiseReward:
    """RewardModel: each image's win rate against its siblings in the call (groups: ``tpflow.scoring.groups``).

    Options: ``judge`` {name, options}, ``temperature``, ``max_pairs_per_image``, ``seed``, ``judge_batch``.
    ``scores`` [N] float32 in [0, 1] on the CPU; ``details``: ``pairs`` (how many siblings each image met) and, with
    a scalar judge, its scores under its name (and its details as ``"name/key"``), the figure to watch in eval,
    where an eval batch's lone images all get ½. Thread-safe when the judge is.
    """

    needs_whole_groups = True  # tpflow.interfaces.CAPABILITIES: one call holds whole groups at one trace column

    @staticmethod
    def reward_parts(options: PairwiseOptions) -> list[tuple[str, str, dict[str, Any], bool]]:
        """Its judge, given the same samples (``tpflow.interfaces.CAPABILITIES``)."""
        return [("judge", options.judge.name, options.judge.options, False)]

    def __init__(self, options: PairwiseOptions):
        self.options = options
        self.judge = registry.build("reward", options.judge.name, **options.judge.options)

    @staticmethod
    def weight_sources(options: PairwiseOptions, settings: dict) -> list[WeightSource]:
        """The judge's weights (``tpflow.weights``)."""
        from tpflow.weights import component_weights

        judge = options.judge
        factory = registry.get("reward", judge.name).factory
        validated = registry.validate_options("reward", judge.name, judge.options)
        sources = component_weights(factory, validated, settings)
        where = f"reward 'pairwise', judge ({judge.name!r})"
        return [replace(s, what=f"judge {s.what}", problem=s.problem and f"{where}: {s.problem}") for s in sources]

    @staticmethod
    def preflight(options: PairwiseOptions) -> None:
        """The judge's preflight (a ``remote`` judge checks its server), before a run starts."""
        judge = options.judge
        registry.preflight("reward", judge.name, registry.validate_options("reward", judge.name, judge.options))

    def pairs(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """The call's unordered pairs as rows (first [P], second [P] int64 on the CPU), group by group."""
        first, second = [], []
        for key, rows in group_rows(prompts).items():
            rng = random.Random(f"{self.options.seed}/{key}/{len(rows)}")
            for a, b in pair_design(len(rows), self.options.max_pairs_per_image, rng):
                first.append(rows[a])
                second.append(rows[b])
        first_rows = torch.tensor(first, dtype=torch.int64, device="cpu")  # host bookkeeping (tpflow.devices)
        return first_rows, torch.tensor(second, dtype=torch.int64, device="cpu")

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1]: win rates [N] float32 within the call's prompt groups."""
        n = len(images)
        first, second = self.pairs(prompts)  # [P], [P]
        details: dict[str, Tensor] = {}
        if isinstance(self.judge, PairwiseJudge):
            p_ab = self._compare(images, prompts, metadata, first, second)  # [P] P(first better), first shown first
            p_ba = self._compare(images, prompts, metadata, second, first)  # [P] P(second better), second first
        else:
            name = self.options.judge.name
            scores, judged = check_output(self.judge(images, prompts, metadata), n, self.judge)  # [N] float32, CPU
            details[name] = scores
            details.update({f"{name}/{k}": v for k, v in judged.items()})
            p_ab = scalar_preference(scores[first], scores[second], self.options.temperature)
            p_ba = scalar_preference(scores[second], scores[first], self.options.temperature)
        rates, count = win_rates(p_ab, p_ba, first, second, n)  # [N] float64 each
        details["pairs"] = count.float()
        return RewardOutput(scores=rates.float(), details=details)

    def _compare(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict], a: Tensor, b: Tensor):
        """The judge's P(row a better than row b) [P] float64 on the CPU, ``judge_batch`` pairs per call."""
        out = []
        for lo in range(0, a.numel(), self.options.judge_batch):
            rows_a, rows_b = a[lo : lo + self.options.judge_batch], b[lo : lo + self.options.judge_batch]
            picked = rows_a.tolist()
            p = self.judge.compare(
                images[rows_a.to(images.device)],
                images[rows_b.to(images.device)],
                [prompts[k] for k in picked],
                [metadata[k] for k in picked],
            )
            p = p.detach().double().cpu() if isinstance(p, Tensor) else p
            if not isinstance(p, Tensor) or p.shape != (len(picked),) or not bool(((p >= 0) & (p <= 1)).all()):
                raise RewardError(
                    f"Judge {reward_name(self.judge)} of reward 'pairwise' returned {p!r} for {len(picked)} pairs; "
                    "compare returns P(a better) as a tensor [N] of floats in [0, 1] (tpflow.rewards.pairwise)."
                )
            out.append(p)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device="cpu")
