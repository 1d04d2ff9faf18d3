"""Backbone ``qwen-image``: Qwen-Image through diffusers, with a peft LoRA adapter.

    [backbone]
    name = "qwen-image"
    pretrained = "Qwen/Qwen-Image"    # or a local folder in diffusers layout
    dtype = "bf16"

What differs from SD3 and FLUX, all as ``QwenImagePipeline.__call__`` does it: text through the pipeline's own
``encode_prompt`` (Qwen2.5-VL's last hidden state over its chat template, the template's first 34 tokens dropped,
a mask over the prompt's tokens; tpflow pads every prompt's embedding to ``max_sequence_length`` with the mask
zero there, so prompts batch and cache alike and the masked tokens change nothing); 2×2-packed latents
[N, (H/16)·(W/16), 4·C] drawn unpacked [N, 1, C, h, w] as the pipeline draws them; the schedule
``linspace(1, 1/K, K)`` with the resolution-dependent shift of the model's scheduler (``scheduler_sigmas``, FLUX's
call); the transformer called with σ (the pipeline's t/1000) and the image shapes; true CFG with a negative prompt
(default " ", the model card's), v = v_u + w·(v_c − v_u) rescaled per token to the conditional prediction's norm,
both branches in one call; decoding through the video-style VAE with its per-channel latent mean and std.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.diffusers_common import (
    DTYPES,
    DiffusersBackboneOptions,
    attach_preflight,
    fp32_parts,
    load_pipeline,
    scheduler_sigmas,
    setup_pipeline,
)
from tpflow.backbones.diffusers_lora import AdapterMethods
from tpflow.backbones.lora_targets import JOINT_ATTENTION
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.devices import randn
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.types import Conditioning

# the double-stream blocks' attention projections (Flow-GRPO's and Flow-Factory's default)
QWEN_LORA_TARGETS = JOINT_ATTENTION


class QwenImageOptions(DiffusersBackboneOptions):
    """Options of ``qwen-image`` (bf16, 1024 px as the model card, LoRA r=32, alpha=64 on the attention)."""

    pretrained: str = Field("Qwen/Qwen-Image", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    resolution: int = Field(1024, ge=16, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(128, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(QWEN_LORA_TARGETS),
        description=option_help.LORA_TARGETS,
    )
    negative_prompt: str = Field(" ", description=option_help.NEGATIVE_PROMPT)


class QwenImageBackbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``QwenImagePipeline``'s components.

    Latents: packed [N, S, 4·C] float32, S = (h/2)·(w/2). ``cond.tensors``: ``prompt_embeds`` [N, L, D] and
    ``mask`` [N, L] (L = ``max_sequence_length``); ``extras``: the negative prompt's, and the image shapes."""

    def __init__(self, pipe: Any, options: QwenImageOptions) -> None:
        parts = setup_pipeline(pipe, options, ("text_encoder",))
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.scale, self.cache = parts.transformer, parts.vae, parts.scale, parts.cache
        self.latent_side = 2 * (options.resolution // (self.scale * 2))  # unpacked latent side, as the pipeline
        self.channels = self.transformer.config.in_channels // 4
        self._negative: dict[str, Tensor] | None = None

    # ---- text ----------------------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        length = self.options.max_sequence_length
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt(
                prompt=prompts, device=self.text_device, num_images_per_prompt=1, max_sequence_length=length
            )
        n, used = embeds.shape[:2]
        if mask is None:
            mask = torch.ones((n, used), dtype=torch.long, device=embeds.device)
        padded = embeds.new_zeros((n, length, embeds.shape[2]))
        padded[:, :used] = embeds
        full = mask.new_zeros((n, length))
        full[:, :used] = mask
        return {"prompt_embeds": padded.to(self.dtype), "mask": full}

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Prompt embeddings [N, L, D] and their masks [N, L] (cached per prompt when ``prompt_cache``)."""
        if self._negative is None:
            neg = self._encode_text([self.options.negative_prompt])
            self._negative = {k: v.to(self.device) for k, v in neg.items()}
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        return Conditioning(tensors=tensors, extras={"negative": self._negative})

    # ---- sampling ------------------------------------------------------------------------------------------

    def pack(self, z: Tensor) -> Tensor:
        """[N, C, h, w] -> [N, (h/2)·(w/2), 4·C] (the pipeline's ``_pack_latents``)."""
        n, c, h, w = z.shape
        return self.pipe._pack_latents(z, n, c, h, w)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I) drawn [n, 1, C, h, w] as the pipeline draws it, returned packed [n, S, 4·C] float32."""
        side = self.latent_side
        z = randn((n, 1, self.channels, side, side), generator, self.device)  # the generator's device (tpflow.devices)
        return self.pack(z[:, 0])

    def sigmas(self, num_steps: int) -> Tensor:
        """linspace(1, 1/K, K) shifted by mu(image tokens) as the pipeline does, plus the final 0: [K + 1] float32."""
        return scheduler_sigmas(self.pipe.scheduler, num_steps, (self.latent_side // 2) ** 2, flux_style=True)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The transformer's velocity; with ``guidance`` > 1 the pipeline's true CFG (norm-rescaled), both branches
        in one call as [negative; conditional]."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        embeds, mask, x = cond.tensors["prompt_embeds"], cond.tensors["mask"], z.to(self.dtype)
        cfg = guidance > 1
        if cfg:
            neg = cond.extras["negative"]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            mask = torch.cat([neg["mask"].expand(n, -1), mask])
            x, t = torch.cat([x, x]), t.repeat(2)
        side = self.latent_side // 2
        v = self.transformer(
            hidden_states=x,
            timestep=t.to(self.dtype),
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, side, side)]] * x.shape[0],
            return_dict=False,
        )[0].float()
        if not cfg:
            return v
        v_neg, v_cond = v.chunk(2)
        combined = combine(v_neg, v_cond, guidance)  # v_neg a constant under cfg_gradient = "conditional"
        return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def decode(self, z: Tensor) -> Tensor:
        """Packed latents to images [N, 3, H, W] float32 in [0, 1]: the VAE's latent mean and std undone, fp32."""
        height = width = self.latent_side * self.scale
        latents = self.pipe._unpack_latents(z.float(), height, width, self.scale)  # [N, C, 1, h, w]
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        with torch.no_grad():
            image = self.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


@register("backbone", "qwen-image", options=QwenImageOptions)
def qwen_image(options: QwenImageOptions) -> QwenImageBackbone:
    """Qwen-Image (a 20 B MMDiT with a Qwen2.5-VL 7 B text encoder) from a hub id (local HF cache) or a local folder;
    fails fast, naming what is missing."""
    from diffusers import QwenImagePipeline

    pipe = load_pipeline(
        QwenImagePipeline, options.pretrained, DTYPES[options.dtype], "Qwen-Image", fp32=fp32_parts(options)
    )
    return QwenImageBackbone(pipe, options)


attach_preflight(qwen_image, "QwenImageTransformer2DModel", "Qwen-Image")
qwen_image.static_sigmas = packed_sigmas  # type: ignore[attr-defined]  # the schedule before loading
