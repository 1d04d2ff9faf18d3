"""The ``[replay]`` section: trajectories kept in a buffer and replayed in later epochs (OP-GRPO, arXiv 2604.04142;
docs/algorithm.md §10.12), and the parts of a recipe that cannot replay them.

The buffer and its rules are ``tpflow.train.replay``'s; the correction of a replayed row's off-policy shift is the
optimizer's (grpo's ``replay_*`` options, ``tpflow.optim.replay_weights``). Off by default (``capacity = 0``): a
recipe without the section trains as before, bit for bit.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_ROWS = 1_000_000  # as the settings' counts: far above any run, a typo fails at validation


class ReplaySettings(BaseModel):
    """Which trajectories the replay buffer admits, how many it holds and how long, and how many an epoch replays."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    capacity: int = Field(
        0,
        ge=0,
        le=MAX_ROWS,
        description="How many admitted trajectories the replay buffer holds (tpflow.train.replay); each is replayed "
        "in later epochs beside the fresh rollouts, its off-policy shift corrected by the optimizer (grpo's replay_* "
        "options). 0: no replay.",
    )
    rows: int | None = Field(
        None,
        ge=1,
        le=MAX_ROWS,
        description="Trajectories drawn from the buffer each epoch (uniformly, seeded by [train] seed and the epoch) "
        "and appended to its update, dealt over the processes. None: every trajectory the buffer holds.",
    )
    min_advantage: float = Field(
        1.0,
        gt=0,
        description="A trajectory is admitted when its advantage, averaged over its window steps, is at least this: "
        "under group-normalised advantages, a reward this many standard deviations above its group's mean (the "
        "high-reward ones); advantages not divided by a std are reward differences, on the reward's scale.",
    )
    max_age: int = Field(
        2,
        ge=1,
        le=MAX_ROWS,
        description="A trajectory admitted in epoch e may be replayed in epochs e+1 .. e+max_age, then it is "
        "evicted; past the capacity the oldest go first (then the lower advantage).",
    )

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def drawn(self) -> int:
        """The most trajectories an epoch's update appends from the buffer, over every process: ``rows``, or the
        whole buffer when it draws every row; 0 without replay."""
        return min(self.rows or self.capacity, self.capacity)

    @model_validator(mode="after")
    def _fits(self) -> ReplaySettings:
        """The other options belong to a buffer; a draw larger than the buffer could never be made."""
        unused = sorted(self.model_fields_set - {"capacity"})
        if not self.enabled and unused:
            raise ValueError(
                f"{', '.join(unused)} apply only to a replay buffer, and capacity is 0 (no replay): set capacity to "
                "the trajectories the buffer holds, or drop them."
            )
        if self.rows is not None and self.rows > self.capacity:
            raise ValueError(
                f"rows = {self.rows} is more than the buffer holds (capacity = {self.capacity}): an epoch draws from "
                "what the buffer holds. Lower rows or raise capacity."
            )
        return self


def replay_problems(sections: dict[str, Any]) -> list[str]:
    """One paragraph per part of a recipe that cannot replay trajectories (``[replay] capacity > 0``), checked before
    anything loads (``tpflow.recipe``): the optimizer must correct a stored trajectory's off-policy shift from its
    behaviour log-probabilities (an optimizer whose options have ``replay_weight``: grpo's), and nothing of the
    epoch's own may be read for a replayed row."""
    replay = sections.get("replay")
    if replay is None or not replay.enabled:
        return []
    spec = sections.get("optimizer")
    options = getattr(spec, "options", None)
    head = f"[replay] capacity = {replay.capacity}"
    problems = []
    if spec is not None and "replay_weight" not in getattr(type(options), "model_fields", {}):  # no correction
        problems.append(
            f"{head} replays stored trajectories in later epochs, which needs an optimizer that re-weighs a "
            "trajectory sampled by an older policy from its stored behaviour log-probabilities (grpo: its replay_* "
            f"options), and [optimizer] name = {spec.name!r} has no such correction (its loss reads no behaviour "
            'log-probabilities, or couples a group\'s fresh samples). Use name = "grpo", or drop [replay].'
        )
    for field, value, why in _CONFLICTS:
        if options is not None and getattr(options, field, None) == value:
            problems.append(f"{head} with [optimizer] {field} = {value!r}: {why}")
    train = sections.get("train")
    if train is not None and train.shard == "fsdp":
        problems.append(
            f'{head} with [train] shard = "fsdp": the update recomputes the replayed rows\' log-probabilities, a '
            "share per process that need not be equal, and FSDP runs every forward in step on every process. Use "
            'shard = "none" with replay.'
        )
    return problems


_CONFLICTS = (  # (grpo option, value, why a replayed row cannot take it)
    ("ratio_norm", True, "RatioNorm reads the transition means of the policy the ratio is taken against, which a "
     "replayed row does not store for the current policy. Drop ratio_norm, or [replay]."),
    ("kl_gate", True, "the KL gate ranks the epoch's own final samples by their reward details, which a replayed row "
     "does not carry. Drop kl_gate, or [replay]."),
    ("recompute", "retain", "a replayed row keeps no graph of the rollout's forwards, and the update's first step "
     'would mix both kinds of rows. Use recompute = "native" with replay.'),
    ("recompute", "reweight", "a replayed row keeps no gradient of the rollout's forwards, and the update's first "
     'step would mix both kinds of rows. Use recompute = "native" with replay.'),
)  # fmt: skip
