"""Reward ``weighted``: a weighted sum of other registered rewards (the reference's ``multi_score``).

    [reward]
    name = "weighted"
    rewards = [
        { name = "pickscore", weight = 1.0 },
        { name = "clipscore", weight = 0.5, options = { model = "ViT-L-14", pretrained = "openai" } },
    ]

scores = Σ_k weight_k · score_k: a weighted *sum*, not a mean, as the reference computes it (docs/algorithm.md §7).
``details`` holds each part's scores under its label (the reward name unless ``label`` is given) and the part's
own details as ``"label/key"``. Every part's name and options are checked when the recipe is validated, so a typo
fails before any weight loads. A ``weighted`` part may itself be ``weighted``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from tpflow import registry
from tpflow.errors import UnknownComponentError
from tpflow.interfaces import capability
from tpflow.registry import register
from tpflow.rewards.inner import checked_inner
from tpflow.scoring.call import check_output
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource


class WeightedPart(BaseModel):
    """One reward of the sum."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Registered reward name, e.g. 'pickscore'.")
    weight: float = Field(1.0, description="Multiplies this reward's scores in the sum.")
    options: dict[str, Any] = Field(default_factory=dict, description="The reward's own options.")
    label: str | None = Field(
        None, description="Key of this part in details (default: its name); needed when a reward appears twice."
    )

    @property
    def key(self) -> str:
        return self.label or self.name


class WeightedOptions(BaseModel):
    """Options of the weighted-sum reward."""

    model_config = ConfigDict(extra="forbid")

    rewards: list[WeightedPart] = Field(
        ..., min_length=1, description="The rewards to add: a list of {name, weight, options, label}."
    )
    combine: Literal["sum", "zscore_sum"] = Field(
        "sum",
        description="How the parts make the advantage. 'sum': the weighted sum of their scores is the reward, and the "
        "group normalises the sum (the flow_grpo reference's multi_score). 'zscore_sum': each part's step rewards are "
        "group-normalised (and clipped) on their own and the advantage is Σ weight · z (DanceGRPO's and MixGRPO's "
        "multi-reward advantages), so a part's scale does not decide its share. The scores logged and shown are the "
        "weighted sum either way.",
    )

    @field_validator("rewards")
    @classmethod
    def _check_parts(cls, parts: list[WeightedPart]) -> list[WeightedPart]:
        """Unique labels, and each part's name and options valid for its reward (raises UserError otherwise)."""
        keys = [p.key for p in parts]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"labels must be unique, {', '.join(duplicates)} repeats: give those parts a label")
        for i, part in enumerate(parts):
            where = f"reward 'weighted', rewards[{i}] ({part.name!r})"
            try:
                entry = registry.get("reward", part.name)
            except UnknownComponentError as exc:
                raise UnknownComponentError(f"{where}: {exc}") from None
            if capability(entry.factory, "needs_whole_groups"):  # its calls would hold chunks, not whole groups
                raise ValueError(
                    f"{where} compares images within their group, so it must be the recipe's [reward] itself, not a "
                    "part of a sum (its judge may be any reward, a weighted sum too)"
                )
            checked_inner(part.name, part.options, where)
        return parts


def declared_detail_keys(name: str, options: dict[str, Any]) -> list[str] | None:
    """The details keys reward ``name`` declares for ``options`` (its ``detail_keys``), or None."""
    keys = capability(registry.get("reward", name).factory, "detail_keys")
    return None if keys is None else list(keys(registry.validate_options("reward", name, options)))


def prefixed(label: str, keys: list[str] | None) -> list[str]:
    """A part's scores under ``label`` and its own details as ``"label/key"`` (``"label/"``: not declared)."""
    return [label, *(f"{label}/{k}" for k in keys)] if keys is not None else [label, f"{label}/"]


@register("reward", "weighted", options=WeightedOptions)
class WeightedReward:
    """RewardModel: Σ weight_k · reward_k over named rewards built through the registry.

    Options: ``rewards``, each {``name``, ``weight``, ``options``, ``label``}. The parts are built (not loaded:
    each loads lazily) when this reward is built, and called one after another; the sum is thread-safe when every
    part is. ``scores`` [N] float32 on the CPU; ``details`` the parts' scores and their details.
    """

    # it hands every part the samples it gets: what they all score, it scores (tpflow.rewards.needs checks each part)
    accepts_clips = True

    @staticmethod
    def reward_parts(options: WeightedOptions) -> list[tuple[str, str, dict[str, Any], bool]]:
        """Its parts, each given the same samples (``tpflow.interfaces.CAPABILITIES``)."""
        return [(f"rewards[{i}]", part.name, part.options, False) for i, part in enumerate(options.rewards)]

    def __init__(self, options: WeightedOptions):
        self.options = options
        self.parts = [(p.key, p.weight, registry.build("reward", p.name, **p.options)) for p in options.rewards]

    @staticmethod
    def weight_sources(options: WeightedOptions, settings: dict) -> list[WeightSource]:
        """Each part's weights (``tpflow.weights``), named by the part's place in the sum."""
        from tpflow.weights import component_weights

        sources = []
        for i, part in enumerate(options.rewards):
            factory = registry.get("reward", part.name).factory
            validated = registry.validate_options("reward", part.name, part.options)
            where = f"reward 'weighted', rewards[{i}] ({part.key!r})"
            for source in component_weights(factory, validated, settings):
                problem = source.problem and f"{where}: {source.problem}"
                sources.append(replace(source, what=f"rewards[{i}] {source.what}", problem=problem))
        return sources

    @staticmethod
    def preflight(options: WeightedOptions) -> None:
        """Each part's preflight (a ``remote`` part checks its server), before a run starts."""
        for part in options.rewards:
            registry.preflight("reward", part.name, registry.validate_options("reward", part.name, part.options))

    @staticmethod
    def detail_keys(options: WeightedOptions) -> list[str]:
        """Its details' keys (``tpflow.interfaces.CAPABILITIES``): each part's label, and the part's own keys under
        it (``"label/"``: any, where the part does not declare them)."""
        return [key for p in options.rewards for key in prefixed(p.key, declared_detail_keys(p.name, p.options))]

    def zscored_parts(self) -> dict[str, float] | None:
        """With ``combine = "zscore_sum"``: each part's ``details`` key and weight, whose advantages the trainer
        normalises apart and sums (``tpflow.train.reward_parts``); None with ``combine = "sum"``."""
        if self.options.combine != "zscore_sum":
            return None
        return {key: weight for key, weight, _ in self.parts}

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] with every part; ``scores`` [N] float32, the weighted sum."""
        total = torch.zeros(len(images), dtype=torch.float32, device="cpu")  # [N], on the CPU whatever the images
        details: dict[str, Tensor] = {}
        for key, weight, reward in self.parts:
            scores, part = check_output(reward(images, prompts, metadata), len(images), key)  # [N] float32, CPU
            total += weight * scores
            details[key] = scores
            details.update({f"{key}/{k}": v for k, v in part.items()})
        return RewardOutput(scores=total, details=details)
