"""Reward ``geneval``: GenEval's compositional score of each image against its prompt's GenEval metadata.

    [reward]
    name = "geneval"
    detector = "mask2former"      # or "shapes" (the embedded world's rule-based detector, no weights)
    score = "partial"             # or "strict", or "soft" (continuous)
    detector_model = "facebook/mask2former-swin-small-coco-instance"   # a local folder or a cached hub id
    clip_model = "ViT-L-14"       # the colour classifier, open_clip architecture ...
    clip_pretrained = "openai"    # ... and a checkpoint file or a pretrained tag already cached
    device = "auto"

A detector (``detectors.py``) finds the objects; the shared scorer (``scoring.py``) judges them against the metadata
(``tag``, ``include``, ``exclude``) exactly as for ``shapes-geneval``: thresholds 0.3 (0.9 for counting), at most 16
objects per class, position margin 0.1. ``scores`` is the partial-credit score (the TP-GRPO / Flow-GRPO training
reward, without the upstream bug that credits a failed position check) or strict correctness (0/1).

Weights are never downloaded: fetch them once with ``hf download
facebook/mask2former-swin-small-coco-instance`` and ``hf download timm/vit_large_patch14_clip_224.openai``
(or point the options at local files).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards.geneval.detectors import Detector, build_detector
from tpflow.rewards.geneval.verdicts import GENEVAL_METADATA, SCORE_DESCRIPTION, ScoreName, verdicts
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource


class GenevalOptions(BaseModel):
    """Options of the GenEval reward."""

    model_config = ConfigDict(extra="forbid")

    detector: Literal["mask2former", "shapes"] = Field(
        "mask2former",
        description="Object detector: GenEval's Mask2Former (COCO instances) with CLIP colours, or the shapes "
        "world's rule-based detector (the detector options below are then unused).",
    )
    score: ScoreName = Field("partial", description=SCORE_DESCRIPTION)
    detector_model: str = Field(
        "facebook/mask2former-swin-small-coco-instance",
        description="Mask2Former COCO instance-segmentation weights: a local folder written by save_pretrained, or "
        "a Hugging Face id already in the local cache (GenEval uses the Swin-S COCO model).",
    )
    clip_model: str = Field("ViT-L-14", description=option_help.CLIP_MODEL)
    clip_pretrained: str = Field("openai", description=option_help.CLIP_PRETRAINED)
    device: str = Field("auto", description=option_help.DEVICE)


@register("reward", "geneval", options=GenevalOptions)
class GenevalReward:
    """RewardModel: GenEval on the detections of a pluggable detector.

    Options: ``detector``, ``score``, ``detector_model``, ``clip_model``, ``clip_pretrained``, ``device``.
    ``details`` holds ``strict`` and ``correct`` (0/1 each), ``partial`` and ``soft`` (``verdicts.py``). Models
    load on the first call (or ``load()``), under the detector's lock, so the reward may be built without weights
    and called from a worker thread. ``scores`` [N] float32 on the CPU.
    """

    needs_metadata = GENEVAL_METADATA  # each prompt's GenEval tag and include clauses (tpflow.rewards.needs)

    @staticmethod
    def weight_sources(options: GenevalOptions, settings: dict) -> list[WeightSource]:
        """Where Mask2Former and the colour classifier's open_clip weights will be read from, found without the
        network (``tpflow.weights``); the ``shapes`` detector has no weights."""
        if options.detector != "mask2former":
            return []
        from tpflow.rewards.geneval.mask2former import detector_source
        from tpflow.rewards.open_clip import open_clip_source

        detector = detector_source(options.detector_model)
        what = "reward 'geneval' colour classifier (options clip_model, clip_pretrained)"
        where = "reward 'geneval' (options clip_model, clip_pretrained)"
        return [detector, open_clip_source(what, options.clip_model, options.clip_pretrained, where)]

    def __init__(self, options: GenevalOptions | None = None):
        self.options = options or GenevalOptions()
        o = self.options
        kwargs: dict[str, Any] = {}
        if o.detector == "mask2former":
            kwargs = dict(
                detector_model=o.detector_model,
                clip_model=o.clip_model,
                clip_pretrained=o.clip_pretrained,
                device=o.device,
            )
        self.detector: Detector = build_detector(o.detector, **kwargs)  # cheap: no weights read yet

    def load(self) -> None:
        """Load the detector's models now (the first call does it otherwise)."""
        load = getattr(self.detector, "load", None)
        if load is not None:
            load()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] against their GenEval metadata; ``scores`` [N] float32."""
        if len(images) != len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(metadata)} metadata entries.")
        size = (images.shape[-2], images.shape[-1])
        detections = self.detector(images, metadata)
        return verdicts(detections, metadata, size, self.options.score)
