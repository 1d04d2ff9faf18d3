"""Pairwise accuracy of the shapes-clip reward model on held-out test prompts, per category and per negative kind.

    .venv/bin/python benchmarks/shapes_clip_accuracy.py [--weights PATH] [--n 1200] [--seed 0] [--samples 400]

For ``--n`` test prompts (balanced over the six tags, ``prompts.prompts("test", n, seed)``), renders the correct
scene and its hard negatives (``tpflow.shapes.negatives``) with numpy seed ``--seed`` and counts how often the
correct image scores strictly higher for the prompt. Prints Markdown tables (the ones in docs/shapes.md) and the
mean reward of correct and negative images. With ``--samples N`` it also scores N samples of the shipped shapes-dit
(test prompts, 10 Euler steps, CFG 3, the demo's settings) and compares with the strict GenEval verdict of
``shapes-geneval``: mean reward of correct and incorrect samples and the AUC (the probability that a correct sample
outscores an incorrect one of the same tag), per tag. Not run in CI.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tpflow.rewards.shapes_clip import SCORE_SCALE, resolve_weights
from tpflow.shapes.clip import load_clip
from tpflow.shapes.clip_accuracy import pairwise_accuracy
from tpflow.shapes.negatives import hard_negatives
from tpflow.shapes.prompts import TAGS, prompts
from tpflow.shapes.render import draw_scene, scene


@torch.no_grad()
def mean_scores(model, items, seed: int) -> tuple[float, float]:
    """Mean reward (exp(logit_scale)·cos / SCORE_SCALE) of the correct renderings and of their hard negatives."""
    rng = np.random.default_rng(seed)
    right, wrong = [], []
    scale = float(model.scale()) / SCORE_SCALE
    for item in items:
        objects = scene(item.metadata, rng)
        scenes = [objects] + [neg.objects for neg in hard_negatives(item.metadata, objects, rng)]
        cos = model.encode_image(torch.stack([draw_scene(s) for s in scenes])) @ model.encode_prompts([item.prompt]).T
        right.append(scale * float(cos[0]))
        wrong += [scale * float(c) for c in cos[1:]]
    return float(np.mean(right)), float(np.mean(wrong))


@torch.no_grad()
def on_samples(weights: str | None, n: int, seed: int) -> None:
    """shapes-clip against strict GenEval on shapes-dit samples: mean rewards and AUC per tag (Markdown)."""
    import tpflow
    from tpflow.rollout import sample_ode

    backbone = tpflow.build("backbone", "shapes-dit")
    clip = tpflow.build("reward", "shapes-clip", weights=weights, device="cpu")
    items = tpflow.build("dataset", "shapes", test_size=n).split("test")
    texts, metadata = [item.prompt for item in items], [item.metadata for item in items]
    z0 = backbone.initial_noise(n, torch.Generator().manual_seed(seed))
    latents = sample_ode(backbone, backbone.encode(texts), z0, backbone.sigmas(10), 3.0, max_batch=200)
    images = backbone.decode(latents)
    reward = clip(images, texts, metadata).scores
    strict = tpflow.build("reward", "shapes-geneval")(images, texts, metadata).details["strict"].bool()
    tags = np.array([m["tag"] for m in metadata])
    print(f"\n{n} shapes-dit samples (CFG 3, 10 steps), shapes-clip reward by strict GenEval verdict:\n")
    print("| tag | correct | mean reward correct | mean reward incorrect | AUC |\n|---|---|---|---|---|")
    for tag in (*TAGS, "all"):
        keep = torch.from_numpy(tags == tag) if tag != "all" else torch.ones(n, dtype=torch.bool)
        good, bad = reward[keep & strict], reward[keep & ~strict]
        auc = float((good[:, None] > bad[None]).float().mean()) if len(good) and len(bad) else float("nan")
        print(f"| {tag} | {len(good)}/{int(keep.sum())} | {good.mean():.3f} | {bad.mean():.3f} | {auc:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None, help="shapes_clip.safetensors (default: the shipped one)")
    parser.add_argument("--n", type=int, default=1200, help="test prompts, balanced over the six tags")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and of the renderings")
    parser.add_argument("--samples", type=int, default=0, help="also score this many shapes-dit samples (0: none)")
    args = parser.parse_args()
    path = resolve_weights(args.weights)
    model = load_clip(path)
    items = prompts("test", args.n, seed=args.seed)
    start = time.perf_counter()
    acc = pairwise_accuracy(model, items, seed=args.seed)
    seconds = time.perf_counter() - start
    print(
        f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, logit scale "
        f"{float(model.scale()):.1f}; {args.n} test prompts, seed {args.seed}, {seconds:.1f} s\n"
    )
    print("| " + " | ".join(TAGS) + " | **overall** |")
    print("|" + "---|" * (len(TAGS) + 1))
    print("| " + " | ".join(f"{acc['by_tag'][t]:.3f}" for t in TAGS) + f" | **{acc['overall']:.3f}** |")
    print("| " + " | ".join(f"{acc['pairs'][t]} pairs" for t in TAGS) + f" | {sum(acc['pairs'].values())} |\n")
    print("| tag / negative kind | accuracy |\n|---|---|")
    for key, value in sorted(acc["by_tag_kind"].items(), key=lambda kv: TAGS.index(kv[0].split("/")[0])):
        print(f"| {key} | {value:.3f} |")
    print("\n| negative kind | accuracy |\n|---|---|")
    for key, value in acc["by_kind"].items():
        print(f"| {key} | {value:.3f} |")
    right, wrong = mean_scores(model, items[:300], args.seed)
    print(f"\nmean reward (first 300 prompts): correct {right:.3f}, hard negatives {wrong:.3f}")
    if args.samples:
        on_samples(args.weights, args.samples, args.seed)


if __name__ == "__main__":
    main()
