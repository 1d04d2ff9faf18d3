"""Recipes: TOML files that name every component and its options, validated before anything loads.

A recipe has one section per component kind, ``name = "..."`` plus that component's options, and the
settings sections ``[rollout]``, ``[train]``, ``[eval]`` and ``[log]``::

    [backbone]
    name = "sd3.5-medium"
    [credit]
    name = "consistent"
    balanced = true
    [rollout]
    num_steps = 10

Each component section is validated by the component's own options model (``extra="forbid"``), so a misspelt
option fails at load time with the section, the field and the allowed fields. Command-line overrides
``--set section.key=value`` are applied before validation; the value is read as a TOML value when it parses as
one (``3e-4``, ``true``, ``[0, 9]``, ``"text"``) and as a bare string otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tpflow import registry
from tpflow.errors import RecipeError, UnknownComponentError
from tpflow.replay_settings import ReplaySettings, replay_problems
from tpflow.settings import SETTINGS, EvalSettings, LogSettings, RolloutSettings, TrainSettings, shard_problems
from tpflow.strict_types import boolean_problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Component sections a recipe may omit, and the component used then.
DEFAULT_COMPONENTS: dict[str, str] = {"sampler": "cps", "plan": "window", "credit": "consistent", "optimizer": "grpo"}
SECTIONS: tuple[str, ...] = (*registry.KINDS, *SETTINGS)


def _watched_problems(sections: dict[str, Any]) -> list[str]:
    from tpflow.scoring.watched import recipe_problems

    return recipe_problems(sections)


def _reward_need_problems(sections: dict[str, Any]) -> list[str]:
    from tpflow.rewards.needs import recipe_problems  # imports the rewards: at validation, not with this module

    return recipe_problems(sections)


def _source_count_problems(sections: dict[str, Any]) -> list[str]:
    from tpflow.data.source_counts import recipe_problems

    return recipe_problems(sections)


def _whole_group_problems(sections: dict[str, Any]) -> list[str]:
    from tpflow.scoring.groups import whole_group_problems

    return whole_group_problems(sections)


# The checks of a recipe that span sections, each supplied by the module that owns what it checks: the validator
# only collects their sentences (a component's own limits come from its ``check_recipe`` hook, ``_limits``).
SECTION_CHECKS: tuple[Callable[[dict[str, Any]], list[str]], ...] = (
    shard_problems,  # [train] shard = "fsdp" against the optimizer and the backbone (tpflow.settings)
    replay_problems,  # [replay] against the optimizer and the sharding (tpflow.replay_settings)
    _watched_problems,  # [eval] rewards: names the registry knows (tpflow.scoring.watched)
    _reward_need_problems,  # what each reward needs of the backbone and the dataset (tpflow.rewards.needs)
    _whole_group_problems,  # a reward that needs whole groups per call against [train]'s batching (tpflow.scoring)
    _source_count_problems,  # the prompts' source images against the backbone's (tpflow.data.source_counts)
)


@dataclass(frozen=True)
class ComponentSpec:
    """A validated component section: the registered name and its validated options."""

    kind: str
    name: str
    options: BaseModel

    def build(self) -> Any:
        """Build the component (this is where weights would load)."""
        return registry.get(self.kind, self.name).factory(self.options)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. ``data`` is the merged TOML (overrides applied), what checkpoints store."""

    components: dict[str, ComponentSpec]
    settings: dict[str, BaseModel]
    data: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    overrides: tuple[str, ...] = ()  # the ``--set`` overrides load_recipe applied to the file (what reproduces it)

    # Typed sections: recipe.rollout.num_steps is checked by the type checker, recipe.credit.name names the assigner.
    @property
    def rollout(self) -> RolloutSettings:
        return self.settings["rollout"]  # type: ignore[return-value]

    @property
    def train(self) -> TrainSettings:
        return self.settings["train"]  # type: ignore[return-value]

    @property
    def eval(self) -> EvalSettings:
        return self.settings["eval"]  # type: ignore[return-value]

    @property
    def log(self) -> LogSettings:
        return self.settings["log"]  # type: ignore[return-value]

    @property
    def replay(self) -> ReplaySettings:
        return self.settings["replay"]  # type: ignore[return-value]

    @property
    def backbone(self) -> ComponentSpec:
        return self.components["backbone"]

    @property
    def sampler(self) -> ComponentSpec:
        return self.components["sampler"]

    @property
    def plan(self) -> ComponentSpec:
        return self.components["plan"]

    @property
    def reward(self) -> ComponentSpec:
        return self.components["reward"]

    @property
    def credit(self) -> ComponentSpec:
        return self.components["credit"]

    @property
    def optimizer(self) -> ComponentSpec:
        return self.components["optimizer"]

    @property
    def dataset(self) -> ComponentSpec:
        return self.components["dataset"]

    def build(self, kind: str) -> Any:
        """Build the component of one section: ``recipe.build("credit")``."""
        return self.components[kind].build()

    def preflight(self) -> None:
        """Check the outside services the components need (the remote reward's server), before any weights load.

        Run by ``tpflow validate`` and ``tpflow train``; not part of validation, which also runs on the recipes
        stored in checkpoints (``tpflow export`` must work with the reward server gone). Raises UserError.
        """
        for spec in self.components.values():
            registry.preflight(spec.kind, spec.name, spec.options)


SHIPPED = (
    "Shipped recipes are in recipes/: the CPU ones at its top (recipes/shapes_tp.toml), the paper-scale ones in a "
    "folder per model family (recipes/sd35/, flux/, qwen_image/, wan/)."
)


def _not_found(path: Path) -> str:
    """The missing file's paragraph, naming the file of that name one folder down: a paper-scale recipe cited by its
    path before recipes/ filed them by model family (recipes/ocr_tp.toml, now recipes/sd35/ocr_tp.toml)."""
    near = sorted(str(folder / path.name) for folder in path.parent.glob("*") if (folder / path.name).is_file())
    moved = f" Did you mean {' or '.join(near)}?" if near else ""
    return f"Recipe file not found: {path}.{moved} {SHIPPED}"


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe file; raises RecipeError with one clear paragraph."""
    path = Path(path)
    if path.is_dir():
        # one level down too: recipes/ keeps its paper-scale recipes in a folder per model family
        inside = sorted(str(p) for pattern in ("*.toml", "*/*.toml") for p in path.glob(pattern))
        listed = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
        hint = f" Name one of the recipes in it: {listed}." if inside else f" {SHIPPED}"
        if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
            hint += " It looks like a run directory: tpflow eval, sample and export take those."
        raise RecipeError(f"{path} is a directory; tpflow validate and train take a recipe file (TOML).{hint}")
    if not path.is_file():
        raise RecipeError(_not_found(path))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path} is not valid TOML: {exc}.") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path} is not a UTF-8 text file: {exc}.") from None
    apply_overrides(data, overrides)
    return dataclasses.replace(validate_recipe(data, where=str(path), path=path), overrides=tuple(overrides))


def parse_value(text: str) -> Any:
    """A command-line value: TOML when it parses (numbers, booleans, arrays, quoted strings), else the raw text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``section.key=value`` (or ``section.key.sub=value``) overrides to the TOML data in place; a whole
    section given as an inline table, ``section={name = "nft", learning_rate = 3e-3}``, replaces that section (to
    swap a component, whose options differ, from the command line or an experiment's arm)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = [p.strip() for p in key.strip().split(".")]
        if sep and len(parts) == 1 and parts[0] in SECTIONS and isinstance(parse_value(value.strip()), dict):
            data[parts[0]] = parse_value(value.strip())
            continue
        if not sep or len(parts) < 2 or not all(parts):
            raise RecipeError(
                f"Bad override {item!r}: expected section.key=value, e.g. --set optimizer.learning_rate=1e-4 (or a "
                "whole section as an inline table: --set 'optimizer={name = \"nft\", learning_rate = 3e-3}')."
            )
        if parts[0] not in SECTIONS:
            raise RecipeError(f"Bad override {item!r}: unknown section {parts[0]!r}. {_sections_hint(parts[0])}")
        table = data
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise RecipeError(f"Bad override {item!r}: {part!r} is a value, not a section.")
        table[parts[-1]] = parse_value(value.strip())


def _sections_hint(name: str) -> str:
    close = difflib.get_close_matches(name, SECTIONS, n=1, cutoff=0.5)
    hint = f"Did you mean [{close[0]}]? " if close else ""
    return f"{hint}Recipe sections are: {', '.join(SECTIONS)}."


def validate_recipe(data: dict[str, Any], where: str = "recipe", path: Path | None = None) -> Recipe:
    """Validate TOML data section by section against the registered components; no weights are loaded."""
    unknown = [s for s in data if s not in SECTIONS]
    if unknown:
        raise RecipeError(f"{where}: unknown section [{unknown[0]}]. {_sections_hint(unknown[0])}")
    components = {kind: _component(data, kind, where) for kind in registry.KINDS}
    settings = {}
    for section, model in SETTINGS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise RecipeError(f"{where}: [{section}] must be a table of options, got {table!r}.")
        refuse_booleans(table, model, f"{where} [{section}]")
        try:
            settings[section] = model.model_validate(table)
        except ValidationError as exc:
            raise RecipeError(registry.describe_validation_error(exc, f"{where} [{section}]", model)) from None
    sections = {**components, **settings}  # what a check_recipe hook sees: every section of the recipe
    problems = [
        problem
        for spec in components.values()
        for problem in _limits(registry.get(spec.kind, spec.name).factory, spec.options, sections)
    ]
    problems += _device_names(components)
    problems += [problem for check in SECTION_CHECKS for problem in check(sections)]
    if problems:
        raise RecipeError(f"{where}: " + " ".join(problems))
    return Recipe(components=components, settings=settings, data=data, path=path)


def refuse_booleans(table: dict[str, Any], model: type[BaseModel], where: str) -> None:
    """A RecipeError for ``true`` / ``false`` given where a number is meant (tpflow.strict_types)."""
    problems = boolean_problems(table, model, where)
    if problems:
        raise RecipeError(" ".join(problems))


def _limits(factory: Any, options: BaseModel, settings: dict[str, BaseModel]) -> list[str]:
    """What a component says about the rest of the recipe: its optional ``check_recipe(options, settings)`` returns
    one sentence per limit the recipe breaks (e.g. cps's noise level in [0, 1]); checked before anything loads.
    ``settings`` maps every section to its validated model: ``[rollout]``, ``[train]``, ``[eval]``, ``[log]``, and
    each component's ``ComponentSpec`` (its name and options), e.g. ``settings["credit"].name``."""
    check = getattr(factory, "check_recipe", None)
    return list(check(options, settings)) if callable(check) else []


def _device_names(components: dict[str, ComponentSpec]) -> list[str]:
    """A sentence per ``device`` option torch cannot parse ("gpu0"); whether this machine has the device is checked
    by ``tpflow.preflight.check_machine``."""
    from tpflow.devices import device_name_problem, torch_device_fields

    problems = []
    for kind, spec in components.items():
        for name, value in torch_device_fields(spec.options):
            problem = device_name_problem(value) if isinstance(value, str) else None
            if problem:
                problems.append(f"[{kind}] {name}: {problem}")
    return problems


def _component(data: dict[str, Any], kind: str, where: str) -> ComponentSpec:
    table = data.get(kind)
    if table is None:
        if kind not in DEFAULT_COMPONENTS:
            raise RecipeError(
                f"{where}: missing section [{kind}]. Add it with name = one of: {', '.join(registry.names(kind))}."
            )
        table = {"name": DEFAULT_COMPONENTS[kind]}
    if not isinstance(table, dict):
        raise RecipeError(f'{where}: [{kind}] must be a table with name = "...", got {table!r}.')
    options = dict(table)
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise RecipeError(
            f'{where}: section [{kind}] needs name = "..." (a string), one of: {", ".join(registry.names(kind))}.'
        )
    try:
        entry = registry.get(kind, name)
    except UnknownComponentError as exc:
        raise RecipeError(f"{where} [{kind}]: {exc}") from None
    refuse_booleans(options, entry.options, f"{where} [{kind}] ({name})")
    try:
        validated = entry.options.model_validate(options)
    except ValidationError as exc:
        raise RecipeError(
            registry.describe_validation_error(exc, f"{where} [{kind}] ({name})", entry.options)
        ) from None
    return ComponentSpec(kind=kind, name=name, options=validated)


# Recipe fields a resumed run cannot change: the adapter in the checkpoint belongs to this model and this LoRA shape.
FIXED_ON_RESUME = (
    "backbone.name", "backbone.weights", "backbone.pretrained", "backbone.seed",
    "backbone.lora_rank", "backbone.lora_alpha", "backbone.lora_targets",
)  # fmt: skip


def recipe_changes(old: dict[str, Any], new: Recipe) -> list[tuple[str, Any, Any]]:
    """``(section.key, old value, new value)`` for every option that differs between a recipe's data (e.g. the one a
    checkpoint stored) and a validated recipe, defaults filled in on both sides, so an option written out with its
    default value is no change. An old recipe that no longer validates is compared as written."""
    try:
        flat_old = _flatten(resolved(validate_recipe(old, where="the checkpoint's recipe")))
        flat_new = _flatten(resolved(new))
    except RecipeError:
        flat_old, flat_new = _flatten(old), _flatten(new.data)
    keys = list(dict.fromkeys([*flat_old, *flat_new]))
    return [(k, flat_old.get(k), flat_new.get(k)) for k in keys if flat_old.get(k) != flat_new.get(k)]


def resolved(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """Every section with every option, defaults included: ``{"credit": {"name": ..., ...}, "train": {...}}``."""
    out = {kind: {"name": spec.name, **spec.options.model_dump()} for kind, spec in recipe.components.items()}
    out.update({section: model.model_dump() for section, model in recipe.settings.items()})
    return out


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out
