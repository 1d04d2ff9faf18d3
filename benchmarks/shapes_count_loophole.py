"""The counting loophole of the shapes-geneval reward: extra objects found below GenEval's counting threshold.

    .venv/bin/python benchmarks/shapes_count_loophole.py [--targets recipes/shapes_tp.toml runs/NAME ...] \
        [--images-per-prompt 64] [--seed 12345] [--truth-scenes 100] [--write-prompts runs/shapes_counting.jsonl]

Why: GenEval keeps a detection on a ``counting`` prompt only above confidence 0.9 (0.3 for every other tag). In the
shapes world a malformed extra object of the asked class is found at 0.3 to 0.9, so "three triangles" with four
drawn is scored correct, and a policy could learn to draw the extra object badly. This measures how often that
happens and what counting those detections would cost (docs/shapes.md, "The counting threshold").

1. **Samples** of each target (a recipe TOML: its base model; a run dir or checkpoint: its adapter, loaded as
   ``tpflow eval`` loads it), drawn as the recipe evaluates (ODE, its ``[eval]`` steps and guidance) from fixed
   noise (``--seed``): the 9 distinct counting prompts × ``--images-per-prompt``. Per target: GenEval's verdict
   (``correct``), the loophole (correct while the detector also found an object of the asked class at 0.3 <
   confidence ≤ 0.9), the number of such low-confidence extras, and the verdict with ``strict_count`` (every
   detection of the asked class above 0.3 counts against the asked number). Rates come with their count k/n and a
   95% Wilson interval.
2. **Truth**: ground-truth renderings of the same prompts (``render.scene``) and their n ± 1 hard negatives
   (``negatives.hard_negatives``), clean and under blur and noise, ``--truth-scenes`` scenes per prompt: the
   agreement of the verdict with the renderer's truth without and with ``strict_count``.

``--write-prompts PATH`` writes the counting prompts with their metadata as a ``jsonl`` dataset (to train on them
only: ``tpflow train recipes/shapes_flowgrpo.toml --set dataset.name=jsonl --set dataset.path=PATH``) and exits.
Runs on one CPU thread: about a minute per target at 64 images per prompt. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tpflow.rewards.geneval.scoring import COUNTING_THRESHOLD, THRESHOLD, score
from tpflow.shapes.detect import detect_batch
from tpflow.shapes.negatives import hard_negatives
from tpflow.shapes.prompts import distinct_items
from tpflow.shapes.render import draw_scene, scene
from tpflow.types import PromptItem

CONDITIONS = ("clean", "blur + noise 0.03", "blur + noise 0.06", "blur + noise 0.1")


def counting_items() -> list[PromptItem]:
    """The shapes world's 9 distinct counting prompts (two to four of each shape)."""
    return [item for item in distinct_items() if item.metadata["tag"] == "counting"]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def rate(k: int, n: int) -> str:
    low, high = wilson(k, n)
    return f"{k / n:.3f} ({k}/{n}, [{low:.3f}, {high:.3f}])" if n else "n/a (0/0)"


@dataclass
class Tally:
    """Counting verdicts of a set of images."""

    n: int = 0
    correct: int = 0  # GenEval's official verdict
    strict_count_correct: int = 0  # the same with strict_count
    loophole: int = 0  # correct, with an asked-class detection at 0.3 < confidence <= 0.9
    with_faint: int = 0  # images with at least one such detection
    faint: int = 0  # such detections in all
    faint_scores: list[float] = field(default_factory=list)  # their confidences, in loophole images
    flags: list[bool] = field(default_factory=list)  # per image, in order: whether it is a loophole image

    def add(self, detections: list, metadata: dict) -> None:
        cls = metadata["include"][0]["class"]
        faint = [d.score for d in detections if d.cls == cls and THRESHOLD < d.score <= COUNTING_THRESHOLD]
        ok = score(detections, metadata, (32, 32)).correct
        self.n += 1
        self.correct += ok
        self.strict_count_correct += score(detections, metadata, (32, 32), strict_count=True).correct
        self.with_faint += bool(faint)
        self.faint += len(faint)
        self.flags.append(ok and bool(faint))
        if ok and faint:
            self.loophole += 1
            self.faint_scores += faint


def paired(first: list[bool], then: list[bool]) -> str:
    """The paired change of a per-image rate between two targets sampled from the same noise: the difference with a
    95% interval (normal approximation of the paired difference) and McNemar's exact p on the discordant images."""
    from scipy.stats import binomtest

    n = len(first)
    gained = sum(b and not a for a, b in zip(first, then, strict=True))
    lost = sum(a and not b for a, b in zip(first, then, strict=True))
    diff = (gained - lost) / n
    half = 1.96 * math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    p = binomtest(min(gained, lost), gained + lost, 0.5).pvalue if gained + lost else 1.0
    return f"{diff:+.3f} [{diff - half:+.3f}, {diff + half:+.3f}] (+{gained} −{lost} images, McNemar p = {p:.2g})"


def sample_target(target: str, images_per_prompt: int, seed: int, batch: int) -> tuple[list[PromptItem], list]:
    """ODE samples of the counting prompts by ``target`` at its recipe's eval settings, and their detections."""
    from tpflow.evaluation.targets import load_model, resolve_target
    from tpflow.rollout import sample_ode

    resolved = resolve_target(target)
    backbone = load_model(resolved)
    settings = resolved.recipe.eval
    items = [item for item in counting_items() for _ in range(images_per_prompt)]
    z0 = backbone.initial_noise(len(items), torch.Generator().manual_seed(seed))
    detections: list = []
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        part = items[i : i + batch]
        with torch.no_grad():
            cond = backbone.encode([it.prompt for it in part])
            latents = sample_ode(backbone, cond, z0[i : i + len(part)], backbone.sigmas(settings.num_steps),
                                 settings.guidance, batch)  # fmt: skip
        detections += detect_batch(backbone.decode(latents))
        print(f"  {resolved.label}: {i + len(part)}/{len(items)} images, {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    print(f"  ({settings.num_steps} ODE steps, guidance {settings.guidance:g})", file=sys.stderr)
    return items, detections


def degrade(images: torch.Tensor, condition: str, generator: torch.Generator) -> torch.Tensor:
    """Images [N, 3, H, W] under a condition of ``CONDITIONS``: a 3×3 binomial blur and/or Gaussian noise."""
    if "blur" in condition:
        kernel = torch.tensor([1.0, 2.0, 1.0])
        kernel = (kernel[:, None] * kernel[None, :] / 16).expand(3, 1, 3, 3)
        images = F.conv2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    if "noise" in condition:
        sigma = float(condition.rsplit(" ", 1)[1])
        images = images + sigma * torch.randn(images.shape, generator=generator)
    return images.clamp(0, 1)


def truth(scenes_per_prompt: int, seed: int) -> dict[str, dict[str, list[int]]]:
    """Verdicts on ground-truth renderings: per condition and kind (positive, n−1, n+1), for each rule, the number
    of verdicts that agree with the truth and the number of scenes."""
    rng = np.random.default_rng(seed)
    images, metadata, truths, kinds = [], [], [], []
    for item in counting_items():
        for _ in range(scenes_per_prompt):
            objects = scene(item.metadata, rng)
            images.append(draw_scene(objects))
            metadata.append(item.metadata)
            truths.append(True)
            kinds.append("positive")
            n = item.metadata["include"][0]["count"]
            for negative in hard_negatives(item.metadata, objects, rng):
                images.append(draw_scene(negative.objects))
                metadata.append(item.metadata)
                truths.append(False)
                kinds.append("n+1" if len(negative.objects) > n else "n-1")
    stack = torch.stack(images)
    print(f"  truth: {len(images)} renderings ({kinds.count('positive')} correct scenes)", file=sys.stderr)
    out: dict[str, dict[str, list[int]]] = {}
    for condition in CONDITIONS:
        found = detect_batch(degrade(stack, condition, torch.Generator().manual_seed(seed)))
        table: dict[str, list[int]] = {}
        for dets, meta, true, kind in zip(found, metadata, truths, kinds, strict=True):
            for rule, strict_count in (("geneval", False), ("strict_count", True)):
                verdict = score(dets, meta, (32, 32), strict_count).correct
                for key in (f"{rule} {kind}", f"{rule} all"):
                    agree, total = table.setdefault(key, [0, 0])
                    table[key] = [agree + (verdict == true), total + 1]
        out[condition] = table
        print(f"  truth: {condition} done", file=sys.stderr, flush=True)
    return out


def write_prompts(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**item.metadata, "prompt": item.prompt}) for item in counting_items()]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} counting prompts to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="*", default=["recipes/shapes_tp.toml"],
                        help="recipe TOMLs (base model), run dirs or checkpoint dirs")  # fmt: skip
    parser.add_argument("--images-per-prompt", type=int, default=64)
    parser.add_argument("--seed", type=int, default=12345, help="noise seed of the samples (the shapes eval seed)")
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--truth-scenes", type=int, default=100, help="correct scenes per prompt (0: skip)")
    parser.add_argument("--write-prompts", type=Path, default=None, help="write the counting prompts and exit")
    args = parser.parse_args()
    if args.write_prompts is not None:
        write_prompts(args.write_prompts)
        return
    torch.set_num_threads(1)

    print(f"## Samples: 9 counting prompts × {args.images_per_prompt} images, noise seed {args.seed}\n")
    print("| target | correct | loophole (of all) | loophole (of correct) | images with a faint extra | faint extras "
          "| faint extras in loophole images | correct, strict_count |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    tallies = []
    for target in args.targets:
        items, detections = sample_target(target, args.images_per_prompt, args.seed, args.batch)
        tally = Tally()
        for item, found in zip(items, detections, strict=True):
            tally.add(found, item.metadata)
        tallies.append(tally)
        scores = tally.faint_scores
        spread = "0"
        if scores:
            spread = f"{len(scores)}: {min(scores):.2f}–{max(scores):.2f}, median {np.median(scores):.2f}"
        print(
            f"| {target} | {rate(tally.correct, tally.n)} | {rate(tally.loophole, tally.n)} "
            f"| {rate(tally.loophole, tally.correct)} | {rate(tally.with_faint, tally.n)} | {tally.faint} "
            f"| {spread} | {rate(tally.strict_count_correct, tally.n)} |",
            flush=True,
        )
    if len(tallies) > 1:
        print(f"\nLoophole rate against {args.targets[0]} (the same prompts and noise, image by image):\n")
        for target, tally in zip(args.targets[1:], tallies[1:], strict=True):
            print(f"- {target}: {paired(tallies[0].flags, tally.flags)}")
    if args.truth_scenes:
        print(f"\n## Truth: renderings of the counting prompts, {args.truth_scenes} correct scenes per prompt\n")
        table = truth(args.truth_scenes, args.seed)
        kinds = ("positive", "n-1", "n+1", "all")
        print("| condition | rule | " + " | ".join(f"agree, {k}" for k in kinds) + " |")
        print("|---|---|" + "---|" * len(kinds))
        for condition, counts in table.items():
            for rule in ("geneval", "strict_count"):
                cells = " | ".join(rate(*counts[f"{rule} {k}"]) for k in kinds)
                print(f"| {condition} | {rule} | {cells} |")


if __name__ == "__main__":
    main()
