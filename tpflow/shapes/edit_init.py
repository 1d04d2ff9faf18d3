"""Start a ShapesEditDiT from the image model, as editing models start from their text-to-image base.

FLUX.1 Kontext is trained from FLUX.1's weights and Qwen-Image-Edit from Qwen-Image's: the editing model keeps every
layer of the generator and learns only to read the source. The shapes world does the same (``inflate``): every layer
the two models share is copied from the shipped ``shapes_dit.safetensors``, the editing words ("add", "remove",
"make", "move", "the", "to", "up", "down") start at the embedding's initialisation, and the source terms
(``source_pos``, ``source_embed``) at zero. With no source the editing model then computes exactly the image model's
velocity (``tests/test_shapes_edit.py``); with one it starts by drawing as the image model does, attending to
source tokens it has not learnt to use, and pretraining (``edit_pretrain``) teaches it to copy and change them.
"""

from __future__ import annotations

from pathlib import Path

from tpflow.shapes.edit_model import ShapesEditDiT
from tpflow.shapes.image_start import copy_image_layers, start_from
from tpflow.shapes.model import ShapesDiT

_OWN = ("source_pos", "source_embed")  # the editing model's own parameters


def inflate(edit: ShapesEditDiT, image: ShapesDiT) -> ShapesEditDiT:
    """Copy ``image``'s weights into ``edit`` in place (module docstring); returns ``edit``.

    The two must agree on every size but the vocabulary and the prompt length: the editing vocabulary begins with
    the image one (``edit_world.WORDS`` does) and the text positions cover the shorter of the two prompts.
    """
    copy_image_layers(edit, image, lambda name: name in _OWN, "editing")
    return edit


def start_model(edit: ShapesEditDiT, init: str | Path | None) -> str:
    """Initialise ``edit`` for pretraining from ``init``: None or "none" (as built), "image" (the shipped image
    model), or a path to a shapes-dit checkpoint (inflated) or a shapes-edit-dit one (continued: a resumed
    pretraining). Returns what it started from, for the run's stats."""
    files = "a shapes_dit.safetensors or shapes_edit_dit.safetensors written by tpflow shapes pretrain(-edit)"
    return start_from(edit, init, lambda image: inflate(edit, image), "sources", "editing", files)
