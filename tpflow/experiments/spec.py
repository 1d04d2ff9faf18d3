"""The experiment file: a base recipe, shared overrides, named arms, seeds and the endpoints, validated up front.

    [experiment]
    name = "credit-on-shapes"
    recipe = "../recipes/shapes_flowgrpo.toml"   # relative to this file
    seeds = [0, 1, 2]

    [task]                                        # every run's overrides (nested tables or dotted keys)
    train.epochs = 2

    [arms.outcome]
    credit.name = "outcome"
    [arms.consistent]
    credit.name = "consistent"

    [primary]                                     # one endpoint: arm − baseline, paired over seeds
    arm = "consistent"
    baseline = "outcome"
    metric = "eval_reward"
    statistic = "auc"                             # "auc" over the evaluations, or "final"

    [secondary]                                   # one Holm family: each arm − the primary's baseline
    arms = []

Each arm's recipe is the base recipe with the task's overrides, then the arm's, then ``train.seed``; every one of
them is validated (as ``tpflow validate`` would) before anything runs, and a fault is one paragraph naming the arm.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tpflow.errors import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


Statistic = Literal["auc", "final", "at_baseline_seconds", "auc_seconds", "seconds_to_threshold",
                    "epochs_to_threshold"]  # fmt: skip
STATISTICS = (
    "auc: the trapezoid area under the evaluation curve over its epochs, divided by their span (the mean level over "
    "training); final: the last evaluation; at_baseline_seconds: the arm's curve at the training seconds the "
    "baseline's run took, against the baseline's final value (equal compute); auc_seconds: the area under the curve "
    "against training seconds over the baseline's training seconds, divided by them, for the arm and the baseline "
    "alike (the mean level over equal compute: what an arm that learns faster per second gains); "
    "seconds_to_threshold: the training seconds at which the curve first reaches the endpoint's threshold (linear "
    "between evaluations; a run that never does counts its total training seconds, a lower bound), compared as "
    "ln(baseline's / arm's): the log speed-up; epochs_to_threshold: the same in epochs."
)
THRESHOLD_STATISTICS = ("seconds_to_threshold", "epochs_to_threshold")


class ExperimentSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The experiment's name (its runs' folder under runs/experiments/).")
    recipe: str = Field(min_length=1, description="The base recipe, relative to the experiment file.")
    seeds: list[int] = Field(min_length=2, description="train.seed of each run; every arm runs every seed (paired).")
    out: str | None = Field(None, description="Where the runs go (default runs/experiments/<name>, from the cwd).")
    summaries: str | None = Field(
        None,
        description="A JSON of committed run summaries to compare instead of run folders (relative to this file; "
        "docs/results/evidence_runs.json's format); such an experiment is not swept.",
    )
    summaries_group: str = Field("sweep", description="The key of the summaries JSON that holds the runs.")

    @model_validator(mode="after")
    def _distinct(self) -> ExperimentSection:
        if len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct and >= 0, got {self.seeds}.")
        return self


class Endpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arm: str
    baseline: str
    metric: str = Field("eval_reward", description="A metric of the runs' metrics.jsonl evaluation lines.")
    statistic: Statistic = Field("auc", description=STATISTICS)
    threshold: float | None = Field(
        None, description="The level a *_to_threshold statistic times (fixed in advance); only with those."
    )

    @model_validator(mode="after")
    def _threshold(self) -> Endpoint:
        timed = self.statistic in THRESHOLD_STATISTICS
        if timed != (self.threshold is not None):
            raise ValueError(
                f"statistic = {self.statistic!r} "
                + ("times when the curve reaches a level: set threshold (fixed in advance)." if timed
                   else "reads no threshold: drop threshold, or use seconds_to_threshold / epochs_to_threshold.")
            )  # fmt: skip
        return self


class SecondaryEndpoint(Endpoint):
    arm: str = ""  # unused: a secondary endpoint belongs to every secondary arm
    baseline: str = ""


class Secondary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(default_factory=list, description="Arms compared with the primary's baseline.")
    baselines: list[str] = Field(
        default_factory=list,
        description="Further baselines each secondary arm (but itself) is compared with, in the same Holm family.",
    )
    endpoints: list[SecondaryEndpoint] = Field(
        default_factory=list,
        description="The endpoints of each secondary arm (default: the primary's); the family is every (arm, "
        "endpoint) but the primary, Holm-adjusted together.",
    )


class ExperimentFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    experiment: ExperimentSection
    task: dict[str, Any] = Field(default_factory=dict)
    arms: dict[str, dict[str, Any]] = Field(min_length=2)
    primary: Endpoint
    secondary: Secondary = Field(default_factory=Secondary)

    @model_validator(mode="after")
    def _arms_named(self) -> ExperimentFile:
        names = set(self.arms)
        for where, arm in (
            [("primary.arm", self.primary.arm), ("primary.baseline", self.primary.baseline)]
            + [(f"secondary.arms[{i}]", a) for i, a in enumerate(self.secondary.arms)]
            + [(f"secondary.baselines[{i}]", a) for i, a in enumerate(self.secondary.baselines)]
        ):
            if arm not in names:
                raise ValueError(f"{where} = {arm!r} is not an arm; the arms are: {', '.join(sorted(names))}.")
        for name, table in self.arms.items():
            replaced = table.get("replace", [])
            if not isinstance(replaced, list) or not all(isinstance(table.get(r), dict) for r in replaced):
                raise ValueError(
                    f"arms.{name}.replace = {replaced!r}: list the sections this arm replaces whole, each given as "
                    f'a table of the arm (e.g. replace = ["optimizer"] with [arms.{name}.optimizer]).'
                )
        if self.primary.arm == self.primary.baseline:
            raise ValueError("primary.arm and primary.baseline are the same arm: the endpoint is their difference.")
        return self


@dataclass(frozen=True)
class Run:
    """One (arm, seed) run of an experiment."""

    arm: str
    seed: int
    overrides: tuple[str, ...]  # ``--set key=value`` of the base recipe: the task's, the arm's, the seed
    run_dir: Path


@dataclass(frozen=True)
class Experiment:
    """A validated experiment file."""

    path: Path
    spec: ExperimentFile
    recipe: Path  # the base recipe, resolved
    out: Path  # the folder of its runs

    def runs(self) -> list[Run]:
        """Every (arm, seed), seed-major (a slow-down during the sweep hits every arm of a seed alike)."""
        out = []
        for seed in self.spec.experiment.seeds:
            for arm, table in self.spec.arms.items():
                overrides = [*_sets(self.spec.task), *_arm_sets(table), f"train.seed={seed}"]
                out.append(Run(arm, seed, tuple(overrides), self.out / arm / f"seed_{seed}"))
        return out


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 2}}`` and ``{"train.epochs": 2}`` -> ``{"train.epochs": 2}``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _sets(table: dict[str, Any]) -> list[str]:
    """A table of overrides as ``--set`` strings; values written as JSON, which TOML reads the same for strings,
    numbers, booleans and arrays, but tables inside a value (``eval.rewards = [{ name = "x" }]``) as TOML's inline
    tables, which JSON's objects are not."""
    return [f"{key}={_toml(value)}" for key, value in flatten(table).items()]


def _arm_sets(table: dict[str, Any]) -> list[str]:
    """An arm's overrides: each section it names in ``replace`` (e.g. ``replace = ["optimizer"]`` with an
    ``[arms.X.optimizer]`` table) as one whole-section override that replaces the base recipe's section, then the
    rest key by key (``_sets``)."""
    replaced = list(table.get("replace", []))
    whole = [f"{section}={_toml(table[section])}" for section in replaced]
    rest = {k: v for k, v in table.items() if k != "replace" and k not in replaced}
    return [*whole, *_sets(rest)]


def _toml(value: Any) -> str:
    """``value`` as a TOML value: inline tables and arrays of them spelled out, anything else as JSON."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def is_experiment_file(path: Path) -> bool:
    """Whether a TOML file is an experiment (it has an ``[experiment]`` table) rather than a recipe."""
    try:
        return "experiment" in tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def load_experiment(path: Path, check_arms: bool = True) -> Experiment:
    """Read and validate an experiment file and, with ``check_arms``, every (arm, seed) recipe; RecipeError (one
    paragraph, exit 2) otherwise."""
    from tpflow import registry
    from tpflow.recipe import load_recipe

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"Experiment file {path} not found.") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path} is not valid TOML: {exc}.") from None
    try:
        spec = ExperimentFile.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(registry.describe_validation_error(exc, str(path), ExperimentFile)) from None
    recipe = (path.parent / spec.experiment.recipe).resolve()
    if not recipe.is_file():
        raise RecipeError(f"{path}: [experiment] recipe = {spec.experiment.recipe!r} is not a file ({recipe}).")
    out = Path(spec.experiment.out) if spec.experiment.out else Path("runs") / "experiments" / spec.experiment.name
    experiment = Experiment(path, spec, recipe, out)
    if check_arms:
        for run in experiment.runs():
            try:
                load_recipe(recipe, list(run.overrides))
            except RecipeError as exc:
                raise RecipeError(f"{path}: arm {run.arm!r} (seed {run.seed}): {exc}") from None
        check_scorers(experiment)  # before a sweep spends hours on runs no endpoint could compare
    return experiment


def arm_recipes(experiment: Experiment) -> dict[str, Any]:
    """Each arm's resolved recipe (at the first seed: a seed changes train.seed only, the same in every arm of a
    pair), every ``replace``d section and override applied; RecipeError naming the arm otherwise."""
    from tpflow.recipe import load_recipe

    recipes: dict[str, Any] = {}
    for run in experiment.runs():
        if run.arm not in recipes:
            try:
                recipes[run.arm] = load_recipe(experiment.recipe, list(run.overrides))
            except RecipeError as exc:
                raise RecipeError(f"{experiment.path}: arm {run.arm!r}: {exc}") from None
    return recipes


def check_scorers(experiment: Experiment) -> dict[str, str]:
    """Refuse, in one paragraph naming every difference, an experiment whose arms differ in what makes one of its
    endpoints' metrics (the reward that scores it, the eval prompts, images, noise, steps, guidance, image size:
    ``tpflow.evaluation.scorer.scoring``): their figures would not be one measure. Returns the hacking guard's
    figures (the trained reward, each watched one, the diversity) that are per-arm by design, each with what
    differs: ``tpflow compare`` says so and does not difference them across arms."""
    from tpflow.evaluation.scorer import WATCHED, differences, listed, scoring

    recipes, spec = arm_recipes(experiment), experiment.spec
    base = spec.primary.baseline

    def unlike(metric: str) -> list[str]:
        mine = scoring(recipes[base], metric)
        return [f"arm {arm!r}: {listed(found, base, arm)}" for arm, recipe in recipes.items()
                if (found := differences(mine, scoring(recipe, metric)))]  # fmt: skip

    metrics = dict.fromkeys(e.metric for e in [spec.primary, *spec.secondary.endpoints])
    faults = [f"{metric} ({'; '.join(found)})" for metric in metrics if (found := unlike(metric))]
    if faults:
        raise RecipeError(
            f"{experiment.path}: the arms are not scored alike, so an endpoint would compare figures of different "
            f"measures: {'; '.join(faults)}. An experiment compares what its arms train, every arm scored by one "
            "reward on one eval set: set the reward and [eval] in [task]. Arms that train on different rewards by "
            'design are compared on a reward they share: add it to [task] as eval.rewards = [{name = "...", '
            "label = \"x\"}] and make the endpoint's metric eval_watch_x (eval_reward is then each arm's own)."
        )
    guard = ["eval_reward", *dict.fromkeys(f"{WATCHED}{w.key}" for r in recipes.values() for w in r.eval.rewards)]
    guard += ["eval_diversity"] if any(r.eval.diversity for r in recipes.values()) else []
    return {metric: "; ".join(found) for metric in guard if (found := unlike(metric))}
