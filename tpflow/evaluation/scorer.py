"""What scores a model, so that a comparison never puts the figures of two reward functions in one row.

A comparison is of models, not of configurations: one reward scores each, on the same prompts, the same images per
prompt from the same noise, sampled with the same ODE steps, guidance and solver. ``tpflow eval RUN --baseline B``
therefore scores B exactly as RUN's own recipe scores RUN (``scored_as``), taking from B's recipe only what defines
its model: its ``[backbone]`` section, with B's adapter or weights. It refuses, before anything loads, a baseline
whose images would differ in kind (another backbone, whose eval settings are not the run's; another image size or
frame count). ``tpflow compare`` refuses an experiment whose arms' resolved recipes differ in what makes one of its
endpoints' metrics (``tpflow.experiments.spec.check_scorers``).

The pieces of a recipe that make a metric (``scoring``): the dataset section (its test split is the eval prompts),
``[eval]``'s num_steps, guidance, solver (grid, flow_shift), num_prompts, images_per_prompt and seed, the images'
size, and the reward that scores them: the trained ``[reward]`` for ``eval_reward`` and its details, the watched one
of that label for ``eval_watch_<label>``, ``eval.diversity``'s embedding for ``eval_diversity``. ``eval.batch_size``
and how often a run evaluates change no figure and are not compared.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from tpflow.errors import UserError
from tpflow.recipe import Recipe, resolved, validate_recipe
from tpflow.scoring.watched import DIVERSITY, PREFIX

EVAL_KEYS = ("num_steps", "guidance", "solver", "grid", "flow_shift", "num_prompts", "images_per_prompt", "seed")
IMAGE_KEYS = ("resolution", "width", "num_frames")  # a backbone without the option: "fixed" (its own size)
WATCHED = f"eval_{PREFIX}"

Difference = tuple[str, Any, Any]  # (section.key, one side's value, the other's)


def image_kind(recipe: Recipe, with_backbone: bool = True) -> dict[str, Any]:
    """What makes the images themselves what they are: the backbone (``with_backbone``) and their size."""
    options = recipe.backbone.options
    kind = {"backbone.name": recipe.backbone.name} if with_backbone else {}
    return kind | {f"backbone.{key}": getattr(options, key, "fixed") for key in IMAGE_KEYS}


def _flat(section: str, table: dict[str, Any]) -> dict[str, Any]:
    """``{"name": x, "score": y}`` of section ``reward`` -> ``{"reward.name": x, "reward.score": y}``."""
    return {f"{section}.{key}": value for key, value in table.items()}


def watched_label(recipe: Recipe, metric: str) -> str | None:
    """The label of the watched reward ``metric`` (``eval_watch_<label>`` or one of its figures) reads: the longest
    label of ``[eval] rewards`` it starts with, else what follows the prefix."""
    rest = metric.removeprefix(WATCHED)
    labels = [w.key for w in recipe.eval.rewards if rest == w.key or rest.startswith(f"{w.key}_")]
    return max(labels, key=len) if labels else rest


def scoring(recipe: Recipe, metric: str | None = None) -> dict[str, Any]:
    """Flat ``section.key -> value`` of what makes ``metric`` (an ``eval_*`` figure) for runs of ``recipe``; with no
    metric, what makes every figure of an evaluation (the trained reward, every watched one, the diversity)."""
    data = resolved(recipe)
    out = _flat("dataset", data["dataset"]) | {f"eval.{key}": data["eval"][key] for key in EVAL_KEYS}
    out |= image_kind(recipe, with_backbone=False)
    watched = {w.key: w.model_dump() for w in recipe.eval.rewards}
    if metric is None:  # the reward first: what a reader looks for
        watching = {"eval.rewards": data["eval"]["rewards"], "eval.diversity": recipe.eval.diversity}
        return _flat("reward", data["reward"]) | out | watching
    if metric.startswith(WATCHED):
        label = watched_label(recipe, metric)
        return out | {f"eval.rewards[{label}]": watched.get(label)}
    if metric.removeprefix("eval_").startswith(DIVERSITY):
        return out | {"eval.diversity": recipe.eval.diversity}
    return out | _flat("reward", data["reward"])


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[Difference]:
    """Every key whose value differs between two ``scoring`` / ``image_kind`` dicts, in first-seen order."""
    keys = list(dict.fromkeys([*mine, *theirs]))
    return [(key, mine.get(key), theirs.get(key)) for key in keys if mine.get(key) != theirs.get(key)]


def listed(diffs: list[Difference], mine: str, theirs: str) -> str:
    """``reward.name 'weighted' (run) vs 'shapes-geneval' (baseline); ...`` for a message."""
    return "; ".join(f"{key} {a!r} ({mine}) vs {b!r} ({theirs})" for key, a, b in diffs)


def scored_as(target: Any, baseline: Any) -> Any:
    """The baseline ``Target`` rebuilt to be scored as ``target`` is: ``target``'s recipe with the baseline's
    ``[backbone]`` section (its model; its adapter or weights stay the baseline's). A UserError naming every
    difference, before anything loads, when the two make images of different kinds."""
    kind = differences(image_kind(target.recipe), image_kind(baseline.recipe))
    if kind:
        raise UserError(
            f"--baseline {baseline.path} cannot be scored as {target.path} is: their images differ in kind ("
            f"{listed(kind, 'target', 'baseline')}). `tpflow eval` compares models by scoring both with the target's "
            "reward and eval settings, which belong to its backbone and image size; a baseline of another backbone "
            "or size is no pair to it. Evaluate each on its own (`tpflow eval TARGET`) and compare with care, or "
            "give a baseline of the same backbone and size (e.g. the recipe the run was trained from)."
        )
    data = copy.deepcopy(target.recipe.data)
    data["backbone"] = copy.deepcopy(baseline.recipe.data["backbone"])
    where = f"{target.path}'s recipe with the [backbone] of the baseline {baseline.path}"
    recipe = validate_recipe(data, where=where, path=target.recipe.path)
    return dataclasses.replace(baseline, recipe=recipe, scored_as=target.label)


def scoring_line(target: Any, baseline: Any, options: Any) -> str:
    """One line saying what scored both ``target`` and ``baseline`` (as resolved from the command line, before
    ``scored_as``), with ``options`` (``EvalOptions``) applied; what of the baseline's own recipe differs from the
    target's, and so is not used, is named."""
    from tpflow.train.evaluation import eval_seed

    recipe, own = target.recipe, baseline.recipe
    count = options.num_prompts or (recipe.eval.num_prompts if options.prompts == "test" else None)
    seed = eval_seed(recipe.train.seed, recipe.eval.seed) if options.seed is None else options.seed
    watched = [w.key for w in recipe.eval.rewards] + (["diversity"] if recipe.eval.diversity else [])
    model = "its base weights" if baseline.kind == "recipe" else f"the adapter of {baseline.label}"
    line = (
        f"target and baseline both scored by the target's reward {recipe.reward.name!r} "
        f"({'watching ' + ', '.join(watched) + '; ' if watched else ''}{options.prompts} prompts"
        f"{f', the first {count}' if count else ''}, {options.images_per_prompt or recipe.eval.images_per_prompt} "
        f"image(s) each, {options.steps or recipe.eval.num_steps} steps, guidance "
        f"{recipe.eval.guidance if options.guidance is None else options.guidance:g}, seed {seed}); the baseline "
        f"gives only its model ({own.backbone.name}, {model})"
    )
    unused = differences(scoring(recipe), scoring(own))
    if own.eval.seed == recipe.eval.seed and own.train.seed != recipe.train.seed and own.eval.seed is None:
        unused.append(("train.seed", recipe.train.seed, own.train.seed))  # the base of its eval seed
    if unused:
        return line + "; not used from its own recipe: " + ", ".join(f"{k} = {b!r}" for k, _, b in unused)
    return line
