"""Diversity within groups (``[eval] diversity``): how different a prompt's images are from each other.

A policy can hack a reward by collapsing: every sample of a prompt becomes the one image the reward likes best, and
the reward rises while the model's range shrinks. The evaluation samples ``images_per_prompt`` images of each prompt
(a group, each from its own fixed noise); the diversity of a group is the mean pairwise distance 1 − cos(e_i, e_j)
of its images' embeddings over the G(G−1)/2 pairs: 0 for identical images, larger the more they differ. It is
stored per image as the mean distance to its siblings (``details["diversity"]``), whose mean over a group is the
group's diversity exactly, so the per-category means, the per-prompt pairing of ``tpflow eval --baseline`` and
eval.json treat it like any other figure; its standard error is over the prompts (a group's images are not
independent of each other).

The embedding is named by a spec string:

- ``"shapes-clip"`` (or ``"shapes-clip:<weights>"``): the image encoder of the shapes world's tiny CLIP (the weights
  shipped in tpflow/shapes/weights by default), so that it runs offline on the embedded default;
- ``"clip:<arch>"`` or ``"clip:<arch>:<pretrained>"``: an open_clip image encoder (``pretrained`` a cached tag or a
  file, "openai" by default), read like the CLIP-based rewards' weights, never downloaded;
- ``"pixels"``: the image average-pooled to 16×16 and centred (its mean removed), no weights: cheap, but it sees
  layout and colour, not content.

A clip (a video backbone's [N, F, 3, H, W]) is embedded by its middle frame.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from tpflow.rewards.diversity_features import build_features, pixel_features

DETAIL = "diversity"  # the per-image details key, and eval_diversity in the metrics

Embedder = Callable[[Tensor], Tensor]  # images [N, 3, H, W] in [0, 1] -> unit embeddings [N, D] float32 on the CPU
pixel_embeddings = pixel_features  # "pixels": one extractor for the evaluation and the diversity-shaped reward


def build_embedder(spec: str, device: str = "auto") -> Embedder:
    """The embedding ``spec`` names (module docstring): the diversity-shaped reward's extractor of the same spec
    (``tpflow.rewards.diversity_features``), so that the evaluation measures diversity in the space the shaping
    rewards it; its weights load at its first call, under a lock (a reward server may call from several threads)."""
    from tpflow.devices import resolve_device

    return build_features(spec, resolve_device(device), where=f"eval.diversity = {spec!r}")


def mean_pairwise_distance(embeddings: Tensor) -> float:
    """The diversity of one group: the mean of 1 − cos(e_i, e_j) over its pairs i < j (rows of [G, D] need not be
    unit); NaN for fewer than two images."""
    g = embeddings.shape[0]
    if g < 2:
        return math.nan
    unit = embeddings.double() / embeddings.double().norm(dim=1, keepdim=True).clamp(min=1e-12)
    cos = unit @ unit.T  # [G, G]
    return float((g * (g - 1) - (cos.sum() - cos.diagonal().sum())) / (g * (g - 1)))


def sibling_distances(embeddings: Tensor, groups: list[int]) -> list[float]:
    """Per image (rows of [R, D]): the mean 1 − cos to the other images of its group (``groups`` [R], e.g. each
    image's prompt index); NaN for an image alone in its group. A group's mean of these is its
    ``mean_pairwise_distance``."""
    unit = embeddings.double() / embeddings.double().norm(dim=1, keepdim=True).clamp(min=1e-12)  # [R, D]
    out = [math.nan] * len(groups)
    members: dict[int, list[int]] = {}
    for r, g in enumerate(groups):
        members.setdefault(g, []).append(r)
    for rows in members.values():
        if len(rows) < 2:
            continue
        index = torch.tensor(rows, dtype=torch.int64, device="cpu")
        cos = unit[index] @ unit[index].T  # [G, G]
        mean = (1 - cos).sum(dim=1) / (len(rows) - 1)  # the diagonal's 1 − 1 adds nothing
        for r, value in zip(rows, mean.tolist(), strict=True):
            out[r] = value
    return out


def per_group(values: list[float], groups: list[int]) -> dict[int, float]:
    """Group -> the mean of ``values`` over its images (its diversity, for ``sibling_distances``)."""
    sums: dict[int, list[float]] = {}
    for value, g in zip(values, groups, strict=True):
        sums.setdefault(g, []).append(value)
    return {g: sum(v) / len(v) for g, v in sums.items()}


def diversity_se(values: list[float], groups: list[int]) -> float:
    """The standard error of the mean diversity over the groups (a group's images are not independent, its
    prompts are); NaN with fewer than two finite groups."""
    means = [v for v in per_group(values, groups).values() if math.isfinite(v)]
    if len(means) < 2:
        return math.nan
    mean = sum(means) / len(means)
    return math.sqrt(sum((v - mean) ** 2 for v in means) / (len(means) - 1) / len(means))
