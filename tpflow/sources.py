"""Source images of an editing prompt: where they travel, how they load, how they enter a backbone and a group.

An editing prompt is an instruction plus one or more source images. The dataset puts the sources in the item's
metadata under ``SOURCES`` as a list of references (strings), so that they reach every reward with the rest of the
metadata (a remote reward server included: strings cross JSON) and every record of a run names them. A reference is
a file path (absolute: the dataset resolves it against its file) or ``scheme:spec`` for a registered scheme, which
renders the image from its spec without a file (the embedded editing world's scenes: ``shapes-scene:...``).

``load`` gives one source as [3, H, W] float32 in [0, 1] on the CPU, cached; a backbone resizes it to what its
pipeline feeds the model. ``encode_unique`` encodes the distinct (instruction, sources) pairs of a set of items
once, calling ``Backbone.encode(prompts, sources=...)`` only on a backbone whose capability ``source_images`` says
it takes sources, so a text-only backbone (and a plugin's) keeps its one-argument ``encode``. ``group_text`` is the
text a prompt group is keyed by: the instruction alone, or the instruction with its sources, so that one group is one
(instruction, source) pair's samples.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.interfaces import capability
from tpflow.types import Conditioning, PromptItem

SOURCES = "sources"
"""The metadata key of an item's source images: a list of references (file paths or ``scheme:spec``)."""

_SCHEMES: dict[str, Callable[[str], Tensor]] = {}
_LOCK = threading.Lock()


def register_scheme(scheme: str, render: Callable[[str], Tensor]) -> None:
    """References ``scheme:spec`` load as ``render(spec)``, [3, H, W] float32 in [0, 1] (idempotent per function)."""
    with _LOCK:
        if _SCHEMES.get(scheme, render) is not render:
            raise ValueError(f"Source scheme {scheme!r} is registered already.")
        _SCHEMES[scheme] = render


def references(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """The source references of an item's metadata (none for a text-to-image prompt)."""
    refs = metadata.get(SOURCES) or ()
    if isinstance(refs, str):
        return (refs,)
    return tuple(str(r) for r in refs)


def scheme_of(ref: str) -> str | None:
    """The registered scheme a reference names, or None for a file path (a Windows drive letter is not a scheme)."""
    head, sep, _ = ref.partition(":")
    return head if sep and len(head) > 1 and head in _SCHEMES else None


@functools.lru_cache(maxsize=512)
def load(ref: str) -> Tensor:
    """One source image, [3, H, W] float32 in [0, 1] on the CPU (RGB; a palette or alpha image is converted)."""
    scheme = scheme_of(ref)
    if scheme is not None:
        image = _SCHEMES[scheme](ref[len(scheme) + 1 :])
    else:
        image = read_image(Path(ref))
    return image.float().clamp(0, 1).contiguous()


def read_image(path: Path) -> Tensor:
    """[3, H, W] float32 in [0, 1] from an image file; UserError naming the file when it cannot be read."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()  # [H, W, 3]
    except FileNotFoundError:
        raise UserError(f"The source image {path} does not exist.") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise UserError(f"The source image {path} could not be read as an image ({type(exc).__name__}).") from None
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


def group_text(item: PromptItem) -> str:
    """The text a prompt group is keyed by: the instruction, and its sources when it has any (one group is one
    (instruction, source) pair's samples)."""
    refs = references(item.metadata)
    return item.prompt if not refs else f"{item.prompt} [sources: {' | '.join(refs)}]"


def takes_sources(backbone: Any) -> bool:
    """Whether the backbone (or its registered factory) conditions on source images (capability ``source_images``,
    (fewest, most) sources per prompt)."""
    return capability(backbone, "source_images")[1] > 0


def source_count_problem(counts: Sequence[int], bounds: tuple[int, int], backbone_name: str) -> str | None:
    """One paragraph when some item carries fewer or more sources than the backbone takes, else None."""
    fewest, most = bounds
    bad = sorted({c for c in counts if not fewest <= c <= most})
    if not bad:
        return None
    if most == 0:
        return (
            f"The backbone {backbone_name!r} generates from text alone, but the dataset's prompts carry source "
            f"images (metadata {SOURCES!r}). Pick an editing backbone, or a dataset without sources."
        )
    found = ", ".join(str(c) for c in bad)
    return (
        f"The backbone {backbone_name!r} takes {fewest} to {most} source image(s) per prompt, and some of the "
        f"dataset's prompts carry {found}: an editing backbone needs each instruction's source image(s) (metadata "
        f"{SOURCES!r}, from an editing dataset such as 'edit-jsonl')."
    )


def encode_unique(backbone: Any, items: Sequence[PromptItem]) -> tuple[Conditioning, dict[str, int]]:
    """The conditioning of the distinct (instruction, sources) pairs of ``items`` (sorted by ``group_text``), and the
    row of each pair's ``group_text``; the sources are loaded and passed only to a backbone that takes them."""
    by_key = {group_text(it): it for it in items}
    keys = sorted(by_key)
    prompts = [by_key[k].prompt for k in keys]
    if not takes_sources(backbone):
        return backbone.encode(prompts), {k: r for r, k in enumerate(keys)}
    sources = [[load(r) for r in references(by_key[k].metadata)] for k in keys]
    return backbone.encode(prompts, sources=sources), {k: r for r, k in enumerate(keys)}


def encode_rows(backbone: Any, items: Sequence[PromptItem]) -> Conditioning:
    """One conditioning row per item (repeats share one encoding)."""
    encoded, row = encode_unique(backbone, items)
    return encoded.index([row[group_text(it)] for it in items])
