"""Backbone ``sd3.5-medium``: Stable Diffusion 3.5 Medium through diffusers, with a peft LoRA adapter.

    [backbone]
    name = "sd3.5-medium"
    pretrained = "stabilityai/stable-diffusion-3.5-medium"   # or a local folder in diffusers layout
    dtype = "fp16"                                           # the paper's; "bf16" also works

Everything but the adapter is frozen: transformer base weights, VAE (fp32, decode only) and the three text
encoders (CLIP-L, CLIP-G, T5-XXL). Text goes through the pipeline's own ``encode_prompt`` and the velocity through
the same transformer call as ``StableDiffusion3Pipeline.__call__`` (timestep = 1000·σ, CFG with the empty-prompt
embedding batched as [uncond; cond] in one call), so a rollout with noise level 0 is the pipeline's sampling loop.
Latents stay float32 between steps (the sampler's log-prob needs it); the transformer sees its own dtype.
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
    decode_latents,
    fp32_parts,
    load_pipeline,
    scheduler_sigmas,
    setup_pipeline,
)
from tpflow.backbones.diffusers_lora import AdapterMethods
from tpflow.backbones.lora_targets import JOINT_ATTENTION
from tpflow.devices import randn
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.types import Conditioning

SD3_LORA_TARGETS = JOINT_ATTENTION  # docs/algorithm.md §6.3: the joint attention projections of every block


class SD3Options(DiffusersBackboneOptions):
    """Options of ``sd3.5-medium`` (paper defaults: fp16, 512 px, LoRA r=32, alpha=64, Gaussian init)."""

    pretrained: str = Field("stabilityai/stable-diffusion-3.5-medium", description=option_help.PRETRAINED)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(SD3_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)


class SD3Backbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``StableDiffusion3Pipeline``'s components.

    Latents: [N, 16, H/8, W/8] float32 for SD3.5 (C, H/f, W/f in general). ``cond.tensors``: ``prompt_embeds``
    [N, L, D] and ``pooled`` [N, P] in the transformer dtype; the unconditional row is kept once in ``extras``.
    """

    pipeline_class_name = "StableDiffusion3Pipeline"

    def __init__(self, pipe: Any, options: DiffusersBackboneOptions) -> None:
        parts = setup_pipeline(pipe, options, ("text_encoder", "text_encoder_2", "text_encoder_3"))
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.scale, self.cache = parts.transformer, parts.vae, parts.scale, parts.cache
        self._negative: dict[str, Tensor] | None = None

    # ---- text ----------------------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=self.text_device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=False,
                max_sequence_length=self.options.max_sequence_length,
            )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Prompt embeddings [N, L, D] and pooled embeddings [N, P] (cached per prompt when ``prompt_cache``)."""
        if self._negative is None:
            neg = self._encode_text([getattr(self.options, "negative_prompt", "")])
            self._negative = {k: v.to(self.device) for k, v in neg.items()}
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        return Conditioning(tensors=tensors, extras={"negative": self._negative})

    # ---- sampling ------------------------------------------------------------------------------------------

    def latent_shape(self) -> tuple[int, ...]:
        size = self.options.resolution // self.scale
        return (self.transformer.config.in_channels, size, size)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I): [n, C, H/f, W/f] float32 on the model's device, drawn on the generator's device (the CPU
        by tpflow's rule, ``tpflow.devices``) as the pipeline draws it."""
        return randn((n, *self.latent_shape()), generator, self.device)

    def sigmas(self, num_steps: int) -> Tensor:
        """σ_0..σ_K from the model's scheduler config (SD3.5: static shift 3), [K + 1] float32."""
        _, h, w = self.latent_shape()
        patch = self.transformer.config.patch_size
        return scheduler_sigmas(self.pipe.scheduler, num_steps, (h // patch) * (w // patch), flux_style=False)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v = v_u + w·(v_c − v_u) from ONE transformer call on [z; z] (w = 1: the conditional call alone)."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n) * 1000
        embeds, pooled = cond.tensors["prompt_embeds"], cond.tensors["pooled"]
        x = z.to(self.dtype)
        if guidance != 1:
            neg = cond.extras["negative"]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            pooled = torch.cat([neg["pooled"].expand(n, -1), pooled])
            x, t = torch.cat([x, x]), t.repeat(2)
        v = self.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
        )[0].float()
        if guidance == 1:
            return v
        v_uncond, v_cond = v.chunk(2)
        return combine(v_uncond, v_cond, guidance)

    def decode(self, z: Tensor) -> Tensor:
        """Latents to images [N, 3, H, W] float32 in [0, 1] through the fp32 VAE (the pipeline's scaling)."""
        return decode_latents(self.vae, z.float())


@register("backbone", "sd3.5-medium", options=SD3Options)
def sd35_medium(options: SD3Options) -> SD3Backbone:
    """SD3.5-Medium from a hub id (local HF cache) or a local folder; fails fast, naming what is missing."""
    from diffusers import StableDiffusion3Pipeline

    pipe = load_pipeline(
        StableDiffusion3Pipeline, options.pretrained, DTYPES[options.dtype], "SD3.5-Medium", fp32=fp32_parts(options)
    )
    return SD3Backbone(pipe, options)


attach_preflight(sd35_medium, "SD3Transformer2DModel", "SD3.5-Medium")


class SD3LargeOptions(SD3Options):
    """Options of ``sd3.5-large``: the SD3 backbone with the Large checkpoint's defaults (bf16, its model card's
    1 megapixel, 1024 px; LoRA on the joint attention projections as for Medium: Large has no second attention)."""

    pretrained: str = Field("stabilityai/stable-diffusion-3.5-large", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    resolution: int = Field(1024, ge=16, description=option_help.RESOLUTION)


@register("backbone", "sd3.5-large", options=SD3LargeOptions)
def sd35_large(options: SD3LargeOptions) -> SD3Backbone:
    """SD3.5-Large (8.1 B transformer, 38 joint blocks) from a hub id (local HF cache) or a local folder; the same
    backbone as SD3.5-Medium, whose code reads everything else from the checkpoint's configs."""
    from diffusers import StableDiffusion3Pipeline

    pipe = load_pipeline(
        StableDiffusion3Pipeline, options.pretrained, DTYPES[options.dtype], "SD3.5-Large", fp32=fp32_parts(options)
    )
    return SD3Backbone(pipe, options)


attach_preflight(sd35_large, "SD3Transformer2DModel", "SD3.5-Large")
