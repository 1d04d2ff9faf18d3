"""Reward ``edit-consistency``: how much an edited image still looks like its source image.

    [reward]
    name = "weighted"          # flow_grpo's FLUX.1 Kontext counting task: GenEval's count plus this, 0.5 each
    rewards = [
        { name = "geneval", weight = 0.5 },
        { name = "edit-consistency", weight = 0.5, options = { features = "clip" } },
    ]

An editing prompt carries its source image(s) in its metadata (``sources``, ``tpflow.sources``); this reward loads
them and scores each edit by its similarity to them, so that an instruction is not followed by drawing a new picture.
It rewards sameness only: train it beside a reward for the instruction (``weighted``), as flow_grpo's
``counting_flux_kontext`` config does (``reward_fn = {"image_similarity": 0.5, "geneval": 0.5}``,
github.com/yifan123/flow_grpo, config/grpo.py, commit 31c71b9).

``features`` says how the two are compared (``tpflow.rewards.edit_features``), each source first resized to the
edit's size (PIL's bicubic, as flow_grpo resizes its reference images):

* ``"clip"`` (default): flow_grpo's ``image_similarity``, the cosine of the two images' CLIP embeddings through
  its ``ClipScorer`` preprocessing (torchvision bilinear resize of the shortest side, centre crop, normalise),
  no threshold, no scale: in [-1, 1], about 0.5-1 for natural images. ``model`` / ``pretrained``: an open_clip
  model (ViT-L-14 "openai", the weights of flow_grpo's openai/clip-vit-large-patch14).
* ``"dino"``: the cosine of DINOv2 / DINOv3 CLS features, a transformers ``AutoModel`` folder or cached id in
  ``model`` (default ``facebook/dinov2-base``); DINO features see layout and identity more than CLIP's.
* ``"pixel"``: 1 − the mean absolute difference of the pixels (uint8 grid), in [0, 1]; no weights. For the
  embedded editing shapes world, whose edits change one object on a flat background.

A prompt with several sources (Qwen-Image-Edit-Plus) is compared with the first (``multiple_sources = "first"``,
the image being edited) or with each, the similarities averaged (``"mean"``) or the largest kept (``"max"``).
Sources are embedded once per distinct reference per call. ``scores`` [N] float32 on the CPU. Weights are never
downloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.edit_features import ClipFeatures, DinoFeatures, first_source, pixel_similarity, source_at
from tpflow.rewards.open_clip import open_clip_source
from tpflow.sources import SOURCES, load, references
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource

DEFAULT_MODELS = {"clip": "ViT-L-14", "dino": "facebook/dinov2-base", "pixel": ""}
WHERE = "reward 'edit-consistency' (options features, model, pretrained)"


class EditConsistencyOptions(BaseModel):
    """Options of the edit-consistency reward."""

    model_config = ConfigDict(extra="forbid")

    features: Literal["clip", "dino", "pixel"] = Field(
        "clip",
        description="How an edit is compared with its source: 'clip' (flow_grpo's CLIP image similarity), 'dino' "
        "(DINOv2/v3 CLS cosine) or 'pixel' (1 - mean absolute difference, no weights).",
    )
    model: str | None = Field(
        None,
        description="clip: an open_clip architecture (default ViT-L-14); dino: a transformers folder or cached "
        "Hugging Face id (default facebook/dinov2-base); unused by pixel.",
    )
    pretrained: str = Field(
        "openai",
        description="open_clip weights: a local checkpoint file, or a pretrained tag of the architecture whose "
        "weights are already in the Hugging Face cache (tpflow never downloads).",
    )
    multiple_sources: Literal["first", "mean", "max"] = Field(
        "first",
        description="With several sources per prompt: compare with the first, or with each and average / keep the "
        "largest similarity.",
    )
    device: str = Field("auto", description=option_help.DEVICE)

    @property
    def model_name(self) -> str:
        return self.model or DEFAULT_MODELS[self.features]


@register("reward", "edit-consistency", options=EditConsistencyOptions)
class EditConsistencyReward:
    """RewardModel: the similarity of each edited image [N, 3, H, W] to its prompt's source image(s).

    Reads ``metadata["sources"]`` (``needs_metadata``: a recipe whose dataset carries no sources is refused before
    anything loads). The features' model loads at the first call, once, under a lock, so the reward may be built
    without weights and called from the scoring thread.
    """

    needs_metadata = (SOURCES,)

    @staticmethod
    def weight_sources(options: EditConsistencyOptions, settings: dict) -> list[WeightSource]:
        """Where the features' weights will be read from, found without the network (``tpflow.weights``)."""
        if options.features == "pixel":
            return []
        what = f"reward 'edit-consistency' {options.features} weights (options model, pretrained)"
        if options.features == "clip":
            return [open_clip_source(what, options.model_name, options.pretrained, WHERE)]
        return [DinoFeatures(options.model_name, torch.device("cpu"), what).source()]

    def __init__(self, options: EditConsistencyOptions | None = None):
        self.options = o = options or EditConsistencyOptions()
        self.features: Callable[[Tensor], Tensor] | None = None  # images -> unit rows [N, D] on the CPU
        if o.features == "clip":
            self.features = ClipFeatures(o.model_name, o.pretrained, resolve_device(o.device), WHERE)
        elif o.features == "dino":
            self.features = DinoFeatures(o.model_name, resolve_device(o.device), WHERE)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score edits [N, 3, H, W] in [0, 1] against their sources; ``scores`` [N] float32 on the CPU."""
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts and {len(metadata)} metadata.")
        size = (int(images.shape[-2]), int(images.shape[-1]))
        refs = [self._compared(m) for m in metadata]  # per image, its sources
        unique = sorted({r for rs in refs for r in rs})
        sources = torch.stack([source_at(load(r), size) for r in unique])  # [U, 3, H, W] at the edits' size
        row = {r: i for i, r in enumerate(unique)}
        pairs = [(i, row[r]) for i, rs in enumerate(refs) for r in rs]  # (image, source) compared
        edit_index = torch.tensor([i for i, _ in pairs], device="cpu")  # host bookkeeping
        source_index = torch.tensor([s for _, s in pairs], device="cpu")
        if self.features is None:  # pixel
            similarity = pixel_similarity(images[edit_index].cpu(), sources[source_index])  # [P]
        else:
            edits, originals = self.features(images), self.features(sources)  # [N, D], [U, D]
            similarity = (edits[edit_index].double() * originals[source_index].double()).sum(-1)  # [P]
        return RewardOutput(scores=self._aggregate(similarity.double().cpu(), edit_index, len(images)).float())

    def _compared(self, metadata: dict[str, Any]) -> tuple[str, ...]:
        """The source references an image is compared with (the first, or all of them by ``multiple_sources``)."""
        first = first_source(metadata, "reward 'edit-consistency'")  # a UserError when the item has none
        return (first,) if self.options.multiple_sources == "first" else references(metadata)

    def _aggregate(self, similarity: Tensor, edit_index: Tensor, n: int) -> Tensor:
        """[P] similarities of (image, source) pairs -> [n] per image: the mean or the max over its sources."""
        if self.options.multiple_sources == "max":
            out = torch.full((n,), -torch.inf, dtype=torch.float64, device="cpu")
            return out.scatter_reduce(0, edit_index, similarity, reduce="amax")
        total = torch.zeros(n, dtype=torch.float64, device="cpu").index_add(0, edit_index, similarity)
        return total / torch.bincount(edit_index, minlength=n).double()
