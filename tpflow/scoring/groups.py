"""Prompt groups as a reward sees them, and the recipe check that a group-relative reward's calls hold whole groups.

A group is the images sampled for one prompt (docs/algorithm.md §5). The trainer forms its groups after the gather
(``tpflow.train.epoch.prompt_groups``); a group-relative reward (``pairwise``: each image's reward is its win rate
against its siblings) must form the same groups inside one call, from what the call has: its prompts. Both use
``group_key`` so the two cannot drift apart.

A reward that declares ``needs_whole_groups`` (``tpflow.interfaces.CAPABILITIES``) gets, from the scoring stage, one
call per trace column holding every row of the rollout batch at that column; a group is whole in that call only when
the batch holds it whole, which ``whole_group_problems`` checks when the recipe is validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpflow import registry
from tpflow.interfaces import capability


def group_key(prompt: str) -> str:
    """The group of a prompt: its text up to case and runs of whitespace (the reference's CLIP-tokenizer round trip
    folds both, so two spellings of one prompt are one group)."""
    return " ".join(prompt.lower().split())


def group_rows(prompts: Sequence[str]) -> dict[str, list[int]]:
    """Rows of one call by group, groups in order of first appearance, rows in call order."""
    rows: dict[str, list[int]] = {}
    for k, prompt in enumerate(prompts):
        rows.setdefault(group_key(prompt), []).append(k)
    return rows


def whole_group_problems(sections: dict[str, Any]) -> list[str]:
    """One paragraph when the recipe's reward needs whole groups per call and ``[train]`` can cut a group.

    The epoch plan shuffles a round's copies (``prompts_per_round`` prompts × ``group_size``) and cuts them into
    rollout batches (``tpflow.train.prompt_sampler``), so a group is whole in one batch, hence in one scoring call,
    exactly when a round fits one batch."""
    spec, train = sections.get("reward"), sections.get("train")
    if spec is None or train is None:
        return []
    if not capability(registry.get("reward", spec.name).factory, "needs_whole_groups"):
        return []
    per_round = train.prompts_per_round or train.prompts_per_epoch
    copies = per_round * train.group_size
    if copies <= train.rollout_batch:
        return []
    change = (
        f"set train.rollout_batch = {copies}, or train.prompts_per_round x train.group_size = train.rollout_batch "
        "(prompts_per_round dividing prompts_per_epoch)"
    )
    return [
        f"[reward] {spec.name} compares each image with its siblings (the other images of its prompt), so one "
        f"scoring call must hold a prompt's whole group, but [train] shuffles each round of {per_round} prompts x "
        f"{train.group_size} copies = {copies} trajectories into rollout batches of {train.rollout_batch}, which "
        f"can cut a group in two. A round must fit one rollout batch: {change} (docs/rewards.md, 'Pairwise "
        "rewards')."
    ]
