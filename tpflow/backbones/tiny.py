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

from tpflow.backbones import option_help
from tpflow.backbones.diffusers_common import DiffusersBackboneOptions
from tpflow.backbones.flux import FLUX_LORA_TARGETS, FluxBackbone, flux_static_sigmas
from tpflow.backbones.qwen_image import QWEN_LORA_TARGETS, QwenImageBackbone
from tpflow.backbones.sd3 import SD3_LORA_TARGETS, SD3Backbone
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.backbones.tiny_tokenizers import QWEN_VOCAB_SIZE, clip_tokenizer, qwen_tokenizer, t5_tokenizer
from tpflow.backbones.wan import WAN_LORA_TARGETS, WanBackbone
from tpflow.backbones.wan22 import Wan22Backbone, expert_problems
from tpflow.registry import register


class TinyOptions(DiffusersBackboneOptions):
    """Options of the tiny backbones: CPU-sized defaults (fp32, 16 px, LoRA r=4)."""

    seed: int = Field(0, description="Seed of the random weights (the same seed builds the same model).")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description=option_help.DTYPE)
    device: str | None = Field("cpu", description=option_help.DEVICE)
    resolution: int = Field(16, ge=4, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(32, ge=4, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_rank: int = Field(4, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(8.0, gt=0, description=option_help.LORA_ALPHA)


class TinySD3Options(TinyOptions):
    lora_targets: list[str] = Field(  # its one block is SD3's last, which has no attn.to_add_out (context_pre_only)
        default_factory=lambda: [t for t in SD3_LORA_TARGETS if t != "attn.to_add_out"],
        description=option_help.LORA_TARGETS,
    )
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)


class TinyFluxOptions(TinyOptions):
    lora_targets: list[str] = Field(
        default_factory=lambda: list(FLUX_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    time_shift: float | None = Field(None, gt=0, description=option_help.TIME_SHIFT)


class TinyQwenImageOptions(TinyOptions):
    resolution: int = Field(32, ge=16, description=option_help.RESOLUTION)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(QWEN_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    negative_prompt: str = Field(" ", description=option_help.NEGATIVE_PROMPT)


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


def tiny_flux_scheduler() -> Any:
    """FLUX.1-dev's scheduler configuration (dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip


def tiny_qwen_image_scheduler() -> Any:
    """Qwen/Qwen-Image's scheduler_config.json values."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )  # fmt: skip


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A ``FluxPipeline`` at test size (guidance embedding on, dynamic shifting), random weights."""
    from diffusers import FluxPipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_flux_transformer()
        clip = _clip_encoder(False)
        t5_tok = t5_tokenizer()
        t5 = _t5_encoder(len(t5_tok))
        vae = _vae(1, 0.1159, 0.3611)
    scheduler = tiny_flux_scheduler()
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


def tiny_qwen_image_pipeline(seed: int = 0) -> Any:
    """A ``QwenImagePipeline`` at test size: one double-stream block, a 1-layer Qwen2.5-VL text model with its
    vision tower, a 4× video-style VAE, Qwen-Image's dynamic-shift scheduler config, random weights (the shapes of
    diffusers' own QwenImage pipeline tests)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = QWEN_VOCAB_SIZE + 3  # and the vision marker ids, unused by text
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_theta": 1e6, "vocab_size": vocab, "bos_token_id": None,
            "eos_token_id": QWEN_VOCAB_SIZE - 3, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                                                  "type": "default"}}  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=vocab, bos_token_id=None, eos_token_id=QWEN_VOCAB_SIZE - 3,
        vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2, vision_token_id=vocab - 1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )  # fmt: skip
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                     latents_std=[1.5, 0.8, 1.0, 1.2]).eval()  # fmt: skip
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    scheduler = tiny_qwen_image_scheduler()
    tokenizer = qwen_tokenizer()
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)  # fmt: skip
    # The pipeline drops the chat template's system part, 34 tokens of the real tokenizer; one id per byte makes it
    # longer, so the drop is set to this tokenizer's count of it (the prompt's tokens start right after, as there).
    prefix = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    return pipe


@register("backbone", "tiny-qwen-image", options=TinyQwenImageOptions)
def tiny_qwen_image(options: TinyQwenImageOptions) -> QwenImageBackbone:
    """QwenImageBackbone over ``tiny_qwen_image_pipeline(seed)``."""
    return QwenImageBackbone(tiny_qwen_image_pipeline(options.seed), options)


class TinyWanOptions(TinyOptions):
    resolution: int = Field(32, ge=16, description=option_help.RESOLUTION)
    width: int | None = Field(None, ge=16, description=option_help.WIDTH)
    num_frames: int = Field(5, ge=1, description=option_help.NUM_FRAMES)
    flow_shift: float = Field(3.0, gt=0, description=option_help.FLOW_SHIFT)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(WAN_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)


def tiny_wan_pipeline(seed: int = 0, flow_shift: float = 3.0, expand_timesteps: bool = False) -> Any:
    """A ``WanPipeline`` at test size: two Wan transformer blocks, a 2-layer UMT5 encoder, a Wan VAE with 4 latent
    channels (8× spatial, 4× temporal compression, as the real one), random weights; its scheduler is the Euler
    flow-matching one with static shift ``flow_shift`` (what the backbone's schedule is: tpflow/backbones/wan.py)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )  # fmt: skip
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                               latents_std=[1.5, 0.8, 1.0, 1.2]).eval()  # fmt: skip
        config = UMT5Config(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, relative_attention_num_buckets=8,
                            vocab_size=len(tokenizer))  # fmt: skip
        text_encoder = UMT5EncoderModel(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler, expand_timesteps=expand_timesteps)  # fmt: skip


class TinyWan22Options(TinyWanOptions):
    flow_shift: float = Field(12.0, gt=0, description=option_help.FLOW_SHIFT)
    train_expert: Literal["high", "low"] = Field("high", description=option_help.TRAIN_EXPERT)
    low_noise_guidance: float | None = Field(None, ge=1.0, description=option_help.LOW_NOISE_GUIDANCE)


def tiny_wan22_pipeline(seed: int = 0, flow_shift: float = 12.0) -> Any:
    """``tiny_wan_pipeline`` with a second expert (``transformer_2``, seeded ``seed + 1``) and Wan2.2 A14B's
    boundary 0.875: with 3 steps at shift 12 the first two run the high-noise expert, the last the low-noise one."""
    pipe = tiny_wan_pipeline(seed, flow_shift)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        second = type(pipe.transformer)(**pipe.transformer.config)
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, transformer=pipe.transformer,
                       vae=pipe.vae, scheduler=pipe.scheduler, transformer_2=second, boundary_ratio=0.875)  # fmt: skip


@register("backbone", "tiny-wan2.2", options=TinyWan22Options)
def tiny_wan22(options: TinyWan22Options) -> Wan22Backbone:
    """Wan22Backbone over ``tiny_wan22_pipeline(seed)``."""
    return Wan22Backbone(tiny_wan22_pipeline(options.seed, options.flow_shift), options)  # type: ignore[arg-type]


@register("backbone", "tiny-wan2.2-ti2v", options=TinyWanOptions)
def tiny_wan22_ti2v(options: TinyWanOptions) -> WanBackbone:
    """WanBackbone over ``tiny_wan_pipeline(seed, expand_timesteps=True)``: Wan2.2 TI2V's one timestep per token."""
    return WanBackbone(tiny_wan_pipeline(options.seed, options.flow_shift, expand_timesteps=True), options)  # type: ignore[arg-type]


@register("backbone", "tiny-wan", options=TinyWanOptions)
def tiny_wan(options: TinyWanOptions) -> WanBackbone:
    """WanBackbone over ``tiny_wan_pipeline(seed)``."""
    return WanBackbone(tiny_wan_pipeline(options.seed, options.flow_shift), options)  # type: ignore[arg-type]


@register("backbone", "tiny-flux", options=TinyFluxOptions)
def tiny_flux(options: TinyFluxOptions) -> FluxBackbone:
    """FluxBackbone over ``tiny_flux_pipeline(seed)``."""
    return FluxBackbone(tiny_flux_pipeline(options.seed), options)


tiny_flux.cfg_branch = False  # as flux.1-dev


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
tiny_wan.samples_clips = tiny_wan22_ti2v.samples_clips = tiny_wan22.samples_clips = True  # type: ignore[attr-defined]
tiny_wan22.check_recipe = expert_problems  # type: ignore[attr-defined]
tiny_flux.check_machine = _check_machine  # type: ignore[attr-defined]


# The schedule before building (capability static_sigmas): the twins' schedulers, their VAEs' factors (FLUX's tiny
# VAE has one down block: 1; Qwen-Image's two temporal-free downsamplings: 4); tests/test_static_schedules.py
tiny_flux.static_sigmas = lambda options, k: flux_static_sigmas(options, k, tiny_flux_scheduler(), 1)  # type: ignore[attr-defined]
tiny_qwen_image.static_sigmas = lambda options, k: packed_sigmas(options, k, tiny_qwen_image_scheduler(), 4)  # type: ignore[attr-defined]
