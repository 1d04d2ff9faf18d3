"""Reward ``diversity-shaped``: GARDO's diversity-aware shaping (arXiv 2512.24138; docs/algorithm.md §10.9) around any
registered reward, so that every optimizer can use it.

    [reward]
    name = "diversity-shaped"
    reward = { name = "ocr" }             # the inner reward r
    features = "clip:ViT-L-14:/path/to/open_clip_model.safetensors"   # or "shapes-clip", "pixels"

A policy rewarded for one good image per prompt collapses its groups onto near-copies of it. GARDO credits an image
at or above its group's mean more when it differs from its siblings, less when a sibling is a near-copy. Within a
group g (the call's rows with one prompt), with f_i the unit features of image i:

    d_i  = min_{j ≠ i} (1 − clip(f_i·f_j, −1, 1))          the distance to the nearest sibling
    w_i  = 1 if r_i < μ_g, else d_i / mean_{j∈g} d_j        μ_g the group's mean of r
    r'_i = μ_g + w_i·(r_i − μ_g)

so r'_i − μ_g is the reference's advantage (r_i − μ_g)·w_i exactly. An image alone in its group, or a group whose
images are all at one point (every d 0), keeps r. The inner scores stay in ``details`` under the inner reward's name
(the figure to watch), the weights under ``diversity_weight``.

The reward declares ``needs_whole_groups`` (``tpflow.scoring.groups``): the scoring stage calls it once per trace
column with whole groups, and a recipe whose rollout batches can cut a group is refused when validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from tpflow import registry
from tpflow.devices import resolve_device
from tpflow.diversity_specs import diversity_problem
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.diversity_features import build_features
from tpflow.rewards.inner import checked_inner
from tpflow.rewards.weighted import declared_detail_keys, prefixed
from tpflow.scoring.call import check_output
from tpflow.scoring.groups import group_rows
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource

WEIGHT_DETAIL = "diversity_weight"  # the details key of w


class InnerSpec(BaseModel):
    """The reward that is shaped."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Registered reward name, e.g. 'ocr'.")
    options: dict[str, Any] = Field(default_factory=dict, description="The reward's own options.")


class DiversityShapedOptions(BaseModel):
    """Options of the diversity-shaped reward."""

    model_config = ConfigDict(extra="forbid")

    reward: InnerSpec = Field(..., description="The inner reward, {name, options}, whose scores are shaped.")
    features: str = Field(
        "pixels",
        description="The feature extractor (tpflow.rewards.diversity_features): 'shapes-clip[:<weights>]', "
        "'clip:<arch>[:<pretrained or file>]', 'timm:<model>[:<file>]' or 'pixels'. GARDO's: "
        "'timm:vit_large_patch16_dinov3.lvd1689m' (its DINOv3 ViT-L/16, from the cache or a file).",
    )
    device: str = Field("auto", description=option_help.DEVICE)  # its feature extractor's

    @field_validator("features")
    @classmethod
    def _check_features(cls, spec: str) -> str:
        problem = diversity_problem(spec)
        if problem is not None:
            raise ValueError(problem.replace("eval.diversity", "features"))
        return spec

    @field_validator("reward")
    @classmethod
    def _check_reward(cls, inner: InnerSpec) -> InnerSpec:
        """The inner reward's name and options valid (UserError otherwise), before anything loads."""
        checked_inner(inner.name, inner.options, f"reward 'diversity-shaped', reward ({inner.name!r})")
        return inner


def diversity_weights(rewards: Tensor, features: Tensor) -> Tensor:
    """w [G] float64 of one group: 1 below the group's mean reward, else the distance to the nearest sibling over
    the group's mean of those distances (module docstring). ``rewards`` [G], ``features`` [G, D] unit rows."""
    g = rewards.shape[0]
    r = rewards.double()
    below = r - r.mean() < 0
    if g < 2:
        return torch.ones_like(r)
    f = features.double()
    distance = 1 - (f @ f.T).clamp(-1, 1)  # [G, G]
    distance.fill_diagonal_(float("inf"))
    nearest = distance.min(dim=1).values  # [G]
    mean = nearest.mean()
    if not mean > 0:  # every image at one point: no direction to prefer
        return torch.ones_like(r)
    return torch.where(below, torch.ones_like(r), nearest / mean)


def shaped(rewards: Tensor, features: Tensor, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """(r' [N], w [N]) float64 of a call's rewards [N] and unit features [N, D], group by group."""
    r = rewards.double()
    out, weights = r.clone(), torch.ones_like(r)
    for rows in group_rows(prompts).values():
        index = torch.tensor(rows, dtype=torch.int64, device="cpu")
        w = diversity_weights(r[index], features[index])
        mean = r[index].mean()
        out[index] = mean + w * (r[index] - mean)
        weights[index] = w
    return out, weights


@register("reward", "diversity-shaped", options=DiversityShapedOptions)
class DiversityShapedReward:
    """RewardModel: the inner reward's scores shaped by each image's distance to its nearest sibling (module
    docstring). ``scores`` [N] float32 on the CPU; ``details``: the inner scores under its name (and its details as
    ``"name/key"``) and ``diversity_weight``."""

    needs_whole_groups = True  # tpflow.interfaces.CAPABILITIES: one call holds whole groups at one trace column

    @staticmethod
    def reward_parts(options: DiversityShapedOptions) -> list[tuple[str, str, dict[str, Any], bool]]:
        """Its inner reward, given the same samples (``tpflow.interfaces.CAPABILITIES``)."""
        return [("reward", options.reward.name, options.reward.options, False)]

    @staticmethod
    def detail_keys(options: DiversityShapedOptions) -> list[str]:
        """Its details' keys (``tpflow.interfaces.CAPABILITIES``): the inner reward's name and keys, the weight's."""
        inner = options.reward
        return [*prefixed(inner.name, declared_detail_keys(inner.name, inner.options)), WEIGHT_DETAIL]

    def __init__(self, options: DiversityShapedOptions):
        self.options = options
        self.inner = registry.build("reward", options.reward.name, **options.reward.options)
        self.features = build_features(options.features, resolve_device(options.device))

    @staticmethod
    def weight_sources(options: DiversityShapedOptions, settings: dict) -> list[WeightSource]:
        """The inner reward's weights (``tpflow.weights``) and a timm feature extractor's (``feature_sources``); the
        other extractors' load at their first call."""
        from tpflow.rewards.diversity_features import feature_sources
        from tpflow.weights import component_weights

        inner = options.reward
        factory = registry.get("reward", inner.name).factory
        validated = registry.validate_options("reward", inner.name, inner.options)
        where = f"reward 'diversity-shaped', reward ({inner.name!r})"
        sources = component_weights(factory, validated, settings)
        inner_sources = [replace(s, what=f"inner {s.what}", problem=s.problem and f"{where}: {s.problem}")
                         for s in sources]  # fmt: skip
        return inner_sources + feature_sources(options.features, "reward 'diversity-shaped', features")

    @staticmethod
    def preflight(options: DiversityShapedOptions) -> None:
        """The inner reward's preflight (a ``remote`` reward checks its server), before a run starts."""
        inner = options.reward
        registry.preflight("reward", inner.name, registry.validate_options("reward", inner.name, inner.options))

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1]: the inner scores shaped within the call's prompt groups."""
        name = self.options.reward.name
        scores, inner = check_output(self.inner(images, prompts, metadata), len(images), self.inner)  # [N] CPU
        features = torch.nan_to_num(self.features(images)).double()  # [N, D]; the reference sets NaN to 0
        out, weights = shaped(scores, features, prompts)
        details = {name: scores, **{f"{name}/{k}": v for k, v in inner.items()}, WEIGHT_DETAIL: weights.float()}
        return RewardOutput(scores=out.float(), details=details)
