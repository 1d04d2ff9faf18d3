"""The Z-Image backbones for the estimate: the published transformer's size, tpflow's ``ZImageBackbone`` around
diffusers' ``ZImageTransformer2DModel`` and ``AutoencoderKL`` of those sizes, and the prompts' embeddings.

As for the other image models (``tpflow.memory.models``), the text encoder is not built: Qwen3-4B (``Qwen3Model``, as
``ZImagePipeline`` loads it: no LM head) is counted on the meta device, and the prompts' embeddings are made at the
shapes it gives, [N, max_sequence_length, 2560] with every row at the full length: the backbone cuts each caption
back to its own tokens (padded by the transformer to a multiple of 32), so a shorter prompt's sequence, and its
activations, are smaller; the estimate is the longest prompt's. The transformer's sequence is the caption's tokens
plus the image's (h/2)·(w/2), one single stream through its 30 layers (its two refiners see each part alone).

Sizes: Tongyi-MAI/Z-Image-Turbo's ``transformer/config.json`` (Z-Image's has the same shapes), which are also
``ZImageTransformer2DModel``'s defaults except ``axes_lens`` (the published [1536, 512, 512]); the VAE is FLUX.1's
``AutoencoderKL`` (Z-Image-Turbo ``vae/config.json``: 16 latent channels, 8x, scale 0.3611 and shift 0.1159, the
values ``tpflow.memory.configs.FLUX_VAE`` holds); Qwen3-4B's sizes are ``tpflow.memory.flux2.QWEN3``'s, the same
model FLUX.2-klein 4B encodes with.
"""

from __future__ import annotations

import types
from typing import Any

import torch

Z_IMAGE_TRANSFORMER = {  # Tongyi-MAI/Z-Image-Turbo transformer/config.json (6.15 B parameters)
    "all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 3840, "n_layers": 30,
    "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-05, "qk_norm": True, "cap_feat_dim": 2560,
    "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
}  # fmt: skip


def z_image_text_encoders() -> dict[str, torch.nn.Module]:
    """Qwen3-4B as ``ZImagePipeline`` loads it (``Qwen3Model``), built on the meta device
    (``tpflow.memory.models.text_encoder_sizes`` counts it)."""
    from transformers import Qwen3Config, Qwen3Model

    from tpflow.memory.flux2 import QWEN3

    with torch.device("meta"):
        return {"Qwen3-4B": Qwen3Model(Qwen3Config(**QWEN3["flux2-klein-4b"]))}


def build_z_image_backbone(transformer_cfg: dict, vae_cfg: dict, options: Any, placing: Any) -> Any:
    """tpflow's ZImageBackbone around a transformer and VAE of the given configurations (no text encoder), placed
    inside the context ``placing`` (``tpflow.memory.models.fake_module_to``). Call it under FakeTensorMode for full
    sizes."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from tpflow.backbones.z_image import ZImageBackbone

    options = options.model_copy(update={"device": "cpu", "prompt_cache": 0})
    pipe: Any = types.SimpleNamespace(
        transformer=ZImageTransformer2DModel(**transformer_cfg),
        vae=AutoencoderKL(**vae_cfg),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's; the shift changes no shape
        vae_scale_factor=2 ** (len(vae_cfg["block_out_channels"]) - 1),
    )
    with placing:
        return ZImageBackbone(pipe, options)


def z_image_conditioning(backbone: Any, rows: int, text_len: int, device: str = "cpu") -> Any:
    """``rows`` prompts' embeddings [rows, L, 2560] at their full length L and the negative prompt's [1, L, 2560],
    as ``ZImageBackbone.encode`` returns them; values irrelevant."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from tpflow.types import Conditioning

    dim, dtype = backbone.transformer.config.cap_feat_dim, backbone.dtype
    embeds = torch.randn(rows, text_len, dim, dtype=dtype, device=device)  # [rows, L, D]
    with unset_fake_temporarily():  # real: the backbone reads the lengths as numbers (a fake tensor has none)
        lengths = torch.full((rows,), text_len, dtype=torch.long, device=device)  # [rows]
    negative = {"prompt_embeds": embeds[:1].clone(), "lengths": lengths[:1].clone()}
    return Conditioning({"prompt_embeds": embeds, "lengths": lengths}, {"negative": negative})
