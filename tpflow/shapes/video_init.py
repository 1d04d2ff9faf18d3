"""Start a ShapesVideoDiT from the image model: inflation, as video diffusion models start from image ones.

A video model that learns to draw the objects and to move them at once needs far more steps than 2 CPU cores give
in an hour (a from-scratch run of 60 minutes drew blocks of the right colour, no shapes). The image shapes-dit
already draws them from the same words, so the video model starts from it (``inflate``), in the way video models
are initialised from image models (Singer et al., Make-A-Video, arXiv 2209.14792; Blattmann et al., Align your
Latents, arXiv 2304.08818): every layer the two share is copied (the video model's spatial layers are the image
model's, run on each frame), the temporal blocks keep their identity initialisation, and the motion words
("moving", "up", "down") start at the embedding's initialisation. At the start the video model therefore draws every
frame as the image model would, each from its own noise; pretraining then learns to make the frames one motion.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpflow.errors import UserError
from tpflow.shapes.model import ShapesDiT, read_config
from tpflow.shapes.video_model import ShapesVideoDiT

SHIPPED_IMAGE = Path(__file__).parent / "weights" / "shapes_dit.safetensors"


@torch.no_grad()
def inflate(video: ShapesVideoDiT, image: ShapesDiT) -> ShapesVideoDiT:
    """Copy ``image``'s weights into ``video`` in place (module docstring); returns ``video``.

    The two must agree on width, depth, heads, patch size, image size and channels; the video vocabulary must begin
    with the image one (``video_world.WORDS`` does) and the text positions cover the shorter of the two prompts.
    """
    vc, ic = video.config, image.config
    for name in ("width", "depth", "heads", "patch_size", "image_size", "channels", "text_layers", "mlp_ratio"):
        if getattr(vc, name) != getattr(ic, name):
            raise UserError(
                f"The image model cannot start this video model: its {name} is {getattr(ic, name)}, the video "
                f"model's {getattr(vc, name)}. Inflation copies layers one to one, so every size must match."
            )
    source = image.state_dict()
    for name, target in video.state_dict().items():
        if name.startswith("temporal."):
            continue  # the video model's own: the identity at the start
        if name in ("word_embed.weight", "text_pos", "null_text"):  # rows: the shared words / positions
            rows = min(target.shape[0], source[name].shape[0])
            target[:rows] = source[name][:rows]
        else:
            target.copy_(source[name])
    return video


def start_model(video: ShapesVideoDiT, init: str | Path | None) -> str:
    """Initialise ``video`` for pretraining from ``init``: None or "none" (as built), "image" (the shipped image
    model, inflated), or a path to a shapes-dit checkpoint (inflated) or a shapes-video-dit one (continued).
    Returns what it started from, for the run's stats."""
    from safetensors.torch import load_file

    from tpflow.shapes.model import ShapesDiTConfig

    if init is None or str(init) == "none":
        return "none"
    path = SHIPPED_IMAGE if str(init) == "image" else Path(init)
    if not path.is_file():
        raise UserError(
            f"--init {init}: no such file. Give 'image' (the shipped shapes-dit, inflated), 'none' (from scratch) or "
            "the path of a shapes_dit.safetensors or shapes_video_dit.safetensors written by tpflow shapes pretrain "
            "or video-pretrain."
        )
    config, state = read_config(path), load_file(str(path))
    if "frames" in config:  # a video checkpoint: continue from it
        try:
            video.load_state_dict(state)
        except RuntimeError as err:
            raise UserError(f"--init {path}: a video model of another size ({err}).".splitlines()[0]) from None
        return f"continued {path.name}"
    image = ShapesDiT(ShapesDiTConfig.from_dict(config))
    image.load_state_dict(state)
    inflate(video, image)
    return f"inflated {path.name}"
