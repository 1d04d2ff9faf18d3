"""Backbones ``tiny-z-image`` and ``tiny-z-image-turbo``: Z-Image's real diffusers and transformers classes at test
size, built in code (docs/architecture.md, "Real models at test size, offline").

    [backbone]
    name = "tiny-z-image"      # or "tiny-z-image-turbo"
    seed = 0
    resolution = 16

``ZImagePipeline`` with a ``ZImageTransformer2DModel`` of one main layer and one refiner of each kind, a 2-layer
``Qwen3Model`` text encoder behind the byte-level Qwen tokenizer of ``tiny_tokenizers`` (with a chat template that
writes what Qwen3's writes for one user message), and a 4-channel ``AutoencoderKL`` that does not downsample; random
weights from ``seed``, wrapped by the same ``ZImageBackbone`` as the real models. tiny-z-image-turbo's scheduler is
Z-Image-Turbo's published one (static shift 3); tiny-z-image's shifts dynamically, so the pipeline's ``mu`` is
exercised too. Their images are noise.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from tpflow.backbones import option_help
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.backbones.tiny import TinyOptions, _vae
from tpflow.backbones.tiny_tokenizers import QWEN_VOCAB_SIZE, qwen_tokenizer
from tpflow.backbones.z_image import (
    CFG_NORMALIZATION,
    CFG_TRUNCATION,
    ZIMAGE_LORA_TARGETS,
    ZImageBackbone,
    turbo_guidance_problems,
)
from tpflow.registry import register

# Qwen3's chat template as it renders one user message with the generation prompt (enable_thinking true: nothing
# after the assistant header; false: an empty think block)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


class TinyZImageTurboOptions(TinyOptions):
    lora_targets: list[str] = Field(
        default_factory=lambda: list(ZIMAGE_LORA_TARGETS), description=option_help.LORA_TARGETS
    )


class TinyZImageOptions(TinyZImageTurboOptions):
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)
    cfg_normalization: float = Field(0.0, ge=0.0, description=CFG_NORMALIZATION)
    cfg_truncation: float = Field(1.0, ge=0.0, le=1.0, description=CFG_TRUNCATION)


def tiny_z_image_transformer() -> Any:
    """A ``ZImageTransformer2DModel`` of width 32 (2 heads of 16 = the RoPE axes 8 + 4 + 4), one main layer, one
    noise and one context refiner, 2×2 patches of 4 channels, 16-dim captions."""
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[128, 32, 32],
    )  # fmt: skip


def tiny_z_image_scheduler(turbo: bool) -> Any:
    """The twins' scheduler: Tongyi-MAI/Z-Image-Turbo's scheduler_config.json (static shift 3), or a dynamic one."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if turbo:
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)


def tiny_z_image_pipeline(seed: int = 0, turbo: bool = False) -> Any:
    """A ``ZImagePipeline`` at test size, random weights (module docstring); ``turbo``: Z-Image-Turbo's scheduler."""
    from diffusers import ZImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_z_image_transformer()
        text_encoder = Qwen3Model(config).eval()
        vae = _vae(4, 0.1159, 0.3611)  # Z-Image decodes with FLUX's VAE: its shift and scale
    scheduler = tiny_z_image_scheduler(turbo)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)  # fmt: skip


@register("backbone", "tiny-z-image", options=TinyZImageOptions)
def tiny_z_image(options: TinyZImageOptions) -> ZImageBackbone:
    """ZImageBackbone over ``tiny_z_image_pipeline(seed)``."""
    return ZImageBackbone(tiny_z_image_pipeline(options.seed), options)  # type: ignore[arg-type]


@register("backbone", "tiny-z-image-turbo", options=TinyZImageTurboOptions)
def tiny_z_image_turbo(options: TinyZImageTurboOptions) -> ZImageBackbone:
    """ZImageBackbone over ``tiny_z_image_pipeline(seed, turbo=True)``: guidance 1 only, as z-image-turbo."""
    return ZImageBackbone(tiny_z_image_pipeline(options.seed, turbo=True), options)  # type: ignore[arg-type]


def _schedule(options: TinyZImageTurboOptions, num_steps: int, turbo: bool) -> list[float]:
    """The twin's schedule before it is built: its scheduler, its VAE's factor 1 (one down block)."""
    return packed_sigmas(options, num_steps, tiny_z_image_scheduler(turbo), scale=1)  # type: ignore[return-value]


tiny_z_image.static_sigmas = lambda options, k: _schedule(options, k, False)  # type: ignore[attr-defined]
tiny_z_image_turbo.static_sigmas = lambda options, k: _schedule(options, k, True)  # type: ignore[attr-defined]


def _check_machine(options: TinyZImageTurboOptions, settings: dict) -> list[str]:
    """Targets other than the default checked against the tiny transformer, built for real (a tenth of a second)."""
    if options.lora_targets == list(ZIMAGE_LORA_TARGETS):
        return []
    from tpflow.backbones.lora_targets import structure, target_problems

    model = structure(tiny_z_image_transformer, meta=False)
    return target_problems(model, options.lora_targets, "the tiny-z-image transformer")


tiny_z_image.check_machine = tiny_z_image_turbo.check_machine = _check_machine  # type: ignore[attr-defined]
tiny_z_image_turbo.cfg_branch = False  # type: ignore[attr-defined]  # as z-image-turbo
tiny_z_image_turbo.check_recipe = turbo_guidance_problems  # type: ignore[attr-defined]
