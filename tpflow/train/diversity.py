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
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tpflow.images import to_uint8
from tpflow.settings import diversity_problem

DETAIL = "diversity"  # the per-image details key, and eval_diversity in the metrics
PIXEL_SIDE = 16  # "pixels": the side of the pooled image

Embedder = Callable[[Tensor], Tensor]  # images [N, 3, H, W] in [0, 1] -> unit embeddings [N, D] float32 on the CPU


def build_embedder(spec: str, device: str = "auto") -> Embedder:
    """The embedding ``spec`` names (module docstring); its weights load at its first call, under a lock (the
    trainer and ``tpflow eval`` call it from one thread, a reward server may not)."""
    from tpflow.devices import resolve_device

    problem = diversity_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    kind, _, rest = spec.partition(":")
    if kind == "pixels":
        return pixel_embeddings
    where = resolve_device(device)
    lock = threading.Lock()
    if kind == "shapes-clip":
        from tpflow.rewards.shapes_clip import resolve_weights
        from tpflow.shapes.clip import load_clip

        loaded: list = []

        def shapes(images: Tensor) -> Tensor:
            with lock:
                if not loaded:
                    loaded.append(load_clip(resolve_weights(rest or None), where))
                model = loaded[0]
                size = model.config.image_size
                pixels = to_uint8(_frames(images).to(where)).float() / 255  # [N, 3, H, W] on the uint8 grid
                if pixels.shape[-2:] != (size, size):
                    pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True).clamp(0, 1)
                return model.encode_image(pixels).float().cpu()  # [N, D], unit rows

        return shapes
    from tpflow.images import l2_normalize
    from tpflow.rewards.open_clip import LazyOpenClip

    arch, _, pretrained = rest.partition(":")
    clip = LazyOpenClip(arch, pretrained or "openai", where, f"eval.diversity = {spec!r}")

    @torch.no_grad()
    def open_clip_images(images: Tensor) -> Tensor:
        model = clip.get()
        return l2_normalize(model.model.encode_image(model.preprocess(_frames(images)))).cpu()  # [N, D]

    return open_clip_images


def _frames(images: Tensor) -> Tensor:
    """[N, 3, H, W] as they are; a clip batch [N, F, 3, H, W] by its middle frame."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


@torch.no_grad()
def pixel_embeddings(images: Tensor) -> Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 3·16·16] unit rows: average-pooled to 16×16, each image's mean removed (a
    uniform image, which has no direction, gives zeros)."""
    x = to_uint8(_frames(images)).float().cpu() / 255  # the uint8 grid every reward sees
    x = F.adaptive_avg_pool2d(x, PIXEL_SIDE).flatten(1)  # [N, 768]
    x = x - x.mean(dim=1, keepdim=True)
    return x / x.norm(dim=1, keepdim=True).clamp(min=1e-12)


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
