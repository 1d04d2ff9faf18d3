"""What a reward needs from the rest of its recipe, checked when the recipe is validated, before anything loads.

A reward that cannot get what it needs does not always fail loudly at its first call: GenEval's scorer given
prompts without GenEval metadata asks nothing of an image and scores every one 0, a run with nothing to learn; an
image reward given a video backbone's clips returns a score per frame, and fails at the first evaluation. So each
side declares what it has (``capability``, ``tpflow.interfaces.CAPABILITIES``) and the recipe check matches them:

* **metadata**: a reward that judges a sample against its prompt's metadata declares the keys it reads,
  ``needs_metadata`` (``geneval`` and ``shapes-geneval``: GenEval's ``tag`` and ``include``; ``shapes-video``:
  ``shape``, ``color``, ``count``, ``direction``), and a dataset the keys its items carry, ``metadata_keys``
  (``text-file``: none). A dataset that cannot give them is refused, naming the datasets that can. A dataset whose
  items only its files can tell (``jsonl``, a plugin that declares nothing) is checked item by item when it is
  built (``item_problems``: ``tpflow validate`` and ``tpflow train``, still before any weights load).
* **modality**: a video backbone (``samples_clips``) decodes clips [N, F, 3, H, W], any other images [N, 3, H, W];
  a reward declares what it scores, ``accepts_clips`` (default False) and ``accepts_images`` (default True). An
  image reward meets a video backbone wrapped in ``frames``; a clip-only reward needs a video backbone.

Both apply to the trained reward, to every watched reward (``[eval] rewards``, scored on the same samples), and to
the rewards a reward is made of (``reward_parts``: ``weighted``'s parts, ``frames``'s reward, which gets single
frames, ``pairwise``'s judge). ``[eval] diversity`` reads no metadata and embeds a clip by its middle frame
(``tpflow.train.diversity``), so it fits every dataset and backbone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from tpflow import registry
from tpflow.errors import UserError
from tpflow.interfaces import capability

DOCS = "docs/rewards.md, 'What a reward needs'"


class Used(NamedTuple):
    """One reward a recipe calls: where the recipe names it, its name and options, and what it is given."""

    where: str  # "[reward] (geneval)", "[eval] rewards[0] ('pickscore')", "[reward] (weighted) rewards[1] ('x')"
    name: str
    options: dict[str, Any]
    clips: bool  # it gets the backbone's clips (False: images, or single frames inside ``frames``)
    top: str  # how its own section is written: "reward", "watched" or "part"
    framed: bool = False  # it gets single frames of the clips (``frames``'s reward)


def used_rewards(sections: dict[str, Any]) -> list[Used]:
    """The trained reward, the watched ones and, depth first, the rewards each is made of."""
    clips = _samples_clips(sections)
    out: list[Used] = []
    spec = sections.get("reward")
    if spec is not None:
        written = spec.options.model_dump(exclude_unset=True)  # the options as the recipe gives them
        out += _walk(Used(f"[reward] ({spec.name})", spec.name, written, clips, "reward"))
    evaluation = sections.get("eval")
    for i, watched in enumerate(getattr(evaluation, "rewards", None) or []):
        out += _walk(Used(f"[eval] rewards[{i}] ({watched.name!r})", watched.name, watched.options, clips, "watched"))
    return out


def _walk(use: Used) -> Iterator[Used]:
    yield use
    parts = capability(registry.get("reward", use.name).factory, "reward_parts")
    if parts is None:
        return
    for where, name, options, on_frames in parts(registry.validate_options("reward", use.name, use.options)):
        where = f"{use.where} {where} ({name!r})"
        yield from _walk(Used(where, name, options, use.clips and not on_frames, "part", use.framed or on_frames))


def _samples_clips(sections: dict[str, Any]) -> bool:
    spec = sections.get("backbone")
    return spec is not None and bool(capability(registry.get("backbone", spec.name).factory, "samples_clips"))


def recipe_problems(sections: dict[str, Any]) -> list[str]:
    """One paragraph per reward (trained, watched, or a part of one) that its recipe's backbone or dataset cannot
    serve (module docstring). Rewards whose names or options the registry refuses are left to its own check."""
    try:
        used = used_rewards(sections)
    except (UserError, ValidationError):  # an unknown reward or bad options: the checks that own them report it
        return []
    problems = [p for use in used if (p := modality_problem(use, sections)) is not None]
    return problems + [p for use in used if (p := metadata_problem(use, sections)) is not None]


# ------------------------------------------------------------------------------------------------- modality


def modality_problem(use: Used, sections: dict[str, Any]) -> str | None:
    """Why ``use`` cannot score what it is given (clips from a video backbone, or images), or None."""
    factory = registry.get("reward", use.name).factory
    if use.clips and not capability(factory, "accepts_clips"):
        return _wrap_in_frames(use, sections["backbone"].name)
    if use.clips or capability(factory, "accepts_images"):
        return None
    if use.framed and _samples_clips(sections):
        given, fix = "'frames' gives it single frames [N·f, 3, H, W]", "name it itself, not inside 'frames'"
    else:
        video = [e.name for e in registry.entries("backbone") if capability(e.factory, "samples_clips")]
        given = f"the [backbone] ({sections['backbone'].name}) samples images [N, 3, H, W]"
        fix = f"train a video backbone ({', '.join(video)}) or choose an image reward"
    return f"{use.where} scores clips [N, F, 3, H, W] (it compares frames), and {given}: {fix} ({DOCS})."


def _wrap_in_frames(use: Used, backbone: str) -> str:
    """The fix for an image reward given clips: the same reward wrapped in ``frames`` (its own section, or an
    inline table in place of the watched reward or the part)."""
    which = 'which frames: frames = "all" | "every" | "first" | "middle" | "last" | "ends"; aggregate = "mean" | "min"'
    head = f"The [backbone] ({backbone}) samples clips [N, F, 3, H, W], and {use.where} scores images"
    if use.top == "reward":
        return (
            f'{head}: wrap it, [reward] name = "frames", reward = "{use.name}", options = {inline(use.options)} '
            f"({which}; {DOCS})."
        )
    frames = {"reward": use.name, "options": use.options}
    return f'{head}: wrap it, {{ name = "frames", options = {inline(frames)} }} in its place ({which}; {DOCS}).'


def inline(value: Any) -> str:
    """A value as TOML writes it inline: ``{ model = "ViT-L-14", every = 4 }``, ``{}``."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {inline(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(inline(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------------------- metadata


def needed_keys(use: Used) -> tuple[str, ...]:
    """The metadata keys ``use`` itself reads (its parts are listed apart by ``used_rewards``)."""
    return tuple(capability(registry.get("reward", use.name).factory, "needs_metadata"))


def metadata_problem(use: Used, sections: dict[str, Any]) -> str | None:
    """Why the recipe's dataset cannot give ``use`` the metadata it reads, or None (also when only the dataset's
    files can tell: ``item_problems`` checks those)."""
    needs, spec = needed_keys(use), sections.get("dataset")
    if not needs or spec is None:
        return None
    carried = capability(registry.get("dataset", spec.name).factory, "metadata_keys")
    if carried is None:
        return None
    missing = [key for key in needs if key not in carried]
    if not missing:
        return None
    has = f"its items carry {_keys(carried)}" if carried else "its prompts carry no metadata"
    return (
        f"{use.where} judges each sample against its prompt's metadata, which must hold {_keys(needs)}, and "
        f"[dataset] ({spec.name}) cannot give {_keys(missing)}: {has}, so the reward has nothing to judge a sample "
        f"against (GenEval's scorer would ask nothing: a reward of 0 for every image). Use a dataset that "
        f"carries them: "
        f"{datasets_with(needs)} ({DOCS})."
    )


def datasets_with(needs: Sequence[str]) -> str:
    """The registered datasets whose items carry every key of ``needs``, then those only their files can tell."""
    known, open_ = [], []
    for entry in registry.entries("dataset"):
        carried = capability(entry.factory, "metadata_keys")
        if carried is None:
            open_.append(entry.name)
        elif all(key in carried for key in needs):
            known.append(entry.name)
    files = f"{' or '.join(open_)} whose every item holds {_keys(needs)}" if open_ else ""
    return ", ".join([*known, files] if files else known) or "none is registered"


def _keys(keys: Sequence[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)


def item_problems(sections: dict[str, Any], split: str, items: Sequence[Any]) -> list[str]:
    """For a built dataset's split: one sentence per reward whose metadata keys an item lacks, naming the first
    such item (a ``jsonl`` file, a plugin dataset: what ``metadata_problem`` cannot know from the recipe)."""
    try:
        used = used_rewards(sections)
    except (UserError, ValidationError):  # refused by the recipe's own checks
        return []
    problems = []
    for use in used:
        needs = needed_keys(use)
        for n, item in enumerate(items if needs else (), 1):
            metadata = getattr(item, "metadata", None) or {}
            missing = [key for key in needs if key not in metadata]
            if missing:
                problems.append(
                    f"{use.where} judges each sample against its prompt's metadata, which must hold {_keys(needs)}, "
                    f"and item {n} of the {split} split ({str(getattr(item, 'prompt', ''))[:60]!r}) has no "
                    f"{_keys(missing)}. Every item must carry them: use {datasets_with(needs)} ({DOCS})."
                )
                break
    return problems
