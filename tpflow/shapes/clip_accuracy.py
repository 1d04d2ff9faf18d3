"""Pairwise accuracy of a ShapesCLIP: does the correct rendering of a prompt score above each of its hard negatives?

The measure of a reward that must rank a diffusion model's samples: for every prompt, the ground-truth scene
(``render.scene``) and each of its hard negatives (``negatives.hard_negatives``) are drawn with one numpy seed and
scored against the prompt; a pair counts as right when the correct image's cosine is strictly higher. Reported per
tag and per negative kind; used by the accuracy test, the benchmark and the training statistics.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from tpflow.shapes.clip import ShapesClip
from tpflow.types import PromptItem


@torch.no_grad()
def pairwise_accuracy(model: ShapesClip, items: list[PromptItem], seed: int = 0) -> dict[str, Any]:
    """Fractions of (correct, hard negative) pairs ranked right.

    Returns:
        ``{"by_tag": {tag: acc}, "by_kind": {kind: acc}, "by_tag_kind": {"tag/kind": acc}, "pairs": {tag: n},
        "overall": acc}``, accuracies rounded to 4 digits.
    """
    from tpflow.shapes.negatives import hard_negatives
    from tpflow.shapes.render import draw_scene, scene

    rng = np.random.default_rng(seed)
    scenes, owners, kinds = [], [], []  # per image: objects, index of its prompt, kind ("" for the correct one)
    for k, item in enumerate(items):
        objects = scene(item.metadata, rng)
        negatives = hard_negatives(item.metadata, objects, rng)
        scenes += [objects] + [neg.objects for neg in negatives]
        owners += [k] * (1 + len(negatives))
        kinds += [""] + [neg.kind for neg in negatives]
    device = model.logit_scale.device
    images = torch.stack([draw_scene(objects) for objects in scenes]).to(device)  # [I, 3, 32, 32]
    image_emb = torch.cat([model.encode_image(chunk) for chunk in images.split(512)])  # [I, D]
    text_emb = model.encode_prompts([item.prompt for item in items])  # [P, D]
    owner = torch.tensor(owners, dtype=torch.long, device=device)  # [I]
    cosine = (text_emb[owner] * image_emb).sum(-1).cpu().tolist()  # [I]: each image against its own prompt
    hits: dict[str, list[bool]] = defaultdict(list)
    correct = 0.0
    for i, kind in enumerate(kinds):
        if not kind:
            correct = cosine[i]
            continue
        tag = items[owners[i]].metadata["tag"]
        right = correct > cosine[i]
        for key in (tag, f"kind:{kind}", f"{tag}/{kind}", "overall"):
            hits[key].append(right)
    acc = {key: round(sum(v) / len(v), 4) for key, v in hits.items()}
    return {
        "by_tag": {k: v for k, v in acc.items() if "/" not in k and ":" not in k and k != "overall"},
        "by_kind": {k[5:]: v for k, v in acc.items() if k.startswith("kind:")},
        "by_tag_kind": {k: v for k, v in acc.items() if "/" in k},
        "pairs": {k: len(v) for k, v in hits.items() if "/" not in k and ":" not in k and k != "overall"},
        "overall": acc.get("overall", float("nan")),
    }
