"""Backbones ``tiny-sd3`` and ``tiny-flux``: the real diffusers classes at test size, built in code
(docs/architecture.md, "Real models at test size, offline").

    [backbone]
    name = "tiny-sd3"      # or "tiny-flux"
    seed = 0
    resolution = 16

No file and no download: every component (transformer, VAE, text encoders, tokenizers, scheduler) is constructed
with random weights from ``seed``, then wrapped by the same ``SD3Backbone`` / ``FluxBackbone`` as the real models.
tiny-sd3 has SD3.5's flags on (a dual-attention layer, RMS qk-norm). They exist so that tests, ``tiny_smoke.toml``
and benchmarks exercise the real code paths on a CPU in seconds; their images are noise.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from tpflow.backbones.diffusers_common import DiffusersBackboneOptions
from tpflow.backbones.flux import FLUX_LORA_TARGETS, FLUX_LORA_TARGETS_HELP, FluxBackbone
from tpflow.backbones.sd3 import SD3_LORA_TARGETS, SD3_LORA_TARGETS_HELP, SD3Backbone
from tpflow.backbones.tiny_tokenizers import clip_tokenizer, t5_tokenizer
from tpflow.registry import register


class TinyOptions(DiffusersBackboneOptions):
    """Options of the tiny backbones: CPU-sized defaults (fp32, 16 px, LoRA r=4)."""

    seed: int = Field(0, description="Seed of the random weights (the same seed builds the same model).")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="Transformer and text-encoder dtype.")
    device: str | None = Field("cpu", description="Torch device.")
    resolution: int = Field(16, ge=4, description="Image side in pixels (the tiny VAE does not downsample).")
    max_sequence_length: int = Field(32, ge=4, description="T5 tokens per prompt.")
    lora_rank: int = Field(4, ge=1, description="LoRA rank r.")
    lora_alpha: float = Field(8.0, gt=0, description="LoRA alpha.")


class TinySD3Options(TinyOptions):
    lora_targets: list[str] = Field(  # its one block is SD3's last, which has no attn.to_add_out (context_pre_only)
        default_factory=lambda: [t for t in SD3_LORA_TARGETS if t != "attn.to_add_out"],
        description=SD3_LORA_TARGETS_HELP,
    )
    negative_prompt: str = Field("", description="Prompt of the unconditional CFG branch.")


class TinyFluxOptions(TinyOptions):
    lora_targets: list[str] = Field(
        default_factory=lambda: list(FLUX_LORA_TARGETS), description=FLUX_LORA_TARGETS_HELP
    )


def _clip_encoder(projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=5,
        vocab_size=1000,
        projection_dim=32,
        bos_token_id=998,
        eos_token_id=999,
        pad_token_id=999,
        max_position_embeddings=77,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5_encoder(vocab_size: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        d_model=32,
        d_ff=37,
        d_kv=8,
        num_heads=4,
        num_layers=5,
        relative_attention_num_buckets=8,
        vocab_size=vocab_size,
    )
    return T5EncoderModel(config).eval()


def _vae(latent_channels: int, shift: float, scale: float) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift,
        scaling_factor=scale,
    ).eval()


def tiny_sd3_transformer(large: bool = False) -> Any:
    """tiny-sd3's ``SD3Transformer2DModel``: one block, SD3.5-Medium's dual attention and RMS qk-norm, random
    weights; ``large``: SD3.5-Large's shape, RMS qk-norm and no second attention (tiny-sd3-large)."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        dual_attention_layers=() if large else (0,),
        qk_norm="rms_norm",
    )


def tiny_flux_transformer() -> Any:
    """tiny-flux's ``FluxTransformer2DModel``: one double and one single block, guidance embedding on."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )


def tiny_sd3_pipeline(seed: int = 0, large: bool = False) -> Any:
    """A ``StableDiffusion3Pipeline`` at test size with SD3.5's dual attention (``large``: without, as SD3.5-Large)
    and qk-norm, random weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_sd3_transformer(large)
        encoders = [_clip_encoder(True), _clip_encoder(True)]
        t5_tok = t5_tokenizer()
        t5 = _t5_encoder(len(t5_tok))
        vae = _vae(4, 0.0609, 1.5035)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=clip_tokenizer(),
        text_encoder_2=encoders[1],
        tokenizer_2=clip_tokenizer(pad_token="!"),
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
    )


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A ``FluxPipeline`` at test size (guidance embedding on, dynamic shifting), random weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_flux_transformer()
        clip = _clip_encoder(False)
        t5_tok = t5_tokenizer()
        t5 = _t5_encoder(len(t5_tok))
        vae = _vae(1, 0.1159, 0.3611)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
    )


@register("backbone", "tiny-sd3", options=TinySD3Options)
def tiny_sd3(options: TinySD3Options) -> SD3Backbone:
    """SD3Backbone over ``tiny_sd3_pipeline(seed)``."""
    return SD3Backbone(tiny_sd3_pipeline(options.seed), options)


@register("backbone", "tiny-sd3-large", options=TinySD3Options)
def tiny_sd3_large(options: TinySD3Options) -> SD3Backbone:
    """SD3Backbone over ``tiny_sd3_pipeline(seed, large=True)``: SD3.5-Large's block layout at test size."""
    return SD3Backbone(tiny_sd3_pipeline(options.seed, large=True), options)


@register("backbone", "tiny-flux", options=TinyFluxOptions)
def tiny_flux(options: TinyFluxOptions) -> FluxBackbone:
    """FluxBackbone over ``tiny_flux_pipeline(seed)``."""
    return FluxBackbone(tiny_flux_pipeline(options.seed), options)


def _check_machine(options: TinyOptions, settings: dict) -> list[str]:
    """The LoRA targets name layers of the tiny transformer, built without the pipeline (``tpflow.preflight``).

    The default targets are not checked: the model is fixed in code and the defaults are tested to fit it
    (tests/test_preflight.py), and the check would cost ``tpflow validate`` the import of diffusers (seconds)."""
    sd3 = isinstance(options, TinySD3Options)
    if options.lora_targets == type(options)().lora_targets:
        return []
    from tpflow.backbones.lora_targets import structure, target_problems

    build, what = (tiny_sd3_transformer, "tiny-sd3") if sd3 else (tiny_flux_transformer, "tiny-flux")
    return target_problems(structure(build, meta=False), options.lora_targets, f"the {what} transformer")


tiny_sd3.check_machine = _check_machine  # type: ignore[attr-defined]
tiny_flux.check_machine = _check_machine  # type: ignore[attr-defined]
