"""The Wan video backbones for the estimate: tpflow's ``WanBackbone`` / ``Wan22Backbone`` around diffusers'
``WanTransformer3DModel`` and ``AutoencoderKLWan`` of given configurations, and their prompts' embeddings.

As for the image models (``tpflow.memory.models``), the text encoder (UMT5-XXL) is not built: its parameters are
counted on the meta device and the prompts' embeddings are made at the shapes it gives, [N, max_sequence_length,
text_dim] (the pipeline pads each prompt with zeros to that length), with the negative prompt's [1, L, text_dim]
for the unconditional CFG branch. Wan2.2 (options naming a ``train_expert``) holds two transformers of the one
configuration: the trained expert and the frozen one, in the model dtype (``frozen_expert``).

Built this way, Wan2.2 trains its low-noise expert whatever the recipe names, with the rollout's guidance on both
sides of the boundary: the experts share one configuration, so the memory is the same, and the expert a call runs
is chosen by a data-dependent test (1000·σ ≥ the boundary), which reads False on fake tensors (``LiveBytes``), i.e.
the low-noise side; training the high-noise expert there would leave the training step nothing to back-propagate.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def two_experts(options: Any) -> bool:
    """Whether the options are Wan2.2's (``wan2.2-t2v-a14b``, ``tiny-wan2.2``): they name the expert that trains."""
    return getattr(options, "train_expert", None) is not None


def build_wan_backbone(transformer_cfg: dict, vae_cfg: dict, options: Any) -> Any:
    """tpflow's WanBackbone (Wan22Backbone for Wan2.2's options, its second expert of the same configuration)
    around a transformer and VAE of the given configurations, no text encoder. Call it under FakeTensorMode for full
    sizes, inside ``tpflow.memory.models.fake_module_to`` (which ``build_backbone`` enters). ``options``: the
    recipe's validated backbone section."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from tpflow.backbones.wan import WanBackbone
    from tpflow.backbones.wan22 import BOUNDARY_RATIO, Wan22Backbone

    options = options.model_copy(update={"device": "cpu", "prompt_cache": 0})
    if two_experts(options):  # see the module docstring: the low-noise expert trains here, at the rollout's guidance
        options = options.model_copy(update={"train_expert": "low", "low_noise_guidance": None})
    vae = AutoencoderKLWan(**vae_cfg)
    pipe: Any = types.SimpleNamespace(
        transformer=WanTransformer3DModel(**transformer_cfg),
        transformer_2=WanTransformer3DModel(**transformer_cfg) if two_experts(options) else None,
        vae=vae,
        vae_scale_factor_temporal=vae.config.scale_factor_temporal,
        vae_scale_factor_spatial=vae.config.scale_factor_spatial,
        config=types.SimpleNamespace(boundary_ratio=BOUNDARY_RATIO),
    )
    return (Wan22Backbone if two_experts(options) else WanBackbone)(pipe, options)


def frozen_expert(backbone: Any) -> torch.nn.Module | None:
    """Wan2.2's frozen expert (in the model dtype); None for a one-expert backbone."""
    other = getattr(backbone, "other", None)
    return other if isinstance(other, torch.nn.Module) else None


def wan_conditioning(backbone: Any, rows: int, text_len: int, device: str = "cpu") -> Any:
    """``rows`` prompts' embeddings [rows, L, text_dim] in the backbone's dtype, and the negative prompt's [1, L, D]
    (what ``WanBackbone.encode`` returns; values irrelevant)."""
    from tpflow.types import Conditioning

    dim, dtype = backbone.transformer.config.text_dim, backbone.dtype
    embeds = torch.randn(rows, text_len, dim, dtype=dtype, device=device)  # [rows, L, D]
    negative = {"prompt_embeds": torch.randn(1, text_len, dim, dtype=dtype, device=device)}  # [1, L, D]
    return Conditioning({"prompt_embeds": embeds}, {"negative": negative})


def step_sigmas(backbone: Any) -> tuple[float, float]:
    """(σ, σ_next) of the estimate's training step: (0.6, 0.5), or for Wan2.2 a pair on the trained expert's side
    of its boundary (rows of the frozen expert carry no gradient, and a step of them alone has nothing to
    back-propagate)."""
    expert = getattr(getattr(backbone, "options", None), "train_expert", None)
    if expert is None or not hasattr(backbone, "boundary"):
        return (0.6, 0.5)
    b = backbone.boundary / 1000  # the boundary in σ
    return ((1 + b) / 2, b) if expert == "high" else (b / 2, b / 4)
