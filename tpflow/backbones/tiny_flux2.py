"""Backbones ``tiny-flux.2-klein`` and ``tiny-flux.2-dev``: FLUX.2's real diffusers and transformers classes at test
size, built in code (docs/architecture.md, "Real models at test size, offline").

    [backbone]
    name = "tiny-flux.2-klein"     # or "tiny-flux.2-dev"
    seed = 0
    resolution = 64

No file and no download: ``Flux2Transformer2DModel`` (one double- and one single-stream block), ``AutoencoderKLFlux2``
(8x like the real one, its batch-norm statistics random so that the pipeline's normalisation is exercised), the text
encoder of each pipeline (klein: ``Qwen3ForCausalLM``; dev: ``Mistral3ForConditionalGeneration`` with its Pixtral
vision tower) deep enough for the layers the pipelines read (klein 9, 18, 27; dev 10, 20, 30) but 16 wide, and their
tokenizers: klein's a byte-level ``Qwen2Tokenizer`` with a Qwen3-style chat template, dev's a ``PixtralProcessor``
around a byte-level tokenizer in which the pipeline's system message is one token (so that a prompt fits the tests'
32 tokens after it). They are wrapped by the same ``Flux2Backbone`` as the real models.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from tpflow.backbones import option_help
from tpflow.backbones.flux2 import FLUX2_LORA_TARGETS, SOURCE_MAX_PIXELS, Flux2Backbone, flux2_static_sigmas
from tpflow.backbones.tiny import TinyOptions
from tpflow.backbones.tiny_tokenizers import _bytes_to_unicode, qwen_tokenizer
from tpflow.registry import register

TEXT_WIDTH = 16  # the tiny text encoders' hidden size; the transformer reads 3 of their layers stacked: 48
QWEN3_TEMPLATE = (  # Qwen3's chat template, its non-thinking generation prompt included (what klein encodes)
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
MISTRAL_TEMPLATE = (  # Mistral-Small-3's layout: the system prompt, then the user's turn
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'system' %}[SYSTEM_PROMPT]"
    "{{ message.content[0].text }}[/SYSTEM_PROMPT]{%- else %}[INST]{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- else %}[IMG]{%- endif %}{%- endfor %}[/INST]{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_SPECIALS = ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                    "[IMG_BREAK]", "[IMG_END]"]  # fmt: skip


class TinyFlux2Options(TinyOptions):
    """Options of the tiny FLUX.2 twins (64 px: 4×4 image tokens through the 8× VAE and 2×2 patches)."""

    resolution: int = Field(64, ge=32, description=option_help.RESOLUTION)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(FLUX2_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    source_max_pixels: int = Field(1024 * 1024, ge=64 * 64, description=SOURCE_MAX_PIXELS)


def tiny_flux2_transformer(guidance_embeds: bool) -> Any:
    """A ``Flux2Transformer2DModel``: one double- and one single-stream block, 4-axis RoPE, 16 packed channels."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )  # fmt: skip


def _vae() -> Any:
    """An ``AutoencoderKLFlux2`` with 4 latent channels and the real 8× downsampling; random batch-norm statistics."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(4, 4, 4, 4), layers_per_block=1, latent_channels=4, norm_num_groups=2, sample_size=64,
    ).eval()  # fmt: skip
    vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, device="cpu"))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, device="cpu"))
    return vae


def _scheduler() -> Any:
    """FLUX.2's scheduler configuration (dynamic shifting; the pipeline passes its own empirical mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )  # fmt: skip


def _text_config(layers: int, vocab: int) -> dict:
    return {"hidden_size": TEXT_WIDTH, "intermediate_size": TEXT_WIDTH, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": vocab,
            "max_position_embeddings": 512}  # fmt: skip


def klein_tokenizer() -> Any:
    """Klein's tokenizer: the tiny byte-level Qwen2Tokenizer with a Qwen3-style chat template."""
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def mistral_processor() -> Any:
    """FLUX.2-dev's tokenizer: a ``PixtralProcessor`` around a byte-level tokenizer with Mistral's special tokens,
    the pipeline's system message one token of it."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>")  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS[3:]})
    tokenizer.add_tokens([SYSTEM_MESSAGE])
    image_processor = PixtralImageProcessor(patch_size=16, size={"longest_edge": 64})
    return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                            chat_template=MISTRAL_TEMPLATE)  # fmt: skip


def tiny_flux2_klein_pipeline(seed: int = 0, distilled: bool = False) -> Any:
    """A ``Flux2KleinPipeline`` at test size, random weights (``distilled``: the step-distilled variant's flag)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = klein_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_flux2_transformer(guidance_embeds=False)
        vae = _vae()
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**_text_config(27, len(tokenizer)))).eval()
    return Flux2KleinPipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=distilled)  # fmt: skip


def tiny_flux2_dev_pipeline(seed: int = 0) -> Any:
    """A ``Flux2Pipeline`` at test size: guidance embedding on, a 30-layer Mistral3 text model, random weights."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = mistral_processor()
    vocab = len(processor.tokenizer)
    config = Mistral3Config(
        text_config={"model_type": "mistral", **_text_config(30, vocab)},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 64, "patch_size": 16},
        image_token_index=processor.image_token_id, spatial_merge_size=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_flux2_transformer(guidance_embeds=True)
        vae = _vae()
        text_encoder = Mistral3ForConditionalGeneration(config).eval()
    return Flux2Pipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=processor,
                         transformer=transformer)  # fmt: skip


@register("backbone", "tiny-flux.2-klein", options=TinyFlux2Options)
def tiny_flux2_klein(options: TinyFlux2Options) -> Flux2Backbone:
    """Flux2Backbone over ``tiny_flux2_klein_pipeline(seed)`` (the base variant: CFG with the empty prompt)."""
    return Flux2Backbone(tiny_flux2_klein_pipeline(options.seed), options)


@register("backbone", "tiny-flux.2-dev", options=TinyFlux2Options)
def tiny_flux2_dev(options: TinyFlux2Options) -> Flux2Backbone:
    """Flux2Backbone over ``tiny_flux2_dev_pipeline(seed)`` (guidance embedding)."""
    return Flux2Backbone(tiny_flux2_dev_pipeline(options.seed), options)


tiny_flux2_klein.source_images = tiny_flux2_dev.source_images = (0, 4)  # type: ignore[attr-defined]
tiny_flux2_dev.cfg_branch = False  # type: ignore[attr-defined]  # as flux.2-dev
for _twin in (tiny_flux2_klein, tiny_flux2_dev):  # the schedule before building: its scheduler, its VAE's factor 8
    _twin.static_sigmas = lambda options, k: flux2_static_sigmas(options, k, _scheduler(), 8)  # type: ignore[attr-defined]
