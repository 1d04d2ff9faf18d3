"""Starting a shapes-world model from the shipped image model: what the video and editing models share.

Both keep every layer of ``ShapesDiT`` and add their own (the video model's temporal blocks, the editing model's
source terms), so both start the same way: the sizes checked to match, every shared tensor copied (the word
embeddings, text positions and null text row by row, since their vocabularies begin with the image one and their
prompt lengths may differ), their own parameters left as built. ``start_from`` is the pretraining commands' ``--init``
on top of that: nothing, the shipped image model, an image checkpoint, or a checkpoint of the model itself to continue.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tpflow.errors import UserError
from tpflow.shapes.model import ShapesDiT, read_config

SHIPPED_IMAGE = Path(__file__).parent / "weights" / "shapes_dit.safetensors"
SIZES = ("width", "depth", "heads", "patch_size", "image_size", "channels", "text_layers", "mlp_ratio")
ROWS = ("word_embed.weight", "text_pos", "null_text")  # copied row by row: shared words / positions


@torch.no_grad()
def copy_image_layers(model: torch.nn.Module, image: ShapesDiT, own: Callable[[str], bool], kind: str) -> None:
    """Copy ``image``'s tensors into ``model`` in place, every one but those ``own(name)`` marks; UserError naming
    the first size that differs (``kind``: "video" or "editing")."""
    for name in SIZES:
        mine, theirs = getattr(model.config, name), getattr(image.config, name)
        if mine != theirs:
            raise UserError(
                f"The image model cannot start this {kind} model: its {name} is {theirs}, the {kind} model's {mine}. "
                "The start copies layers one to one, so every size must match."
            )
    source = image.state_dict()
    for name, target in model.state_dict().items():
        if own(name):
            continue
        if name in ROWS:
            rows = min(target.shape[0], source[name].shape[0])
            target[:rows] = source[name][:rows]
        else:
            target.copy_(source[name])


def start_from(model: torch.nn.Module, init: str | Path | None, inflate: Callable[[ShapesDiT], object],
               marker: str, kind: str, files: str) -> str:  # fmt: skip
    """Initialise ``model`` for pretraining from ``init``: None or "none" (as built), "image" (the shipped image
    model, through ``inflate``), a shapes-dit checkpoint (``inflate``) or one of ``model``'s own, told apart by
    ``marker`` in its config (continued). ``files`` names the checkpoints the error lists. Returns what it started
    from, for the run's stats."""
    from safetensors.torch import load_file

    from tpflow.shapes.model import ShapesDiTConfig

    if init is None or str(init) == "none":
        return "none"
    path = SHIPPED_IMAGE if str(init) == "image" else Path(init)
    if not path.is_file():
        raise UserError(
            f"--init {init}: no such file. Give 'image' (the shipped shapes-dit), 'none' (from scratch) or the path "
            f"of {files}."
        )
    config, state = read_config(path), load_file(str(path))
    if marker in config:  # the model's own checkpoint: continue from it
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise UserError(f"--init {path}: a {kind} model of another size ({err}).".splitlines()[0]) from None
        return f"continued {path.name}"
    image = ShapesDiT(ShapesDiTConfig.from_dict(config))
    image.load_state_dict(state)
    inflate(image)
    return f"inflated {path.name}"
