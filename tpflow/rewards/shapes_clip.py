"""Reward ``shapes-clip``: the shapes world's PickScore, a continuous text-image score from a tiny CLIP.

    [reward]
    name = "shapes-clip"
    weights = "runs/shapes-clip/shapes_clip.safetensors"   # omit for the weights shipped in tpflow/shapes/weights
    device = "auto"                                         # "cpu", "cuda", "cuda:1"...

Score = exp(logit_scale) · cos(text_emb, image_emb) / ``SCORE_SCALE`` (60), as PickScore's exp(logit_scale)·cos / 26:
the shipped model's exp(logit_scale) is 65.9 and correct renderings of held-out test prompts have a cosine of about
0.88, so they score about 0.97 and their hard negatives (one colour, shape, count or position wrong) about 0.75
(``benchmarks/shapes_clip_accuracy.py``). Unlike ``shapes-geneval`` it is dense: a sample that is almost right
scores almost as well as a right one, the setting of the paper's PickScore runs. The raw cosine is in
``details["cosine"]``. The model (``tpflow.shapes.clip``, trained by ``tpflow shapes clip-pretrain``) is built when
the recipe is built, on the resolved device; calls are serialised by a lock, so a scoring worker thread may call it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import to_uint8
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "shapes" / "weights"
WEIGHTS_FILE = "shapes_clip.safetensors"
SCORE_SCALE = 60.0
"""Divides exp(logit_scale)·cos, like PickScore's 26: the shipped model (exp(logit_scale) = 65.9) then scores a correct
rendering about 0.97 (cosine about 0.88) and a hard negative about 0.75; a retrained model with another logit scale
gives proportionally other scores (the raw cosine is in ``details["cosine"]``)."""


class ShapesClipOptions(BaseModel):
    """Options of the shapes-clip reward."""

    model_config = ConfigDict(extra="forbid")

    weights: str | None = Field(
        None,
        description="ShapesCLIP weights: a .safetensors written by `tpflow shapes clip-pretrain` (its .json config "
        "beside it) or the folder holding shapes_clip.safetensors. None: the weights shipped in "
        "tpflow/shapes/weights/.",
    )
    device: str = Field("auto", description=option_help.DEVICE)


def resolve_weights(weights: str | None) -> Path:
    """The .safetensors path named by the ``weights`` option; UserError saying how to create it when missing."""
    path = WEIGHTS_DIR / WEIGHTS_FILE if weights is None else Path(weights).expanduser()
    if path.is_dir():
        path = path / WEIGHTS_FILE
    if not path.is_file():
        where = "The shipped shapes-clip weights are" if weights is None else f"The shapes-clip weights {path} are"
        raise UserError(
            f"reward 'shapes-clip': {where} missing ({path}). Create them with "
            "`tpflow shapes clip-pretrain --out DIR` (about 10 minutes on one CPU core) and set "
            "weights = 'DIR/shapes_clip.safetensors' in the [reward] section."
        )
    return path


@register("reward", "shapes-clip", options=ShapesClipOptions)
class ShapesClipReward:
    """RewardModel: exp(logit_scale)·cos(text, image) / SCORE_SCALE of a ShapesCLIP, per image and prompt.

    Options: ``weights`` (None = shipped), ``device`` (resolved when built). Images [N, 3, H, W] in [0, 1], any float
    dtype and device, are quantised to uint8 as every reward does and resized to 32×32 when they are not. ``scores``
    [N] float32 on the CPU; ``details["cosine"]`` [N].
    """

    @staticmethod
    def check_machine(options: ShapesClipOptions, settings: dict) -> list[str]:
        """The weights file exists and is a safetensors file (its header is read, not the weights)."""
        from tpflow.files import safetensors_problem

        try:
            path = resolve_weights(options.weights)
        except UserError as exc:
            return [f"[reward] {exc}"]
        problem = safetensors_problem(path, "[reward] The shapes-clip weights")
        return [f"{problem} Use a file written by `tpflow shapes clip-pretrain`."] if problem else []

    @staticmethod
    def weight_sources(options: ShapesClipOptions, settings: dict) -> list[WeightSource]:
        """Where the weights come from (``tpflow.weights``); a missing file is ``check_machine``'s problem."""
        try:
            path = resolve_weights(options.weights)
        except UserError:
            return []
        origin = "shipped file" if options.weights is None else "local file"
        return [WeightSource("reward 'shapes-clip' weights (option weights)", str(path), f"{origin} {path}")]

    def __init__(self, options: ShapesClipOptions | None = None):
        from tpflow.shapes.clip import load_clip

        self.options = options or ShapesClipOptions()
        self.device = resolve_device(self.options.device)  # in the building thread, on its current GPU
        path = resolve_weights(self.options.weights)
        try:
            self.model = load_clip(path, self.device)
        except Exception as exc:  # a truncated file, another model's weights, a bad config
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"reward 'shapes-clip': the weights {path} could not be loaded ({reason}). Use a file written by "
                "`tpflow shapes clip-pretrain`, with its .json beside it."
            ) from None
        self._lock = threading.Lock()

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        size = self.model.config.image_size
        with self._lock:
            pixels = to_uint8(images.to(self.device)).float() / 255  # [N, 3, H, W] on the uint8 grid
            if pixels.shape[-2:] != (size, size):
                pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True).clamp(0, 1)
            cosine = (self.model.encode_image(pixels) * self.model.encode_prompts(list(prompts))).sum(-1)  # [N]
            scores = self.model.scale() * cosine / SCORE_SCALE  # [N]
        return RewardOutput(scores=scores.float().cpu(), details={"cosine": cosine.float().cpu()})
