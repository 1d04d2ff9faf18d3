"""Backbone ``tiny-qwen-image-edit``: ``QwenImageEditPlusPipeline`` at test size, built in code from tiny-qwen-image's
parts (docs/architecture.md, "Real models at test size, offline").

    [backbone]
    name = "tiny-qwen-image-edit"
    seed = 0
    resolution = 32

The transformer, VAE, scheduler and Qwen2.5-VL text model (with its vision tower) are ``tiny_qwen_image_pipeline``'s;
what the edit pipeline adds is a ``Qwen2VLProcessor``: the tiny byte-level tokenizer with the three vision tokens
appended (ids 259-261, the ids the tiny text model's config already reserves for them) and Qwen2-VL's image
processor (14 px patches, 2×2 merge). The sources reach the text model at ``condition_area`` = 32² pixels, which the
image processor lifts to its 56² minimum (4 image tokens each), and the VAE at the output's area; both are the real
backbone's options at CPU size. Random weights: its images are noise.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tpflow.backbones import option_help
from tpflow.backbones.qwen_image import QWEN_LORA_TARGETS
from tpflow.backbones.qwen_image_edit import CONDITION_AREA, MIN_SIDE, SOURCE_AREA, QwenImageEditBackbone
from tpflow.backbones.tiny import TinyOptions, tiny_qwen_image, tiny_qwen_image_pipeline
from tpflow.registry import register

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # the tiny config's vocab - 3 .. vocab - 1


class TinyQwenImageEditOptions(TinyOptions):
    resolution: int = Field(32, ge=MIN_SIDE, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(128, ge=8, le=1024, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(QWEN_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    negative_prompt: str = Field(" ", description=option_help.NEGATIVE_PROMPT)
    condition_area: int = Field(32 * 32, ge=MIN_SIDE**2, description=CONDITION_AREA)
    source_area: int | None = Field(None, ge=MIN_SIDE**2, description=SOURCE_AREA)


def tiny_qwen_image_edit_pipeline(seed: int = 0) -> Any:
    """A ``QwenImageEditPlusPipeline`` at test size: ``tiny_qwen_image_pipeline(seed)``'s models and scheduler, its
    tokenizer with the vision tokens, a Qwen2-VL processor; the template's dropped prefix set to this tokenizer's
    count of it (as tiny-qwen-image does for the text-to-image template)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    base = tiny_qwen_image_pipeline(seed)
    tokenizer = base.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = base.text_encoder.config
    assert ids == [config.vision_start_token_id, config.vision_end_token_id, config.vision_token_id], ids
    config.image_token_id = config.vision_token_id  # where the vision tower's embeddings replace the pads
    processor = Qwen2VLProcessor(  # its video processor is unused, but a Qwen2-VL processor must hold one
        image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )
    pipe = QwenImageEditPlusPipeline(
        scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder, tokenizer=tokenizer,
        processor=processor, transformer=base.transformer,
    )  # fmt: skip
    prefix = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    return pipe


@register("backbone", "tiny-qwen-image-edit", options=TinyQwenImageEditOptions)
def tiny_qwen_image_edit(options: TinyQwenImageEditOptions) -> QwenImageEditBackbone:
    """QwenImageEditBackbone over ``tiny_qwen_image_edit_pipeline(seed)``."""
    return QwenImageEditBackbone(tiny_qwen_image_edit_pipeline(options.seed), options)  # type: ignore[arg-type]


tiny_qwen_image_edit.source_images = QwenImageEditBackbone.source_images  # type: ignore[attr-defined]
tiny_qwen_image_edit.static_sigmas = tiny_qwen_image.static_sigmas  # type: ignore[attr-defined]  # the same
