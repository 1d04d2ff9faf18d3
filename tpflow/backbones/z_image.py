"""Backbones ``z-image`` and ``z-image-turbo``: Tongyi-MAI's Z-Image through diffusers, with a peft LoRA adapter.

    [backbone]
    name = "z-image"           # or "z-image-turbo" (the few-step distilled model, run without CFG)
    pretrained = "Tongyi-MAI/Z-Image"
    dtype = "bf16"

What differs from SD3, all as ``ZImagePipeline.__call__`` does it: text through the pipeline's own ``encode_prompt``
(Qwen3's second-to-last hidden state over its chat template, one tensor per prompt holding only its own tokens: the
transformer pads each caption with a learned token to a multiple of 32, so a prompt's length changes its velocity
and zero padding would not do; tpflow stores the rows zero-padded to ``max_sequence_length`` with their lengths, so
the rollout can index and repeat them, and cuts each back to its length for the call); latents [N, C, h, w] handed
to the transformer as a list of [C, 1, h, w]; the schedule ``linspace(1, 1/K, K)`` shifted by the model's scheduler
with the pipeline's ``mu`` (FLUX's call, ``scheduler_sigmas``); the transformer takes 1 − σ (the pipeline's
(1000 − t)/1000) and predicts the negative velocity. CFG is the pipeline's: both branches in one call,
pos + s·(pos − neg) with the pipeline's ``guidance_scale`` s, which is tpflow's v_u + w·(v_c − v_u) at w = s + 1
(so the model card's s = 4 is ``guidance = 5``, and w = 1 runs the conditional branch alone, the pipeline's s = 0);
its options ``cfg_normalization`` (the guided prediction's norm capped at k times the conditional one's) and
``cfg_truncation`` (no CFG once 1 − σ exceeds it), both off by default as in the pipeline. Z-Image-Turbo is
distilled to run without CFG (its model card: ``guidance_scale=0``): its guidance must be 1, refused otherwise
before anything loads.
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
    pipeline_class,
    scheduler_sigmas,
    setup_pipeline,
)
from tpflow.backbones.diffusers_lora import AdapterMethods
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.devices import randn
from tpflow.errors import UserError
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.types import Conditioning

# Flow-Factory's Z-Image default (X-GenGroup/Flow-Factory a0b2bc5, models/z_image/z_image.py): the attention
# projections and the SwiGLU feed-forward of every block (main layers and both refiners)
ZIMAGE_LORA_TARGETS = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
CFG_NORMALIZATION = (
    "ZImagePipeline's cfg_normalization: 0 off (its default); k > 0 scales each guided prediction down to at most k "
    "times the norm of its conditional one."
)
CFG_TRUNCATION = (
    "ZImagePipeline's cfg_truncation: CFG only while 1 − σ is at most this, the conditional branch alone after; 1 "
    "(its default) keeps CFG on every step."
)


class ZImageTurboOptions(DiffusersBackboneOptions):
    """Options of ``z-image-turbo`` (bf16, 1024 px and 512 text tokens as the pipeline; LoRA r 64, α 128 on
    Flow-Factory's targets). No CFG options: the distilled model runs the conditional branch alone."""

    pretrained: str = Field("Tongyi-MAI/Z-Image-Turbo", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    resolution: int = Field(1024, ge=16, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(512, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_rank: int = Field(64, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(128.0, gt=0, description=option_help.LORA_ALPHA)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(ZIMAGE_LORA_TARGETS), description=option_help.LORA_TARGETS
    )


class ZImageOptions(ZImageTurboOptions):
    """Options of ``z-image``: the turbo ones with the base checkpoint and the pipeline's CFG options."""

    pretrained: str = Field("Tongyi-MAI/Z-Image", description=option_help.PRETRAINED)
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)
    cfg_normalization: float = Field(0.0, ge=0.0, description=CFG_NORMALIZATION)
    cfg_truncation: float = Field(1.0, ge=0.0, le=1.0, description=CFG_TRUNCATION)


def captions(embeds: Tensor, lengths: Tensor) -> list[Tensor]:
    """Padded rows [N, L, D] and their lengths [N] back to the pipeline's list of [length_i, D]."""
    return [row[:length] for row, length in zip(embeds, lengths.tolist(), strict=True)]


class ZImageBackbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``ZImagePipeline``'s components.

    Latents: [N, C, h, w] float32, h = w = 2·(resolution // (2·f)). ``cond.tensors``: ``prompt_embeds`` [N, L, D]
    (zeros past each prompt's tokens; L = ``max_sequence_length``) and ``lengths`` [N] int64; the negative prompt's
    are kept once in ``extras``."""

    def __init__(self, pipe: Any, options: ZImageTurboOptions) -> None:
        parts = setup_pipeline(pipe, options, ("text_encoder",))
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.scale, self.cache = parts.transformer, parts.vae, parts.scale, parts.cache
        if options.resolution % (2 * self.scale):
            raise UserError(
                f"[backbone] resolution = {options.resolution}: Z-Image takes a multiple of {2 * self.scale} (twice "
                "its VAE's factor, the 2×2 patches), as ZImagePipeline requires. Round it to one."
            )
        self.latent_side = options.resolution // self.scale
        self._negative: dict[str, Tensor] | None = None

    # ---- text ----------------------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        length = self.options.max_sequence_length
        with torch.no_grad():  # a copy: the pipeline writes the templated prompts into the list it is given
            embeds, _ = self.pipe.encode_prompt(
                prompt=list(prompts), device=self.text_device, do_classifier_free_guidance=False,
                max_sequence_length=length,
            )  # fmt: skip
        padded = embeds[0].new_zeros((len(embeds), length, embeds[0].shape[-1]))
        for i, row in enumerate(embeds):
            padded[i, : row.shape[0]] = row
        lengths = torch.tensor([row.shape[0] for row in embeds], dtype=torch.long, device=padded.device)
        return {"prompt_embeds": padded.to(self.dtype), "lengths": lengths}

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Prompt embeddings [N, L, D] and their lengths [N] (cached per prompt when ``prompt_cache``)."""
        if self._negative is None:
            neg = self._encode_text([getattr(self.options, "negative_prompt", "")])
            self._negative = {k: v.to(self.device) for k, v in neg.items()}
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        return Conditioning(tensors=tensors, extras={"negative": self._negative})

    # ---- sampling ------------------------------------------------------------------------------------------

    def latent_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, self.latent_side, self.latent_side)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I): [n, C, h, w] float32 on the model's device, drawn on the generator's device as the
        pipeline's ``prepare_latents`` draws it (``tpflow.devices``)."""
        return randn((n, *self.latent_shape()), generator, self.device)

    def sigmas(self, num_steps: int) -> Tensor:
        """linspace(1, 1/K, K) through the model's scheduler with the pipeline's mu of (h/2)·(w/2) tokens (used
        only by a scheduler with dynamic shifting), plus the final 0: [K + 1] float32."""
        return scheduler_sigmas(self.pipe.scheduler, num_steps, (self.latent_side // 2) ** 2, flux_style=True)

    def _transformer(self, x: Tensor, t: Tensor, caps: list[Tensor]) -> Tensor:
        """The pipeline's call: latents [B, C, h, w] as a list of [C, 1, h, w]; returns the velocity [B, C, h, w]
        float32 (the negated prediction)."""
        out = self.transformer(list(x.unsqueeze(2).unbind(0)), t, caps, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v from one transformer call; with ``guidance`` w ≠ 1 the pipeline's CFG at its scale w − 1, both
        branches in one call as [conditional; negative], then its normalisation and truncation options."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        t = (1000 - sigma * 1000) / 1000  # the pipeline's (1000 − t)/1000 of its timestep t = 1000·σ
        caps = captions(cond.tensors["prompt_embeds"], cond.tensors["lengths"])
        if guidance == 1:
            return self._transformer(z.to(self.dtype), t, caps)
        neg = cond.extras["negative"]
        caps += captions(neg["prompt_embeds"], neg["lengths"]) * n
        x = z.to(self.dtype)
        v_cond, v_neg = self._transformer(torch.cat([x, x]), t.repeat(2), caps).chunk(2)
        guided = combine(v_neg, v_cond, guidance)  # v_neg a constant under cfg_gradient = "conditional"
        cap = getattr(self.options, "cfg_normalization", 0.0)
        if cap > 0:  # each row's norm at most cap·‖v_cond‖, as the pipeline caps it
            limit, norm = cap * v_cond.flatten(1).norm(dim=1), guided.flatten(1).norm(dim=1)
            guided = guided * torch.where(norm > limit, limit / norm, torch.ones_like(norm)).view(-1, 1, 1, 1)
        truncation = getattr(self.options, "cfg_truncation", 1.0)
        if truncation < 1:  # past it (1 − σ > truncation) the pipeline runs the conditional branch alone
            guided = torch.where((1 - sigma > truncation).view(-1, 1, 1, 1), v_cond, guided)
        return guided

    def decode(self, z: Tensor) -> Tensor:
        """Latents to images [N, 3, H, W] float32 in [0, 1] through the fp32 VAE (the pipeline's scaling)."""
        return decode_latents(self.vae, z.float())


def turbo_guidance_problems(options: Any, sections: dict) -> list[str]:
    """Z-Image-Turbo's ``check_recipe``: a guidance of 1 at rollout and evaluation (the distilled model's card
    runs it without CFG, the pipeline's guidance_scale 0)."""
    problems = []
    for name in ("rollout", "eval"):
        guidance = getattr(sections.get(name), "guidance", 1)
        if guidance != 1:
            problems.append(
                f"[{name}] guidance = {guidance:g}: Z-Image-Turbo is distilled to sample without classifier-free "
                "guidance (its model card runs ZImagePipeline at guidance_scale 0, which is tpflow's guidance 1: "
                f"the conditional branch alone). Set guidance = 1 in [{name}], or use z-image for CFG."
            )
    return problems


@register("backbone", "z-image", options=ZImageOptions)
def z_image(options: ZImageOptions) -> ZImageBackbone:
    """Z-Image (a 6.15 B single-stream DiT with a Qwen3-4B text encoder) from a hub id (local HF cache) or a local
    folder; fails fast, naming what is missing."""
    ZImagePipeline = pipeline_class("ZImagePipeline", "Z-Image")  # noqa: N806
    pipe = load_pipeline(
        ZImagePipeline, options.pretrained, DTYPES[options.dtype], "Z-Image", fp32=fp32_parts(options)
    )
    return ZImageBackbone(pipe, options)


@register("backbone", "z-image-turbo", options=ZImageTurboOptions)
def z_image_turbo(options: ZImageTurboOptions) -> ZImageBackbone:
    """Z-Image-Turbo (Z-Image distilled to 8 steps without CFG), as ``z-image``."""
    ZImagePipeline = pipeline_class("ZImagePipeline", "Z-Image")  # noqa: N806
    pipe = load_pipeline(
        ZImagePipeline, options.pretrained, DTYPES[options.dtype], "Z-Image-Turbo", fp32=fp32_parts(options)
    )
    return ZImageBackbone(pipe, options)


attach_preflight(z_image, "ZImageTransformer2DModel", "Z-Image")
attach_preflight(z_image_turbo, "ZImageTransformer2DModel", "Z-Image-Turbo")
z_image.static_sigmas = z_image_turbo.static_sigmas = packed_sigmas  # type: ignore[attr-defined]
z_image_turbo.cfg_branch = False  # type: ignore[attr-defined]  # no unconditional branch: guidance 1 only
z_image_turbo.check_recipe = turbo_guidance_problems  # type: ignore[attr-defined]
