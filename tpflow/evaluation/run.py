"""``tpflow eval``: sample a target on a prompt set by ODE, score it, and report per category (and vs a baseline).

The sampling and scoring are the trainer's own (``tpflow.train.evaluation.score_prompts``), and every default is
the recipe's own ``[eval]`` (steps, guidance, batch size, prompts, images per prompt) and eval seed, so a plain
``tpflow eval RUN`` gives exactly the ``eval_reward`` training logged for the checkpoint's weights. The paper's
protocol (train at T = 10, evaluate at T = 40; docs/evaluation.md) is what the SD3.5 recipes' ``[eval]`` says.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpflow.distributed import Distributed
from tpflow.evaluation.paired import OVERALL, SEEDS_NOTE, paired_intervals
from tpflow.evaluation.prompt_sets import prompt_set
from tpflow.evaluation.targets import Target, load_model
from tpflow.grids import EVAL_TILE, Grid, Tile, captioned_grid, columns_for
from tpflow.preflight import prompt_warnings
from tpflow.scoring.call import recipe_policy
from tpflow.scoring.watched import with_watched
from tpflow.train.diversity import build_embedder
from tpflow.train.evaluation import (
    Scored,
    eval_seed,
    grid_tiles,
    no_test_split,
    save_eval_grid,
    score_prompts,
    summarize,
)
from tpflow.types import PromptItem

NO_DIVERSITY = (
    "the recipe's eval.diversity is not measured: one image per prompt has no siblings to differ from (pass "
    "--images-per-prompt 2 or more)."
)


@dataclass(frozen=True)
class EvalOptions:
    """What ``tpflow eval`` varies; None means the target recipe's own value (its ``[eval]`` / ``[train]``)."""

    prompts: str = "test"
    num_prompts: int | None = None  # None: eval.num_prompts for "test" (as training), else every prompt
    steps: int | None = None  # None: eval.num_steps (as training; the SD3.5 recipes' 40 is the paper's T)
    guidance: float | None = None  # None: eval.guidance
    images_per_prompt: int | None = None  # None: eval.images_per_prompt (as training)
    seed: int | None = None  # None: the trainer's eval seed, train.seed + 12345
    batch_size: int | None = None  # None: eval.batch_size
    ema: bool = True


@dataclass
class EvalResult:
    """One target's evaluation: its images' scores and the settings that made them."""

    target: Target
    items: list[PromptItem]
    scored: Scored
    settings: dict[str, Any]

    def categories(self) -> dict[str, dict[str, float]]:
        """Per prompt tag (or one "all" row): images, mean reward, mean of each detail; then ``overall``.

        Every figure of ``overall`` is a mean over the images, as training's ``eval_*`` figures (``overall.strict``
        is ``eval_strict``). For GenEval-style rewards (a ``strict`` detail, every prompt tagged) ``overall`` also
        holds ``strict_tags``, GenEval's score: the mean of the per-tag strict accuracies (``eval_strict_tags``)."""
        tags = [self.items[k].metadata.get("tag") or "all" for k in self.scored.prompt_index]
        rows: dict[str, list[int]] = defaultdict(list)
        for j, tag in enumerate(tags):
            rows[tag].append(j)
        table = {tag: self._mean(rows[tag]) for tag in sorted(rows)}
        overall = self._mean(list(range(len(tags))))
        if "strict" in self.scored.details and "all" not in rows:
            overall["strict_tags"] = sum(row["strict"] for row in table.values()) / len(table)
        table[OVERALL] = overall
        return table

    def _mean(self, rows: list[int]) -> dict[str, float]:
        out = {"images": float(len(rows)), "reward": sum(self.scored.scores[j] for j in rows) / len(rows)}
        for name, values in self.scored.details.items():
            out[name] = sum(values[j] for j in rows) / len(rows)
        return out

    def to_json(self, ema: bool) -> dict[str, Any]:
        return {
            **self.target.describe(ema),
            "settings": self.settings,
            "metrics": summarize(self.scored, self.items),  # the eval_* figures training logs
            "categories": self.categories(),
            "images": [
                {
                    "prompt": self.items[k].prompt,
                    "tag": self.items[k].metadata.get("tag"),
                    "score": self.scored.scores[j],
                    **{name: values[j] for name, values in self.scored.details.items()},
                }
                for j, k in enumerate(self.scored.prompt_index)
            ],
        }


def evaluate_target(
    target: Target,
    options: EvalOptions,
    dist: Distributed,
    autocast: Callable[[], AbstractContextManager],
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Build the target's model, sample ``options.images_per_prompt`` (default: the recipe's) images per prompt and
    score them."""
    recipe = target.recipe
    items, split = prompt_set(options.prompts, recipe)
    limit = options.num_prompts
    if limit is None and options.prompts == "test":
        limit = recipe.eval.num_prompts
    items = items[:limit] if limit else items
    settings = recipe.eval.model_copy(
        update={
            "num_steps": options.steps or recipe.eval.num_steps,
            "guidance": recipe.eval.guidance if options.guidance is None else options.guidance,
            "batch_size": options.batch_size or recipe.eval.batch_size,
            "images_per_prompt": options.images_per_prompt or recipe.eval.images_per_prompt,
        }
    )
    seed = eval_seed(recipe.train.seed, recipe.eval.seed) if options.seed is None else options.seed
    torch.manual_seed(recipe.train.seed)  # as the trainer: a freshly made adapter starts from the same values
    backbone = load_model(target, ema=options.ema)
    reward = with_watched(recipe.build("reward"), recipe.eval)  # and the rewards it watches, [eval] rewards
    policy = recipe_policy(recipe.train, settings)  # time limit, retries, non-finite scores: as in training
    spec = recipe.eval.diversity  # measured only where a prompt has several images (said in the warnings)
    embed = build_embedder(spec) if spec is not None and settings.images_per_prompt > 1 else None
    scored = score_prompts(
        backbone, reward, items, settings, seed, dist, autocast, settings.images_per_prompt, progress, policy, embed
    )
    described = {
        "prompts": options.prompts,
        "split": split,  # the dataset split sampled: "train" for --prompts test of a dataset without a test split
        "warnings": ([no_test_split(recipe.dataset.name)] if options.prompts == "test" and split != "test" else [])
        + prompt_warnings(recipe, [item.prompt for item in items])
        + ([NO_DIVERSITY] if spec is not None and embed is None else []),
        "num_prompts": len(items),
        "images_per_prompt": settings.images_per_prompt,
        "steps": settings.num_steps,
        "steps_from": "recipe" if options.steps is None else "option",  # the table's header says which
        "guidance": settings.guidance,
        "batch_size": settings.batch_size,
        "seed": seed,
        "reward": recipe.reward.name,
        "resolution": getattr(recipe.backbone.options, "resolution", None),
    }
    del backbone, reward
    return EvalResult(target, items, scored, described)


def difference(result: EvalResult, baseline: EvalResult) -> dict[str, dict[str, float]]:
    """Per category present in both: target minus baseline of every figure they share."""
    mine, theirs = result.categories(), baseline.categories()
    return {
        category: {
            key: mine[category][key] - theirs[category][key]
            for key in mine[category]
            if key != "images" and key in theirs[category]
        }  # fmt: skip
        for category in mine
        if category in theirs
    }


def comparison_grid(result: EvalResult, baseline: EvalResult, path: Path) -> Grid:
    """One image comparing the two: per prompt, the baseline's shown images, then the target's (same image rows).

    The columns are headed with the two targets' short names (``Target.short_name``: a run's folder and step, an
    adapter's folder, a recipe's stem); the tile map names both in full and gives each tile's ``source``
    ("baseline", or "trained" / "target" when the target is a recipe's base model)."""
    role = "target" if result.target.kind == "recipe" else "trained"  # each tile's source in the tile map
    name, base_name = result.target.short_name, baseline.target.short_name
    if name == base_name:  # e.g. two runs' folders of one name: the headers must tell them apart
        name, base_name = f"{role}: {name}", f"baseline: {base_name}"
    theirs = {t.info["index"]: t for t in grid_tiles(baseline.scored, baseline.items, "baseline")}
    mine = [t for t in grid_tiles(result.scored, result.items, role) if t.info["index"] in theirs]
    per_prompt: dict[int, list[Tile]] = defaultdict(list)
    for tile in mine:
        per_prompt[result.scored.prompt_index[tile.info["index"]]].append(tile)
    tiles = [t for group in per_prompt.values() for t in [*(theirs[m.info["index"]] for m in group), *group]]
    pair = 2 * max(len(group) for group in per_prompt.values())
    columns = columns_for(pair, len(tiles))
    headers = ([base_name] * (pair // 2) + [name] * (pair // 2)) * (columns // pair)
    about = {"shows": result.scored.grid_rule, "baseline": baseline.target.label, "target": result.target.label,
             "headers": {"baseline": base_name, "target": name}}  # fmt: skip
    return captioned_grid(tiles, columns, path, headers, group=pair, max_tile=EVAL_TILE, about=about)


def write_outputs(out: Path, result: EvalResult, baseline: EvalResult | None, ema: bool) -> list[Path]:
    """``eval.json`` (atomically), ``grid.png`` and, with a baseline, ``comparison.png`` in ``out`` (each grid with
    its tile map ``<name>.png.json``); returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"target": result.to_json(ema)}
    written = [save_eval_grid(result.scored, result.items, out / "grid.png").path]
    if baseline is not None:
        data["baseline"] = baseline.to_json(ema)
        data["difference"] = difference(result, baseline)
        data["difference_interval"] = {"over": "prompts, paired", "note": SEEDS_NOTE,
                                       "categories": paired_intervals(result, baseline)}  # fmt: skip
        written.append(comparison_grid(result, baseline, out / "comparison.png").path)
    path = out / "eval.json"
    tmp = path.with_name(f".eval.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return [path, *written]


def default_out(target: Target, options: EvalOptions) -> Path:
    """Where results go when ``--out`` is not given: in the run's eval/ folder; runs/eval/ for an exported adapter
    (its folder is what ``load_lora_weights`` reads: nothing else goes in it) and for a base model."""
    steps = options.steps or target.recipe.eval.num_steps
    tag = f"{options.prompts if '/' not in options.prompts else Path(options.prompts).stem}_T{steps}"
    if target.kind in ("run", "checkpoint"):
        return target.path / "eval" / f"step{target.step}_{tag}"
    if target.kind == "export":
        return Path("runs") / "eval" / f"{Path(target.path).resolve().name}_export_{tag}"
    return Path("runs") / "eval" / f"{target.path.stem}_base_{tag}"
