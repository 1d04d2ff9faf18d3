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

import torch

from tpflow.errors import UserError
from tpflow.shapes.edit_model import ShapesEditDiT
from tpflow.shapes.model import ShapesDiT, read_config

SHIPPED_IMAGE = Path(__file__).parent / "weights" / "shapes_dit.safetensors"
_OWN = ("source_pos", "source_embed")  # the editing model's own parameters
_ROWS = ("word_embed.weight", "text_pos", "null_text")  # copied row by row: shared words / positions


@torch.no_grad()
def inflate(edit: ShapesEditDiT, image: ShapesDiT) -> ShapesEditDiT:
    """Copy ``image``'s weights into ``edit`` in place (module docstring); returns ``edit``.

    The two must agree on every size but the vocabulary and the prompt length: the editing vocabulary begins with
    the image one (``edit_world.WORDS`` does) and the text positions cover the shorter of the two prompts.
    """
    ec, ic = edit.config, image.config
    for name in ("width", "depth", "heads", "patch_size", "image_size", "channels", "text_layers", "mlp_ratio"):
        if getattr(ec, name) != getattr(ic, name):
            raise UserError(
                f"The image model cannot start this editing model: its {name} is {getattr(ic, name)}, the editing "
                f"model's {getattr(ec, name)}. The start copies layers one to one, so every size must match."
            )
    source = image.state_dict()
    for name, target in edit.state_dict().items():
        if name in _OWN:
            continue
        if name in _ROWS:
            rows = min(target.shape[0], source[name].shape[0])
            target[:rows] = source[name][:rows]
        else:
            target.copy_(source[name])
    return edit


def start_model(edit: ShapesEditDiT, init: str | Path | None) -> str:
    """Initialise ``edit`` for pretraining from ``init``: None or "none" (as built), "image" (the shipped image
    model), or a path to a shapes-dit checkpoint (inflated) or a shapes-edit-dit one (continued: a resumed
    pretraining). Returns what it started from, for the run's stats."""
    from safetensors.torch import load_file

    from tpflow.shapes.model import ShapesDiTConfig

    if init is None or str(init) == "none":
        return "none"
    path = SHIPPED_IMAGE if str(init) == "image" else Path(init)
    if not path.is_file():
        raise UserError(
            f"--init {init}: no such file. Give 'image' (the shipped shapes-dit), 'none' (from scratch) or the path "
            "of a shapes_dit.safetensors or shapes_edit_dit.safetensors written by tpflow shapes pretrain or "
            "pretrain-edit."
        )
    config, state = read_config(path), load_file(str(path))
    if "sources" in config:  # an editing checkpoint: continue from it
        try:
            edit.load_state_dict(state)
        except RuntimeError as err:
            raise UserError(f"--init {path}: an editing model of another size ({err}).".splitlines()[0]) from None
        return f"continued {path.name}"
    image = ShapesDiT(ShapesDiTConfig.from_dict(config))
    image.load_state_dict(state)
    inflate(edit, image)
    return f"inflated {path.name}"
