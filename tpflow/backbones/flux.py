"""Backbone ``flux.1-dev``: FLUX.1-dev through diffusers, with a peft LoRA adapter.

    [backbone]
    name = "flux.1-dev"
    pretrained = "black-forest-labs/FLUX.1-dev"   # or a local folder in diffusers layout
    dtype = "bf16"

FLUX is guidance-distilled: the guidance scale enters as an embedding (3.5 in the paper's runs) and there is no
CFG branch. Latents are packed 2×2 patches, [N, (H/16)·(W/16), 4·C] (C = 16), with image position ids shared by
the batch; the schedule is ``linspace(1, 1/K, K)`` with the resolution-dependent dynamic shift, all as in
``FluxPipeline.__call__``. Text: CLIP-L pooled + T5-XXL sequence through the pipeline's ``encode_prompt``.
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
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.devices import randn
from tpflow.registry import register
from tpflow.types import Conditioning

FLUX_LORA_TARGETS = (  # docs/algorithm.md §6.3: attention projections plus both feed-forward networks
    *JOINT_ATTENTION,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


class FluxOptions(DiffusersBackboneOptions):
    """Options of ``flux.1-dev`` (paper defaults: bf16, 512 px, LoRA r=64, alpha=128)."""

    pretrained: str = Field("black-forest-labs/FLUX.1-dev", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    max_sequence_length: int = Field(512, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_rank: int = Field(64, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(128.0, gt=0, description=option_help.LORA_ALPHA)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(FLUX_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    time_shift: float | None = Field(None, gt=0, description=option_help.TIME_SHIFT)


class FluxBackbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``FluxPipeline``'s components.

    Latents: packed [N, S, 4·C] float32 with S = (H/2f)·(W/2f). ``cond.tensors``: ``prompt_embeds`` [N, L, D] and
    ``pooled`` [N, P]; ``extras`` holds ``txt_ids`` [L, 3] and ``img_ids`` [S, 3], shared by every row.
    ``velocity``'s ``guidance`` is the distilled guidance scale (ignored by models without a guidance embedding).
    """

    def __init__(self, pipe: Any, options: DiffusersBackboneOptions) -> None:
        parts = setup_pipeline(pipe, options, ("text_encoder", "text_encoder_2"))
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.scale, self.cache = parts.transformer, parts.vae, parts.scale, parts.cache
        side = 2 * (options.resolution // (self.scale * 2))  # unpacked latent side, as the pipeline rounds it
        self.latent_side = side
        self.channels = self.transformer.config.in_channels // 4
        self.img_ids = pipe._prepare_latent_image_ids(1, side // 2, side // 2, self.device, self.dtype)  # [S, 3]
        self._txt_ids: Tensor | None = None

    # ---- text ----------------------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            embeds, pooled, txt_ids = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                device=self.text_device,
                num_images_per_prompt=1,
                max_sequence_length=self.options.max_sequence_length,
            )
        self._txt_ids = txt_ids.to(self.device, self.dtype)
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Prompt embeddings [N, L, D], pooled CLIP embeddings [N, P]; text and image ids in ``extras``."""
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        if self._txt_ids is None:  # every prompt came from the cache: ids are zeros of the sequence length
            self._txt_ids = torch.zeros(tensors["prompt_embeds"].shape[1], 3, device=self.device, dtype=self.dtype)
        return Conditioning(tensors=tensors, extras={"txt_ids": self._txt_ids, "img_ids": self.img_ids})

    # ---- sampling ------------------------------------------------------------------------------------------

    def pack(self, z: Tensor) -> Tensor:
        """[N, C, h, w] -> [N, (h/2)·(w/2), 4·C] (the pipeline's 2×2 patch packing)."""
        n, c, h, w = z.shape
        return z.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, (h // 2) * (w // 2), c * 4)

    def unpack(self, z: Tensor) -> Tensor:
        """Inverse of ``pack``: [N, S, 4·C] -> [N, C, h, w]."""
        n, _, packed = z.shape
        h = w = self.latent_side
        return z.view(n, h // 2, w // 2, packed // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, packed // 4, h, w)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I) drawn unpacked [n, C, h, w] as the pipeline draws it, returned packed [n, S, 4·C] float32."""
        shape = (n, self.channels, self.latent_side, self.latent_side)
        return self.pack(randn(shape, generator, self.device))  # drawn on the generator's device (tpflow.devices)

    def sigmas(self, num_steps: int) -> Tensor:
        """linspace(1, 1/K, K) shifted by mu(image tokens), or by ``time_shift`` when set, plus the final 0:
        [K + 1] float32."""
        shift = getattr(self.options, "time_shift", None)
        return scheduler_sigmas(self.pipe.scheduler, num_steps, self.img_ids.shape[0], True, static_shift=shift)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The transformer's velocity with the distilled guidance embedding (one call, no CFG branch)."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        g = None
        if self.transformer.config.guidance_embeds:
            g = torch.full((n,), float(guidance), device=z.device, dtype=torch.float32)
        v = self.transformer(
            hidden_states=z.to(self.dtype),
            timestep=t.to(self.dtype),
            guidance=g,
            pooled_projections=cond.tensors["pooled"],
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            txt_ids=cond.extras["txt_ids"],
            img_ids=cond.extras["img_ids"],
            return_dict=False,
        )[0]
        return v.float()

    def decode(self, z: Tensor) -> Tensor:
        """Packed latents to images [N, 3, H, W] float32 in [0, 1] through the fp32 VAE."""
        return decode_latents(self.vae, self.unpack(z.float()))


@register("backbone", "flux.1-dev", options=FluxOptions)
def flux_1_dev(options: FluxOptions) -> FluxBackbone:
    """FLUX.1-dev from a hub id (local HF cache) or a local folder; fails fast, naming what is missing."""
    from diffusers import FluxPipeline

    pipe = load_pipeline(
        FluxPipeline, options.pretrained, DTYPES[options.dtype], "FLUX.1-dev", fp32=fp32_parts(options)
    )
    return FluxBackbone(pipe, options)


def flux_static_sigmas(options: Any, num_steps: int, scheduler: Any | None = None, scale: int = 8) -> Any:
    """``FluxBackbone.sigmas`` before building (capability ``static_sigmas``), ``time_shift`` included."""
    return packed_sigmas(options, num_steps, scheduler, scale, getattr(options, "time_shift", None))


flux_1_dev.static_sigmas = flux_static_sigmas  # type: ignore[attr-defined]
flux_1_dev.cfg_branch = False  # guidance-distilled: the scale is an embedding, no unconditional branch


attach_preflight(flux_1_dev, "FluxTransformer2DModel", "FLUX.1-dev")
