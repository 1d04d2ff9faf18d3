"""Evaluation: ODE samples of the held-out prompts, their reward, per-tag accuracy and a sample grid.

Used by the trainer every ``eval.every`` epochs and by ``tpflow eval`` (tpflow/evaluation), through the same
``score_prompts``, so that the command reproduces what training logged for the same weights, prompts, steps and seed.

The images are dealt to the processes (image r to process r mod P) and the scores gathered; image r starts from the
same noise whatever P (row r of one seeded draw), so the figures do not depend on the number of processes. With
``images_per_prompt = n`` (the trainer's ``eval.images_per_prompt``, 1 by default) image r is the (r mod n)-th image
of prompt r // n.

The sample grid shows at most ``GRID_IMAGES`` of the images, chosen by ``tpflow.grids.shown_images`` (its rule is
written in the grid's tile map), each with its prompt and, for GenEval-style rewards, its strict verdict; an edit
(an item with ``metadata["sources"]``) is shown after its source image(s), captioned with its instruction.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpflow.devices import cpu_generator
from tpflow.distributed import Distributed
from tpflow.grids import (
    EVAL_TILE,
    GRID_IMAGES,
    Grid,
    Tile,
    captioned_grid,
    clip_grid,
    columns_for,
    edit_panels,
    shown_images,
)
from tpflow.images import to_uint8
from tpflow.interfaces import Backbone, PromptDataset, RewardModel
from tpflow.rollout import eval_solver, sample_ode
from tpflow.scoring.call import DEFAULT_POLICY, RewardPolicy, call_reward, reward_name
from tpflow.scoring.watched import standard_errors
from tpflow.settings import EvalSettings
from tpflow.sources import encode_rows, load, references
from tpflow.train.diversity import DETAIL as DIVERSITY
from tpflow.train.diversity import Embedder, diversity_se, sibling_distances
from tpflow.types import PromptItem
from tpflow.video import frame_strip, strip_frames

logger = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 12_345  # the trainer evaluates with noise seeded train.seed + this, at every eval


def eval_split(dataset: PromptDataset) -> str:
    """The split evaluations sample: "test", or "train" for a dataset that has none (``no_test_split`` says so)."""
    return "test" if "test" in dataset.splits else "train"


def no_test_split(dataset_name: str) -> str:
    """What the trainer and ``tpflow eval`` say when the dataset has no test split."""
    return (
        f"the dataset {dataset_name!r} has no test split: evaluations sample its train split, the prompts it trains "
        "on, so the eval figures are not on held-out prompts (a prompt file takes one as [dataset] test_path)."
    )


def eval_seed(train_seed: int, fixed: int | None = None) -> int:
    """The noise seed of the trainer's evaluations (and ``tpflow eval``'s default): ``[eval] seed`` when set (one
    evaluation set for every run, whatever its training seed), else ``train.seed`` + 12,345."""
    return train_seed + EVAL_SEED_OFFSET if fixed is None else fixed


@dataclass
class Scored:
    """Every process's evaluation images, gathered: one row per image, in image order."""

    prompt_index: list[int]  # [R] index into the prompt list
    scores: list[float]  # [R]
    details: dict[str, list[float]]  # name -> [R]
    grid: list[torch.Tensor] = field(default_factory=list)  # the images the grid shows, [1, 3, H, W] uint8 each
    grid_rows: list[int] = field(default_factory=list)  # [len(grid)] their image rows
    grid_rule: str = ""  # which images the grid shows, in words (``shown_images``)


@torch.no_grad()
def score_prompts(
    backbone: Backbone,
    reward: RewardModel,
    everything: list[PromptItem],
    settings: EvalSettings,
    seed: int,
    dist: Distributed,
    autocast: Callable[[], AbstractContextManager],
    images_per_prompt: int = 1,
    progress: Callable[[int], None] | None = None,
    policy: RewardPolicy = DEFAULT_POLICY,
    embed: Embedder | None = None,
    z0_seeds: Sequence[int] | None = None,
) -> Scored:
    """ODE samples (``settings.num_steps`` steps, ``settings.guidance``) of ``images_per_prompt`` images per prompt,
    decoded and scored in batches of ``settings.batch_size``; call it on every process (it gathers). ``z0_seeds``:
    one seed per image whose z_0 is drawn alone from it (a rollout's ``same_noise`` draw), instead of ``seed``'s one
    draw over every image.

    Each batch's reward call goes through ``call_reward`` under ``policy`` (time limit, retries, output checks, as
    in training); non-finite scores kept by ``policy`` (``eval.nonfinite_rewards = "warn"``) get one warning.
    With ``embed`` (``eval.diversity``) and two or more images per prompt, each image's mean embedding distance to
    its prompt's other images is the detail ``diversity`` (tpflow.train.diversity), computed once gathered: a
    prompt's images may lie in several batches and processes."""
    n = images_per_prompt
    grid_rows, grid_rule = shown_images(len(everything), n, texts=[item.prompt for item in everything])
    mine = list(range(dist.rank, len(everything) * n, dist.world_size))  # this process's image rows
    rows, shown, embedded = _score_mine(backbone, reward, everything, mine, n, set(grid_rows), settings, seed,
                                        autocast, progress, policy, embed if n > 1 else None, z0_seeds)  # fmt: skip
    rows = sorted(dist.gather_objects(rows))
    bad = sum(not math.isfinite(score) for _, score, _ in rows)
    if bad and dist.is_main:
        logger.warning(  # every time (a Python warning would show once per text): one line on stderr
            "Evaluation: reward %s returned non-finite scores (NaN or inf) for %d of %d images; kept as "
            "eval.nonfinite_rewards = 'warn' says (their means are null in the logs).",
            reward_name(reward), bad, len(rows),
        )  # fmt: skip
    shown = sorted(dist.gather_objects(shown), key=lambda pair: pair[0])
    names = list(rows[0][2]) if rows else []
    details = {name: [d[name] for _, _, d in rows] for name in names}
    if embed is not None and n > 1:
        vectors = torch.stack([v for _, v in sorted(dist.gather_objects(embedded), key=lambda pair: pair[0])])
        details[DIVERSITY] = sibling_distances(vectors, [r // n for r, _, _ in rows])  # [R]
    return Scored(
        prompt_index=[r // n for r, _, _ in rows],
        scores=[score for _, score, _ in rows],
        details=details,
        grid=[pixels for _, pixels in shown],
        grid_rows=[r for r, _ in shown],
        grid_rule=grid_rule,
    )


def _score_mine(
    backbone: Backbone,
    reward: RewardModel,
    everything: list[PromptItem],
    mine: list[int],
    n: int,
    in_grid: set[int],
    settings: EvalSettings,
    seed: int,
    autocast: Callable[[], AbstractContextManager],
    progress: Callable[[int], None] | None,
    policy: RewardPolicy,
    embed: Embedder | None = None,
    z0_seeds: Sequence[int] | None = None,
) -> tuple[list[tuple[int, float, dict[str, float]]], list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
    """This process's share of ``score_prompts``: the images of rows ``mine`` (image r: prompt r // n), sampled,
    decoded and scored in batches; returns (image row, score, details) per image, (image row, [1, 3, H, W] uint8)
    for those of ``in_grid`` and, with ``embed``, (image row, [D] embedding on the CPU) per image, ungathered. Each
    starts from its row of one seeded draw over every image, so that its noise does not depend on the number of
    processes."""
    items = [everything[r // n] for r in mine]
    shown: list[tuple[int, torch.Tensor]] = []  # (image row, [1, 3, H, W] uint8) for the sample grid
    embedded: list[tuple[int, torch.Tensor]] = []  # (image row, [D]) for the diversity within groups
    if not items:
        return [], shown, embedded
    if z0_seeds is None:
        z0 = backbone.initial_noise(len(everything) * n, cpu_generator(seed))[mine]  # same z_0 on every device
    else:  # each image's own draw, as a rollout's group seeds draw it (tpflow.rollout.from_settings)
        z0 = torch.cat([backbone.initial_noise(1, cpu_generator(z0_seeds[r])) for r in mine])
    scores: list[float] = []
    details: dict[str, list[float]] = defaultdict(list)
    for start in range(0, len(items), settings.batch_size):
        part = items[start : start + settings.batch_size]
        prompts = [it.prompt for it in part]
        cond = encode_rows(backbone, part)  # an editing prompt's sources too (tpflow.sources)
        with autocast():
            latents = sample_ode(backbone, cond, z0[start : start + len(part)],
                                 backbone.sigmas(settings.num_steps), settings.guidance,
                                 settings.batch_size, eval_solver(settings))  # fmt: skip
        images = backbone.decode(latents)
        out = call_reward(reward, images, prompts, [it.metadata for it in part], policy)
        scores += out.scores.tolist()
        for name, values in out.details.items():
            details[name] += values.tolist()
        shown += [
            (mine[start + j], to_uint8(images[j : j + 1].cpu()))  # [1, 3, H, W], or a clip's [1, F, 3, H, W]
            for j in range(len(part))
            if mine[start + j] in in_grid
        ]
        if embed is not None:
            embedded += [(mine[start + j], v.clone()) for j, v in enumerate(embed(images))]  # [D] each
        if progress is not None:
            progress(len(part))
    rows = [
        (r, score, {name: v[j] for name, v in details.items()})
        for j, (r, score) in enumerate(zip(mine, scores, strict=True))
    ]  # (image row, score, details)
    return rows, shown, embedded


def grid_tiles(scored: Scored, everything: list[PromptItem], source: str | None = None) -> list[Tile]:
    """The tiles of the images the grid shows: each with its prompt, its score written above it, its strict verdict
    as the mark (GenEval-style rewards) and, for the tile map, its index r (its line in ``eval.json``'s images), tag,
    score and ``source``."""
    strict = scored.details.get("strict")
    tiles = []
    for r, pixels in zip(scored.grid_rows, scored.grid, strict=True):
        item = everything[scored.prompt_index[r]]
        info = {"index": r, "tag": item.metadata.get("tag"), "score": scored.scores[r]}
        verdict = None if strict is None or not math.isfinite(strict[r]) else strict[r] == 1
        if verdict is not None:
            info["strict"] = strict[r]
        if source is not None:
            info["source"] = source
        note = f"score {scored.scores[r]:.3f}"  # every reward's figure on its tile, not only in eval.json
        frames = pixels[0] if pixels.ndim == 5 else None  # a clip: its strip on the PNG, all its frames animated
        refs = references(item.metadata)  # an edit: its source(s) drawn left of it, the instruction under both
        if refs:
            info["sources"] = list(refs)
        sources = tuple(load(ref) for ref in refs)
        tiles.append(Tile(frame_strip(pixels)[0].float() / 255, item.prompt, verdict, info, note, frames, sources))
    return tiles


def save_eval_grid(scored: Scored, everything: list[PromptItem], path: Path) -> Grid:
    """The evaluation's sample grid, a prompt's shown images side by side, and its tile map (with the rule)."""
    per_prompt = min(len(scored.scores) // max(1, len(everything)), GRID_IMAGES)
    tiles = grid_tiles(scored, everything)
    columns = columns_for(per_prompt, len(tiles))
    about = {"shows": scored.grid_rule}
    if edit_panels(tiles):
        about["edits"] = "each tile shows the source image(s), then the edit, captioned with the instruction"
    if tiles and tiles[0].frames is not None:  # clips: the PNG shows strips, the WebP beside it plays them
        about["clips"] = clip_grid(tiles, columns, Path(path).with_suffix(".webp"), max_tile=EVAL_TILE).name
        about["strip"] = "each tile shows frames " + ", ".join(map(str, strip_frames(tiles[0].frames.shape[0])))
    return captioned_grid(tiles, columns, path, max_tile=EVAL_TILE, about=about)


def summarize(scored: Scored, everything: list[PromptItem]) -> dict[str, float]:
    """The evaluation's figures, each a mean over images unless it says otherwise.

    - ``eval_reward`` (mean score) and ``eval_<detail>`` (mean of each reward detail);
    - when every prompt has a ``tag``: ``eval_reward_<tag>`` (mean score of the tag's images) and
      ``eval_reward_tags``, the mean over tags of those (tag-balanced, so a tag with more images does not weigh
      more); for GenEval-style rewards (a ``strict`` detail) also strict accuracy per tag ``eval_acc_<tag>`` and
      their mean ``eval_strict_tags``: GenEval's overall score, which differs from ``eval_strict`` (the mean over
      images) when the tags have different numbers of images;
    - when every prompt's metadata has ``held_out`` (the shapes world's unseen colour-shape pairs):
      ``eval_reward_held_out`` / ``eval_reward_seen`` (mean score of the images of held-out / other prompts) and,
      with a ``strict`` detail, ``eval_strict_held_out`` / ``eval_strict_seen``; a side with no images is left out.

    A tag named like one of these figures (``tags``, ``held_out``, ``seen``) is refused before a run starts
    (``tpflow.preflight.RESERVED_TAGS``): its figure would overwrite another.
    """
    count = len(scored.scores)
    metrics = {"eval_reward": sum(scored.scores) / count}
    for name, values in scored.details.items():
        metrics[f"eval_{name}"] = sum(values) / count
    metrics.update(standard_errors(scored.details, scored.scores))  # with watched rewards (tpflow.scoring.watched)
    if DIVERSITY in scored.details:  # eval.diversity: its standard error is over the prompts, not the images
        metrics[f"eval_{DIVERSITY}_se"] = diversity_se(scored.details[DIVERSITY], scored.prompt_index)
    strict = scored.details.get("strict")
    tags = [everything[k].metadata.get("tag") for k in scored.prompt_index]  # [R]
    if all(tags):
        reward_by_tag = _means_by(tags, scored.scores)
        for tag, mean in reward_by_tag.items():
            metrics[f"eval_reward_{tag}"] = mean
        metrics["eval_reward_tags"] = sum(reward_by_tag.values()) / len(reward_by_tag)
        if strict is not None:
            acc_by_tag = _means_by(tags, strict)
            for tag, acc in acc_by_tag.items():
                metrics[f"eval_acc_{tag}"] = acc
            metrics["eval_strict_tags"] = sum(acc_by_tag.values()) / len(acc_by_tag)
    if all("held_out" in everything[k].metadata for k in scored.prompt_index):
        sides = ["held_out" if everything[k].metadata["held_out"] else "seen" for k in scored.prompt_index]  # [R]
        for side, mean in _means_by(sides, scored.scores).items():
            metrics[f"eval_reward_{side}"] = mean
        if strict is not None:
            for side, mean in _means_by(sides, strict).items():
                metrics[f"eval_strict_{side}"] = mean
    return metrics


def _means_by(keys: list[str], values: list[float]) -> dict[str, float]:
    """Mean of ``values`` per key, keys sorted (so the metric names come in a stable order)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for key, value in zip(keys, values, strict=True):
        groups[key].append(value)
    return {key: sum(group) / len(group) for key, group in sorted(groups.items())}


def evaluate(
    backbone: Backbone,
    reward: RewardModel,
    everything: list[PromptItem],
    settings: EvalSettings,
    seed: int,
    dist: Distributed,
    autocast: Callable[[], AbstractContextManager],
    grid: Path,
    policy: RewardPolicy = DEFAULT_POLICY,
    embed: Embedder | None = None,
) -> dict[str, float]:
    """The trainer's evaluation: ``summarize`` of ``settings.images_per_prompt`` images per prompt of ``everything``
    (each from its own row of the seeded noise); process 0 writes ``grid``.

    Call it on every process (it gathers), with the weights to evaluate already in place (e.g. the EMA swapped in);
    ``embed``: the embedding of ``eval.diversity`` (``score_prompts``)."""
    n = settings.images_per_prompt
    scored = score_prompts(backbone, reward, everything, settings, seed, dist, autocast, images_per_prompt=n,
                           policy=policy, embed=embed)  # fmt: skip
    if dist.is_main:
        save_eval_grid(scored, everything, grid)
    return summarize(scored, everything)
