"""The prompt sampler's policy: which training prompts an epoch may draw (``[train] prompt_policy``).

``uniform`` (the default) sets nothing aside: every epoch draws from the whole split, as ``plan_epoch`` always did.
``skip-solved`` sets aside a prompt whose group's final rewards were all equal in an epoch, all solved or all failed:
its advantages are zero (docs/algorithm.md §5 item 6), so its G rollouts cost sampling and scoring and teach nothing.
It stays aside for ``prompt_skip_epochs`` epochs (0: for the rest of the run), after which the policy may have
changed what it does with it. A prompt is its text, as a group is (``prompt_groups``): the shapes split repeats its
texts, and every item of a solved text is set aside; with ``[rollout] same_noise`` a text's groups are split by
start, and the text is solved when every one of its groups was.

The closest published relative is DAPO's dynamic sampling (arXiv 2503.14476, §3.2), which over-samples and filters
out the groups of accuracy 0 or 1 *within* a step; here the groups already sampled train as usual (their zero
advantages change nothing) and the prompt is not drawn in later epochs, so no epoch samples more than it plans.

What every process decides is the same: ``observe`` reads the epoch's gathered rows (``EpochRows.gather``), the
rows the advantages read, and the checkpoint compares the processes' states before it writes
(``RunCheckpoints.save``). The state is part of exact resume: ``state_dict(epoch)`` holds what the run set aside
before ``epoch``, and a run resumed from it plans the same epochs as the uninterrupted run.

``ability-matched`` (AdaGRPO's curriculum) chooses each prompt of an epoch from candidates sampled and scored before
the epoch: ``tpflow.train.curriculum``; ``build_prompt_policy`` builds whichever the recipe names.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from tpflow.interfaces import capability
from tpflow.scoring.groups import group_key
from tpflow.settings import TrainSettings
from tpflow.train.curriculum import AbilityMatched, anchor_scorer
from tpflow.train.prompt_sampler import EpochPlan, plan_epoch

NEVER = -1  # ``until`` of a prompt set aside for the rest of the run


class PromptPolicy:
    """Plans each epoch around the prompts set aside and sets aside those an epoch found solved (module docstring).

    ``aside``: item -> (the epoch whose group set it aside, the first epoch that may draw it again or ``NEVER``)."""

    def __init__(self, train: TrainSettings, prompts: Sequence[str]) -> None:
        self.train = train
        self.keys = [group_key(p) for p in prompts]  # a prompt is its text, as a group is
        self.items_of: dict[str, list[int]] = defaultdict(list)
        for item, key in enumerate(self.keys):
            self.items_of[key].append(item)
        self.aside: dict[int, tuple[int, int]] = {}

    @property
    def skips(self) -> bool:
        return self.train.prompt_policy == "skip-solved"

    @property
    def has_state(self) -> bool:
        """Whether a checkpoint holds the policy's state (``uniform``: the checkpoint as before, byte for byte)."""
        return self.skips

    def nfe_per_traj(self, plan: EpochPlan) -> float:
        """Velocity evaluations the policy spent per trajectory of ``plan``: none (it samples nothing)."""
        return 0.0

    def set_aside(self, epoch: int) -> frozenset[int]:
        """The items epoch ``epoch`` may draw only to fill a round (``plan_epoch``'s floor)."""
        return frozenset(i for i, span in self.aside.items() if _aside_at(span, epoch))

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's rollout batches (``plan_epoch``), drawn around the items set aside (none under ``uniform``,
        even from a checkpoint of a skip-solved run resumed with ``uniform``)."""
        return plan_epoch(len(self.keys), self.train, epoch, self.set_aside(epoch) if self.skips else frozenset())

    def observe(self, plan: EpochPlan, items: Sequence[int], groups: Sequence[int], final: Tensor) -> dict[str, float]:
        """Set aside the texts whose groups all had equal final rewards in ``plan``'s epoch (``items``, ``groups``:
        [N] each gathered row's dataset item and group; ``final``: [N] its final reward, NaN never equal); returns
        the epoch's metrics (none under ``uniform``)."""
        if not self.skips:
            return {}
        rewards: dict[int, list[float]] = defaultdict(list)
        key_of: dict[int, str] = {}
        for item, group, value in zip(items, groups, final.tolist(), strict=True):
            rewards[group].append(value)
            key_of[group] = self.keys[item]
        solved: dict[str, bool] = {}
        for group, values in rewards.items():
            equal = all(v == values[0] for v in values)  # NaN != NaN: a group with a NaN reward is not solved
            solved[key_of[group]] = solved.get(key_of[group], True) and equal
        epoch, span = plan.epoch, self.train.prompt_skip_epochs
        until = epoch + 1 + span if span else NEVER
        texts = [key for key, done in solved.items() if done]
        for key in texts:
            self.aside.update({item: (epoch, until) for item in self.items_of[key]})
        return {
            "prompts_skipped": float(len(self.set_aside(epoch))),  # items this epoch drew only to fill a round
            "prompts_drawn_back": float(plan.refilled),
            "prompts_solved": float(len(texts)),
        }

    def state_dict(self, epoch: int) -> list[list[int]]:
        """What a checkpoint whose next epoch is ``epoch`` holds: [item, epoch set aside, until] of each item set
        aside before ``epoch`` and still aside at it (an epoch cut short by a stop leaves nothing it observed)."""
        return [[i, *span] for i, span in sorted(self.aside.items()) if _aside_at(span, epoch)]

    def load_state_dict(self, state: Sequence[Sequence[int]]) -> None:
        """Put back ``state_dict``'s list (an older checkpoint without one: nothing set aside)."""
        self.aside = {int(i): (int(seen), int(until)) for i, seen, until in (row for row in state if len(row) == 3)}


def build_prompt_policy(train: TrainSettings, prompts: Sequence[str], run: Any) -> PromptPolicy | AbilityMatched:
    """The policy ``train.prompt_policy`` names for a split of ``prompts``. ``run`` (the trainer) lends the
    ability-matched policy its anchor stage (``curriculum.anchor_scorer``), and receives its running reward: the
    object the optimizer's ``advantage_fusion`` reads (``tpflow.optim.advantage_fusion``), written by the policy
    alone."""
    if train.prompt_policy != "ability-matched":
        return PromptPolicy(train, prompts)
    policy = AbilityMatched(train, len(prompts), anchor_scorer(run))
    if capability(run.optimizer, "running_reward") is not None:
        run.optimizer.running_reward = policy.running
    return policy


def _aside_at(span: tuple[int, int], epoch: int) -> bool:
    """Whether an item set aside at epoch ``span[0]`` until ``span[1]`` is aside when ``epoch`` is planned."""
    seen, until = span
    return seen < epoch and (until == NEVER or until > epoch)
