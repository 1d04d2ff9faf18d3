"""Strict GenEval accuracy of a shapes-dit model on the shapes dataset's sampled test split, per category.

    .venv/bin/python benchmarks/shapes_accuracy.py [--weights PATH] [--steps 10] [--guidance 1 2 3 4] \
        [--n 400] [--grid docs/img/shapes_samples.png]

The test split is sampled from every prompt of the world, so most of its texts are also training texts: it is not
a held-out set (docs/shapes.md, "Splits"). Samples one image per test prompt by ODE (the demo's sampling settings:
K = 10, shift 3), scores it with the `shapes-geneval` reward and prints strict accuracy per tag and overall
(GenEval's mean over tags), for each guidance scale asked. Not run in CI.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import tpflow
from tpflow.grids import Tile, captioned_grid
from tpflow.rewards.geneval.scoring import GenevalResult, accuracy_by_tag
from tpflow.rollout import sample_ode


def evaluate(weights: str | None, steps: int, guidance: float, n: int, seed: int, grid: Path | None) -> dict:
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights)
    reward = tpflow.build("reward", "shapes-geneval")
    items = tpflow.build("dataset", "shapes", test_size=n).split("test")
    prompts = [item.prompt for item in items]
    metadata = [item.metadata for item in items]
    z0 = backbone.initial_noise(len(items), torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    latents = sample_ode(backbone, backbone.encode(prompts), z0, backbone.sigmas(steps), guidance, max_batch=200)
    images = backbone.decode(latents)
    seconds = time.perf_counter() - start
    out = reward(images, prompts, metadata)
    results = [
        GenevalResult(bool(c), bool(s), float(p), "")
        for c, s, p in zip(out.details["correct"], out.details["strict"], out.scores, strict=True)
    ]
    accuracy = accuracy_by_tag(results, [m["tag"] for m in metadata])
    accuracy["reward"] = float(out.scores.mean())
    accuracy["images_per_s"] = len(items) / seconds
    if grid is not None:
        strict = out.details["strict"].tolist()  # green frame: strictly correct, red: not (tpflow.grids.MARKS)
        tiles = [Tile(images[i].float().cpu(), prompts[i], strict[i] == 1, {"index": i}) for i in range(48)]
        captioned_grid(tiles, 8, grid)
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None, help="shapes_dit.safetensors (default: the shipped weights)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, nargs="+", default=[3.0])
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", type=Path, default=None, help="write a sample grid (first guidance only)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tags = ("single_object", "two_object", "counting", "colors", "color_attr", "position")
    print(f"| guidance | {' | '.join(tags)} | overall | partial reward | images/s |")
    print("|---" * (len(tags) + 4) + "|")
    for i, guidance in enumerate(args.guidance):
        acc = evaluate(args.weights, args.steps, guidance, args.n, args.seed, args.grid if i == 0 else None)
        cells = " | ".join(f"{acc[t]:.3f}" for t in tags)
        speed = f"{acc['images_per_s']:.0f}"
        print(f"| {guidance:g} | {cells} | **{acc['overall']:.3f}** | {acc['reward']:.3f} | {speed} |")


if __name__ == "__main__":
    main()
