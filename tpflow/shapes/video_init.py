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

from tpflow.shapes.image_start import copy_image_layers, start_from
from tpflow.shapes.model import ShapesDiT
from tpflow.shapes.video_model import ShapesVideoDiT


def inflate(video: ShapesVideoDiT, image: ShapesDiT) -> ShapesVideoDiT:
    """Copy ``image``'s weights into ``video`` in place (module docstring); returns ``video``.

    The two must agree on width, depth, heads, patch size, image size and channels; the video vocabulary must begin
    with the image one (``video_world.WORDS`` does) and the text positions cover the shorter of the two prompts; the
    temporal blocks keep their identity initialisation.
    """
    copy_image_layers(video, image, lambda name: name.startswith("temporal."), "video")
    return video


def start_model(video: ShapesVideoDiT, init: str | Path | None) -> str:
    """Initialise ``video`` for pretraining from ``init``: None or "none" (as built), "image" (the shipped image
    model, inflated), or a path to a shapes-dit checkpoint (inflated) or a shapes-video-dit one (continued).
    Returns what it started from, for the run's stats."""
    files = "a shapes_dit.safetensors or shapes_video_dit.safetensors written by tpflow shapes (video-)pretrain"
    return start_from(video, init, lambda image: inflate(video, image), "frames", "video", files)
