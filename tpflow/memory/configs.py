"""The published configurations the memory estimate builds its models from, and which recipe backbone uses which.

Why here: the estimate builds the real diffusers classes at full size under ``FakeTensorMode`` (no weights), so it
needs each model's ``config.json`` values without downloading them. Every dictionary is the published file's values
(the source is named beside it) unless its comment says otherwise (UMT5-XXL's sizes are stated, not copied); only
what changes a tensor's shape is needed, the rest keeps diffusers' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpflow.memory.flux2 import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, FLUX2_VAE  # FLUX.2's sizes, sources there
from tpflow.memory.z_image import Z_IMAGE_TRANSFORMER  # Z-Image's size, its source there

SD35_MEDIUM_TRANSFORMER = {  # stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.24 B parameters)
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
SD3_VAE = {  # the SD3 / SD3.5 VAE configuration (stabilityai/stable-diffusion-3.5-medium vae/config.json)
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
SD35_LARGE_TRANSFORMER = SD35_MEDIUM_TRANSFORMER | {  # stabilityai/stable-diffusion-3.5-large transformer/config.json
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
    "dual_attention_layers": (),
}  # 8.1 B parameters
FLUX_DEV_TRANSFORMER = {  # black-forest-labs/FLUX.1-dev transformer/config.json (11.9 B parameters)
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_VAE = SD3_VAE | {"scaling_factor": 0.3611, "shift_factor": 0.1159}  # FLUX.1-dev vae/config.json
QWEN_IMAGE_TRANSFORMER = {  # Qwen/Qwen-Image transformer/config.json (20.4 B parameters)
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWEN_VAE = {  # Qwen/Qwen-Image vae/config.json (the latent mean and std do not change the memory)
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
}  # fmt: skip
QWEN25_VL_7B = {  # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B: 8.29 B parameters with its vision tower)
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584},
    "vocab_size": 152064, "hidden_size": 3584,
}  # fmt: skip
CLIP_L = {  # openai/clip-vit-large-patch14 text_config (SD3 text_encoder, FLUX text_encoder)
    "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
    "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu",
}  # fmt: skip
CLIP_G = {  # laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower (SD3 text_encoder_2/config.json)
    "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32,
    "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu",
}  # fmt: skip
T5_XXL = {  # google/t5-v1_1-xxl encoder (SD3 text_encoder_3, FLUX text_encoder_2 config.json)
    "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
}  # fmt: skip
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (1.42 B parameters): its values as diffusers'
# scripts/convert_wan_to_diffusers.py writes them ("Wan-T2V-1.3B"); rope_max_seq_len is WanTransformer3DModel's default
WAN21_T2V_1_3B_TRANSFORMER = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}  # fmt: skip
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (14.3 B parameters; the same script's "Wan-T2V-14B"); each of
# Wan2.2-T2V-A14B's two experts has this configuration (its "Wan2.2-T2V-A14B" entry, both stages)
WAN21_T2V_14B_TRANSFORMER = WAN21_T2V_1_3B_TRANSFORMER | {
    "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
}  # fmt: skip
# AutoencoderKLWan() defaults: the Wan2.1 VAE (base_dim 96, z_dim 16, 4x temporal and 8x spatial compression), which
# the same script builds for Wan2.1 and Wan2.2-A14B alike (127 M parameters)
WAN_VAE: dict = {}
# The UMT5-XXL encoder of the Wan T2V pipelines (text_encoder, google/umt5-xxl's encoder): NOT a copied config.json,
# the sizes stated here (T5-XXL's with UMT5's 256384-token vocabulary); its parameters (5.68 B) are counted from it on
# the meta device
UMT5_XXL = {
    "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
    "feed_forward_proj": "gated-gelu",
}  # fmt: skip

# The test sizes of docs/architecture.md (tiny-sd3 / tiny-flux / tiny-wan) for ``tiny_setup`` and the estimator's
# --tiny mode (two blocks so that gradient checkpointing has something to save).
TINY_SD3 = {
    "sample_size": 32, "patch_size": 1, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4, "caption_projection_dim": 32, "joint_attention_dim": 32, "pooled_projection_dim": 64,
    "out_channels": 4, "dual_attention_layers": (0,), "qk_norm": "rms_norm",
}  # fmt: skip
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 4, 8),
    "guidance_embeds": True,
}  # fmt: skip
TINY_WAN = {  # tiny-wan's transformer (tpflow/backbones/tiny.py, tiny_wan_pipeline)
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4, "out_channels": 4,
    "text_dim": 32, "freq_dim": 32, "ffn_dim": 32, "num_layers": 2, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
}  # fmt: skip
TINY_WAN_VAE = {  # tiny-wan's VAE: 4 latent channels, 8x spatial and 4x temporal compression as the real one
    "base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True], "latents_mean": [0.1, -0.2, 0.0, 0.3],
    "latents_std": [1.5, 0.8, 1.0, 1.2],
}  # fmt: skip
TINY_VAE = {
    "block_out_channels": (4,), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 1,
    "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip


@dataclass(frozen=True)
class Model:
    """What the estimate builds for one registered backbone: the family tpflow wraps it in and its configurations."""

    title: str  # as the report names it
    kind: str  # "sd3", "flux", "kontext", "qwen", "qwen-edit", "flux2-*", "z-image" or "wan": which tpflow backbone
    # class and which conditioning shapes
    transformer: dict
    vae: dict


# Registered backbone name -> the published model it loads. The tiny backbones are built by their own registered
# factories instead (``tpflow.memory.measure.TINY_BACKBONES``): they are real models of their real (test) size.
PUBLISHED = {
    "sd3.5-medium": Model("SD3.5-Medium", "sd3", SD35_MEDIUM_TRANSFORMER, SD3_VAE),
    "sd3.5-large": Model("SD3.5-Large", "sd3", SD35_LARGE_TRANSFORMER, SD3_VAE),
    "flux.1-dev": Model("FLUX.1-dev", "flux", FLUX_DEV_TRANSFORMER, FLUX_VAE),
    "flux.1-kontext-dev": Model("FLUX.1-Kontext-dev", "kontext", FLUX_DEV_TRANSFORMER, FLUX_VAE),  # x2 tokens: source
    "qwen-image": Model("Qwen-Image", "qwen", QWEN_IMAGE_TRANSFORMER, QWEN_VAE),
    # Qwen/Qwen-Image-Edit-2509: Qwen-Image's transformer and VAE; its sources' tokens appended (recipe_sources)
    "qwen-image-edit": Model("Qwen-Image-Edit-2509", "qwen-edit", QWEN_IMAGE_TRANSFORMER, QWEN_VAE),
    "z-image": Model("Z-Image", "z-image", Z_IMAGE_TRANSFORMER, FLUX_VAE),  # 6.15 B (tpflow.memory.z_image)
    "z-image-turbo": Model("Z-Image-Turbo", "z-image", Z_IMAGE_TRANSFORMER, FLUX_VAE),
    "flux.2-dev": Model("FLUX.2-dev", "flux2-dev", FLUX2_DEV, FLUX2_VAE),  # 32 B (tpflow.memory.flux2)
    "flux.2-klein-4b": Model("FLUX.2-klein-4B", "flux2-klein-4b", FLUX2_KLEIN_4B, FLUX2_VAE),
    "flux.2-klein-9b": Model("FLUX.2-klein-9B", "flux2-klein-9b", FLUX2_KLEIN_9B, FLUX2_VAE),
    "wan2.1-t2v-1.3b": Model("Wan2.1-T2V-1.3B", "wan", WAN21_T2V_1_3B_TRANSFORMER, WAN_VAE),
    "wan2.1-t2v-14b": Model("Wan2.1-T2V-14B", "wan", WAN21_T2V_14B_TRANSFORMER, WAN_VAE),
    "wan2.2-t2v-a14b": Model("Wan2.2-T2V-A14B", "wan", WAN21_T2V_14B_TRANSFORMER, WAN_VAE),  # two experts of this
}
