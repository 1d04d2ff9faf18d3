"""The FLUX.2 backbones for the estimate: their published sizes, tpflow's ``Flux2Backbone`` around diffusers'
``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2`` of those sizes, and the prompts' embeddings.

As for the other image models (``tpflow.memory.models``), the text encoder is not built: its parameters are counted
on the meta device (Mistral-Small-3's 24 B with its Pixtral tower for dev, Qwen3-4B / Qwen3-8B with their LM heads
for klein, as the pipelines load them), and the prompts' embeddings are made at the shapes it gives,
[N, max_sequence_length, 3·hidden] (three stacked layers), with klein's empty negative prompt's for CFG. The estimate
is of text-to-image: an editing prompt adds its references' tokens, (H/16)·(W/16) per source of the output's size,
to every transformer call's sequence.

Sizes: the transformers' are those diffusers' ``scripts/convert_flux2_to_diffusers.py`` writes (github.com/
huggingface/diffusers, ``get_flux2_transformer_config``: "flux2-dev", "klein-4b", "klein-9b"; the rest is
``Flux2Transformer2DModel``'s defaults, which are dev's); the VAE is ``AutoencoderKLFlux2()``'s defaults, which the
same script converts; the text encoders' sizes are stated here, not copied from their config.json files.
"""

from __future__ import annotations

import types
from typing import Any

import torch

FLUX2_DEV = {"num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48, "joint_attention_dim": 15360}  # 32 B
FLUX2_KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680,
                  "guidance_embeds": False}  # fmt: skip
FLUX2_KLEIN_9B = {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288,
                  "guidance_embeds": False}  # fmt: skip
FLUX2_VAE: dict = {}  # AutoencoderKLFlux2() defaults: 32 latent channels, 8x
MISTRAL_SMALL_3 = {  # Mistral3ForConditionalGeneration, 24 B: the Mistral text model and its Pixtral vision tower
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14},
    "spatial_merge_size": 2, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3 = {  # Qwen3ForCausalLM: Qwen3-4B (klein 4B's encoder, tied LM head) and Qwen3-8B (klein 9B's)
    "flux2-klein-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                       "tie_word_embeddings": True},
    "flux2-klein-9b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                       "tie_word_embeddings": False},
}  # fmt: skip


def flux2_text_encoders(kind: str) -> dict[str, torch.nn.Module]:
    """The text encoder of ``kind`` ("flux2-dev", "flux2-klein-4b" or "flux2-klein-9b") by name, built on the meta
    device (``tpflow.memory.models.text_encoder_sizes`` counts it)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        if kind == "flux2-dev":
            return {"Mistral-Small-3 24B": Mistral3ForConditionalGeneration(Mistral3Config(**MISTRAL_SMALL_3))}
        name = "Qwen3-4B" if kind == "flux2-klein-4b" else "Qwen3-8B"
        return {name: Qwen3ForCausalLM(Qwen3Config(**QWEN3[kind]))}


def build_flux2_backbone(transformer_cfg: dict, vae_cfg: dict, options: Any, placing: Any) -> Any:
    """tpflow's Flux2Backbone around a transformer and VAE of the given configurations (no text encoder; klein as
    its base variant, so a guidance > 1 runs its CFG branch), placed inside the context ``placing``
    (``tpflow.memory.models.fake_module_to``). Call it under FakeTensorMode for full sizes."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    from tpflow.backbones.flux2 import Flux2Backbone

    options = options.model_copy(update={"device": "cpu", "prompt_cache": 0})
    vae = AutoencoderKLFlux2(**vae_cfg)
    pipe: Any = types.SimpleNamespace(
        transformer=Flux2Transformer2DModel(**transformer_cfg),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
        config=types.SimpleNamespace(is_distilled=False),
        _prepare_latent_ids=Flux2Pipeline._prepare_latent_ids,
        _prepare_text_ids=Flux2Pipeline._prepare_text_ids,
        _pack_latents=Flux2Pipeline._pack_latents,
        _unpatchify_latents=Flux2Pipeline._unpatchify_latents,
    )
    with placing:
        return Flux2Backbone(pipe, options)


def flux2_conditioning(backbone: Any, rows: int, text_len: int, device: str = "cpu") -> Any:
    """``rows`` prompts' embeddings [rows, L, 3·hidden] in the backbone's dtype (klein: and the negative prompt's
    [1, L, D]), as ``Flux2Backbone.encode`` returns them for text-to-image; values irrelevant."""
    from tpflow.types import Conditioning

    dim, dtype = backbone.transformer.config.joint_attention_dim, backbone.dtype
    embeds = torch.randn(rows, text_len, dim, dtype=dtype, device=device)  # [rows, L, D]
    extras: dict[str, Any] = {"txt_ids": backbone.txt_ids, "img_ids": backbone.img_ids}
    if backbone.cfg:
        extras["negative"] = torch.randn(1, text_len, dim, dtype=dtype, device=device)  # [1, L, D]
    return Conditioning({"prompt_embeds": embeds}, extras)
