"""Reward ``pickscore``: PickScore_v1, a CLIP-H model fine-tuned on Pick-a-Pic human preferences (Kirstain et al.).

    [reward]
    name = "pickscore"
    model = "yuvalkirstain/PickScore_v1"                        # a Hugging Face id already cached, or a folder
    processor = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"         # its tokenizer and image preprocessing

Score = exp(logit_scale) · cos(text_emb, image_emb) / 26, as the reference (docs/algorithm.md §7): the /26 brings the
usual range (about 20-23) near 1. Weights are never downloaded; fetch them once with
``hf download yuvalkirstain/PickScore_v1`` and ``hf download
laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, or point the options at local folders.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import clip_preprocess, l2_normalize
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.types import RewardOutput
from tpflow.weights import MODEL_FILES, WeightSource, download_command, model_folder

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HOW = "set the option to a local folder written by save_pretrained"
MAX_TOKENS = 77  # CLIP's text context; longer prompts are truncated, as in the reference


class PickScoreOptions(BaseModel):
    """Options of the PickScore reward."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "yuvalkirstain/PickScore_v1",
        description="PickScore weights: a Hugging Face model id already in the local cache, or a local folder "
        "written by save_pretrained.",
    )
    processor: str = Field(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        description="Tokenizer and image preprocessing (CLIPProcessor): a cached Hugging Face id or a local folder.",
    )
    device: str = Field("auto", description=option_help.DEVICE)
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description=option_help.DTYPE)


@register("reward", "pickscore", options=PickScoreOptions)
class PickScoreReward:
    """RewardModel: PickScore_v1 preference score of each image for its prompt.

    Options: ``model``, ``processor``, ``device``, ``dtype``. The model loads on the first call (or ``load()``),
    under a lock, so the reward may be built without weights and called from a worker thread. Images are quantised
    to uint8 and preprocessed in torch (resize the shortest side with PIL's bicubic, centre-crop, normalise with the
    processor's mean and std), so a score never depends on the rest of the batch. ``scores`` [N] float32 on the CPU.
    """

    @staticmethod
    def weight_sources(options: PickScoreOptions, settings: dict) -> list[WeightSource]:
        """Where the model and the processor will be read from: local folders or Hugging Face cache entries, found
        without the network (``tpflow.weights``)."""
        return [
            model_folder(
                "reward 'pickscore' model (option model)", options.model, [("config.json",), MODEL_FILES], _HOW
            ),
            model_folder(
                "reward 'pickscore' processor (option processor)",
                options.processor,
                [("preprocessor_config.json", "processor_config.json"), ("tokenizer.json", "vocab.json")],
                _HOW,
            ),
        ]

    def __init__(self, options: PickScoreOptions | None = None):
        self.options = options or PickScoreOptions()
        self.device = resolve_device(self.options.device)  # in the building thread, on its current GPU
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._image_cfg: dict[str, Any] = {}

    def load(self) -> None:
        """Load the model and processor now (the first call does it otherwise)."""
        with self._lock:
            if self._model is not None:
                return
            from transformers import CLIPModel, CLIPProcessor

            device, dtype = self.device, _DTYPES[self.options.dtype]
            processor = _from_local(CLIPProcessor, self.options.processor, "processor")
            model = _from_local(CLIPModel, self.options.model, "model")
            ip = processor.image_processor
            size = ip.size.get("shortest_edge") or min(ip.size["height"], ip.size["width"])
            crop = (ip.crop_size["height"], ip.crop_size["width"]) if ip.do_center_crop else (size, size)
            self._image_cfg = dict(resize=int(size), crop=crop, mean=tuple(ip.image_mean), std=tuple(ip.image_std))
            self._tokenizer = processor.tokenizer
            self._model = model.eval().requires_grad_(False).to(device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        self.load()
        model = self._model
        device, dtype = model.logit_scale.device, model.logit_scale.dtype
        pixels = clip_preprocess(images.to(device), **self._image_cfg).to(dtype)  # [N, 3, h, w]
        # Pad every prompt to the full context so that no score depends on the longest prompt of the batch.
        text = self._tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        ).to(device)
        image_emb = l2_normalize(_pooled(model.get_image_features(pixel_values=pixels)))  # [N, D]
        text_emb = l2_normalize(
            _pooled(model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"]))
        )  # [N, D]
        scores = model.logit_scale.float().exp() * (image_emb * text_emb).sum(-1) / 26  # [N]
        return RewardOutput(scores=scores.float().cpu())


def _pooled(out: Any) -> Tensor:
    """transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x a tensor."""
    return out if isinstance(out, Tensor) else out.pooler_output


def _from_local(cls: Any, name: str, option: str) -> Any:
    """``cls.from_pretrained`` of the folder ``name`` is (a local folder, or its Hugging Face cache snapshot), found
    first without the network; a clear UserError when it is not there."""
    sources = PickScoreReward.weight_sources(PickScoreOptions(**{option: name}), {})
    source = next(s for s in sources if f"(option {option})" in s.what)
    if source.problem or source.path is None:
        raise UserError(source.problem or f"reward 'pickscore': option {option} = {name!r} was not found.")
    try:
        return cls.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"reward 'pickscore': option {option} = {name!r} could not be loaded from {source.path}: {reason}. "
            f"Fetch it again with {download_command(name)}, or set reward option {option} to a local folder "
            "written by save_pretrained."
        ) from None
