"""Whether the recipe's prompts carry as many source images as its backbone takes, checked before the backbone is
built: ``tpflow validate`` and the start of ``tpflow train``.

An editing backbone declares ``source_images = (fewest, most)`` per prompt (``tpflow.interfaces.CAPABILITIES``; a
text-to-image backbone (0, 0)). Given an instruction without its source it would edit nothing, and a text-only
backbone given sources would drop them without a word; both are refused in one paragraph
(``tpflow.sources.source_count_problem``). Two checks share that sentence:

* ``recipe_problems``, one of the recipe's section checks (``tpflow.recipe.SECTION_CHECKS``): a dataset that declares
  its metadata keys (``metadata_keys``: ``text-file``, ``geneval``, ``shapes``...) carries sources only when it
  lists ``sources``, so an editing backbone with such a dataset, or a text-only one with a dataset that lists them,
  is refused from the recipe alone (``--no-machine`` too);
* ``item_problems``, when the dataset is built (``tpflow.preflight``): the sources each item carries (``edit-jsonl``,
  ``jsonl``, a plugin dataset), naming the first item out of bounds.

``command_sources`` checks the same against the ``--image`` options of ``tpflow sample`` and
``tpflow inspect-trajectory``, the sources of the prompts a user types.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tpflow import registry
from tpflow.errors import UserError
from tpflow.interfaces import capability
from tpflow.sources import SOURCES, references, source_count_problem


def _bounds(sections: dict[str, Any]) -> tuple[int, int] | None:
    """The recipe's backbone's (fewest, most) sources per prompt, or None when the recipe names no known backbone
    (the registry's own check reports that)."""
    spec = sections.get("backbone")
    try:
        factory = None if spec is None else registry.get("backbone", spec.name).factory
    except UserError:
        return None
    return None if factory is None else tuple(capability(factory, "source_images"))


def recipe_problems(sections: dict[str, Any]) -> list[str]:
    """A paragraph when the dataset's declared metadata already says its prompts carry no sources for an editing
    backbone, or sources for a text-only one; empty when only its items can tell (``item_problems``)."""
    bounds, spec = _bounds(sections), sections.get("dataset")
    if bounds is None or spec is None:
        return []
    try:
        keys = capability(registry.get("dataset", spec.name).factory, "metadata_keys")
    except UserError:
        return []
    if keys is None or (SOURCES in keys and bounds[1] > 0):  # the items tell how many (item_problems)
        return []
    problem = source_count_problem([1 if SOURCES in keys else 0], bounds, sections["backbone"].name)
    return [f"[dataset] ({spec.name}): {problem}"] if problem else []


def item_problems(sections: dict[str, Any], split: str, items: Sequence[Any]) -> list[str]:
    """For a built dataset's split: a paragraph when an item carries fewer or more sources than the backbone takes,
    naming the first such item."""
    bounds = _bounds(sections)
    if bounds is None:
        return []
    counts = [len(references(getattr(item, "metadata", None) or {})) for item in items]
    problem = source_count_problem(counts, bounds, sections["backbone"].name)
    if problem is None:
        return []
    n = next(n for n, count in enumerate(counts) if not bounds[0] <= count <= bounds[1])
    prompt = str(getattr(items[n], "prompt", ""))[:60]
    return [f"{problem} The first is item {n + 1} of the {split} split ({prompt!r}: {counts[n]} source(s))."]


def command_sources(backbone: str, images: Sequence[str | Path] | None, option: str = "--image") -> list[str]:
    """The source references a command's ``--image`` options give one prompt (absolute paths), checked against the
    recipe's backbone and read by their headers, before anything loads: one paragraph when a text-only backbone is
    given sources, an editing backbone none (or too many), or a file is no usable image."""
    from tpflow.data.edit_jsonl import image_problem

    fewest, most = tuple(capability(registry.get("backbone", backbone).factory, "source_images"))
    refs = [str(Path(image).expanduser().absolute()) for image in images or ()]
    if refs and most == 0:
        raise UserError(
            f"{option} gives a source image, and the recipe's backbone {backbone!r} generates from text alone: it "
            f"takes no source image. Drop {option}, or use a recipe whose backbone edits images (one that declares "
            "source_images, docs/backbones.md)."
        )
    if not fewest <= len(refs) <= most:
        given = f"{len(refs)} ({option} {' '.join(refs)})" if refs else f"none (no {option})"
        raise UserError(
            f"The recipe's backbone {backbone!r} edits images: it takes {fewest} to {most} source image(s) per "
            f"prompt, and the command gives {given}. Give the image to edit with {option} PATH (repeat it for "
            "several sources)."
        )
    for ref in refs:
        problem = image_problem(Path(ref), 1)
        if problem:
            raise UserError(f"{option}: {problem[0].upper()}{problem[1:]}.")
    return refs
