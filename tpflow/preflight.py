"""What a recipe needs from this machine, checked before any weights load: ``tpflow validate`` and ``tpflow train``.

``tpflow.recipe.validate_recipe`` checks the recipe's *values* (types, ranges, the limits one component puts on
another section). ``check_machine`` checks what those values name on this machine:

* every ``device`` option exists here (``cuda`` on a machine without CUDA, ``cuda:3`` with one GPU);
* each component's own ``check_machine(options, settings)`` hook, when it has one: the files it names exist and are
  what they claim (the shapes-dit weights are a safetensors file, ...), a paper-scale backbone has a GPU (or
  ``device = "cpu"`` said explicitly);
* each component's ``weight_sources(options, settings)`` hook (``tpflow.weights``), when it has one: every weight it
  will load is on disk, a local path or an entry of the Hugging Face cache (looked up without the network); a missing
  one is a problem naming its download command;
* the prompt dataset builds (datasets load no weights): its files exist, are regular UTF-8 files that parse, and
  every split holds prompt strings;
* the run directory is usable: not an existing regular file, and its nearest existing parent is a writable directory.

Every problem found is one sentence; all of them make one ``RecipeError`` paragraph (exit status 2 in the CLI).
Otherwise a ``MachineReport`` says where each weight comes from, what the backbone's device resolved to, and warnings
(mixed precision on the CPU): ``tpflow validate`` prints it, and so do train, eval, sample and inspect-trajectory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tpflow import registry
from tpflow.errors import RecipeError, UserError
from tpflow.weights import WeightSource, component_weights

if TYPE_CHECKING:
    from tpflow.recipe import Recipe


# Tags whose per-tag figure eval_reward_<tag> would be another figure of the evaluation (tpflow.train.evaluation)
RESERVED_TAGS = {
    "tags": "eval_reward_tags is the mean over tags",
    "held_out": "eval_reward_held_out is the held-out prompts' mean",
    "seen": "eval_reward_seen is the other prompts' mean",
}


@dataclass
class MachineReport:
    """What ``check_machine`` found on a machine where the recipe can run: what to print before anything loads."""

    weights: list[tuple[str, WeightSource]] = field(default_factory=list)  # (section, source) of every weight
    device: str = ""  # the backbone's device as resolved here, and why, e.g. "cpu (device unset, no CUDA GPU)"
    warnings: list[str] = field(default_factory=list)  # sentences: runs, but not as the user may expect
    dataset: str = ""  # what reading the prompts checked, when the dataset says (its optional ``summary``)

    def lines(self) -> list[str]:
        """The report as printed when a command starts: the device, a line per weight, what the dataset checked,
        then the warnings."""
        out = [f"device: {self.device}"] if self.device else []
        out += [f"weights: [{kind}] {source.what}: {source.where}" for kind, source in self.weights]
        out += [f"dataset: {self.dataset}"] if self.dataset else []
        return out + [f"warning: {text}" for text in self.warnings]


def check_machine(recipe: Recipe, run_dir: Path | None = None, where: str | None = None) -> MachineReport:
    """Raise one RecipeError listing every problem of ``recipe`` on this machine; ``run_dir`` is checked when given.

    Loads no weights: the dataset is built (prompt files are read), every other component only inspected; a weight
    is looked for on disk and in the Hugging Face cache, never on the network. Returns what was found: where each
    weight comes from, the backbone's device, warnings.
    """
    where = where or (str(recipe.path) if recipe.path else "recipe")
    problems: list[str] = []
    report = MachineReport()
    for spec in recipe.components.values():
        found, weights = check_component(spec.kind, spec.name, spec.options, recipe.settings)
        problems += found
        report.weights += [(spec.kind, source) for source in weights]
    problems += dataset_problems(recipe, report)
    if run_dir is not None:
        problems += run_dir_problems(Path(run_dir))
    if problems:
        raise RecipeError(f"{where}: " + " ".join(problems))
    report.device, report.warnings = device_report(recipe)
    return report


def prompt_warnings(recipe: Recipe, prompts: list[str]) -> list[str]:
    """What the recipe's backbone would lose of these prompts, from its optional ``prompt_warnings(prompts)`` hook
    (the shapes world's closed vocabulary: unknown words become ``<unk>``); no weights load. One rule for every
    command that samples a user's prompts: ``tpflow sample``, ``inspect-trajectory``, ``tpflow eval``."""
    from tpflow import registry

    hook = getattr(registry.get("backbone", recipe.backbone.name).factory, "prompt_warnings", None)
    return list(hook(prompts)) if callable(hook) else []


def check_component(kind: str, name: str, options: BaseModel, settings: dict) -> tuple[list[str], list[WeightSource]]:
    """One component on this machine: its problems (a sentence each, prefixed by its section: a ``device`` option
    this machine lacks, its ``check_machine`` hook, a weight not on disk) and the weights it will read. What
    ``check_machine`` runs for every component of a recipe, and ``tpflow serve-reward`` for the reward it serves."""
    problems = [f"[{kind}] {problem}" for problem in device_problems(options)]
    factory = registry.get(kind, name).factory
    hook = getattr(factory, "check_machine", None)
    if callable(hook):
        try:
            problems += list(hook(options, settings))
        except UserError as exc:  # a hook may raise its one problem instead of returning it
            problems.append(f"[{kind}] {exc}")
    weights = []
    for source in component_weights(factory, options, settings):
        if source.problem:
            problems.append(f"[{kind}] {source.problem}")
        else:
            weights.append(source)
    return problems, weights


def device_report(recipe: Recipe) -> tuple[str, list[str]]:
    """The backbone's device as resolved here with why (an unset device falls back to the CPU silently otherwise),
    and warnings about it (none at present: train.mixed_precision is honoured on every device, tpflow.precision)."""
    from tpflow.devices import resolve_device

    asked = getattr(recipe.backbone.options, "device", None)
    device = resolve_device(asked)
    if asked in (None, "auto"):
        why = "a CUDA GPU is here" if device.type == "cuda" else "no CUDA GPU here"
        text = f"{device} (backbone device {'unset' if asked is None else repr(asked)}: {why})"
    else:
        text = f"{device} (backbone device = {asked!r})"
    return text, []


def device_problems(options: BaseModel) -> list[str]:
    """A sentence per ``device`` option of a component this machine cannot serve (``resolve_device``'s message)."""
    from tpflow.devices import resolve_device, torch_device_fields

    problems = []
    for name, value in torch_device_fields(options):
        if value is None or not isinstance(value, str):
            continue
        try:
            resolve_device(value)
        except UserError as exc:
            problems.append(f"{name}: {exc}")
    return problems


def dataset_problems(recipe: Recipe, report: MachineReport | None = None) -> list[str]:
    """Build the prompt dataset (no weights) and check that each split is a non-empty list of prompt strings whose
    metadata holds what the recipe's rewards read (``tpflow.rewards.needs.item_problems``) and the source images its
    backbone takes (``tpflow.data.source_counts.item_problems``). What the dataset says it checked (``summary``,
    e.g. edit-jsonl's lines and source images) goes into ``report``."""
    from tpflow.data.source_counts import item_problems as source_problems
    from tpflow.rewards.needs import item_problems

    try:
        dataset = recipe.build("dataset")
        summary = getattr(dataset, "summary", None)
        if report is not None and summary:
            report.dataset = f"[dataset] ({recipe.dataset.name}) {summary}"
        for split in getattr(dataset, "splits", ("train",)):
            items = list(dataset.split(split))
            if not items:
                return [f"[dataset] ({recipe.dataset.name}): the {split} split holds no prompts."]
            bad = next((it for it in items if not isinstance(getattr(it, "prompt", None), str)), None)
            if bad is not None:
                return [f"[dataset] ({recipe.dataset.name}): a {split} prompt is not a string: {bad!r:.120}."]
            tags = {(getattr(it, "metadata", None) or {}).get("tag") for it in items}
            clash = sorted(tag for tag in tags if isinstance(tag, str) and tag in RESERVED_TAGS)
            if clash:
                return [
                    f"[dataset] ({recipe.dataset.name}): the {split} split has prompts tagged {clash[0]!r}, a name "
                    f"the evaluation's figures use: eval_reward_{clash[0]} would be both that tag's mean and "
                    f"another figure ({', '.join(RESERVED_TAGS[t] for t in clash)}). Rename the tag."
                ]
            sections = {**recipe.components, **recipe.settings}
            missing = item_problems(sections, split, items) + source_problems(sections, split, items)
            if missing:
                return [f"[dataset] ({recipe.dataset.name}): {' '.join(missing)}"]
    except UserError as exc:
        return [f"[dataset] ({recipe.dataset.name}): {exc}"]
    return []


def run_dir_problems(run_dir: Path) -> list[str]:
    """Why ``run_dir`` cannot hold a run (empty when it can), without creating anything."""
    run_dir = Path(run_dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        return [f"The run dir {run_dir} exists and is not a directory; pick another with --run-dir."]
    existing = run_dir
    while not existing.exists():  # the nearest existing parent: the run dir's parents are created from there
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return [f"The run dir {run_dir} cannot be created: {existing} is not a directory."]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"The run dir {run_dir} is not writable ({existing} denies writing); pick another with --run-dir."]
    return []


def default_run_dir(recipe: Recipe) -> Path:
    """``train.run_dir`` with ``{recipe}`` replaced by the recipe file's stem (``run`` without a file), as the
    trainer resolves it."""
    stem = recipe.path.stem if recipe.path else "run"
    return Path(recipe.train.run_dir.format(recipe=stem))
