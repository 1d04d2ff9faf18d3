"""Backbones ``flux.2-klein-4b``, ``flux.2-klein-9b`` and ``flux.2-dev``: FLUX.2 through diffusers, text-to-image and
reference editing, with a peft LoRA adapter or every transformer weight trained.

    [backbone]
    name = "flux.2-klein-4b"                       # or "flux.2-klein-9b", "flux.2-dev"
    pretrained = "black-forest-labs/FLUX.2-klein-4B"   # or a local folder in diffusers layout
    dtype = "bf16"

What differs from FLUX.1, all as ``Flux2KleinPipeline.__call__`` / ``Flux2Pipeline.__call__`` (diffusers 0.42) do it:

* text: the pipeline's own ``encode_prompt``: klein stacks three hidden layers (9, 18, 27) of Qwen3 over its chat
  template, dev three (10, 20, 30) of Mistral-Small-3 (24 B) after its system message; every prompt is padded to
  ``max_sequence_length`` (no mask), so the text position ids are one [L, 4] table for the batch;
* latents: the VAE's 2×2 patches stacked into channels, then flattened, [N, (h/2)·(w/2), 4·C] (C = 32), drawn in the
  patchified shape as the pipeline draws them, with 4-D position ids (T, H, W, L); decoding undoes the VAE's
  batch-norm statistics and the patches;
* sources: each reference image is prepared as the pipeline prepares it (capped at ``source_max_pixels`` of area,
  cropped to a multiple of 16), VAE-encoded and packed by the pipeline's ``prepare_image_latents``, which gives its
  tokens their own ids (T = 10, 20, ... per image); they are appended to the image tokens of every call and the
  velocity is read from the image tokens alone. A prompt without sources is text-to-image;
* schedule: ``linspace(1, 1/K, K)`` shifted by the pipeline's ``compute_empirical_mu`` of the image tokens and K;
* guidance: dev embeds the guidance scale in one call (guidance-distilled, no CFG branch); klein's base variants
  take CFG with the empty prompt as negative (both branches in one call here), its step-distilled variants
  (``is_distilled`` in the pipeline's config: FLUX.2-klein-4B and -9B) take no guidance at all, as the pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
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
    pipeline_class,
    pretrained_source,
    setup_pipeline,
)
from tpflow.backbones.diffusers_lora import AdapterMethods
from tpflow.backbones.static_schedules import resolved
from tpflow.devices import randn
from tpflow.errors import UserError
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.samplers.schedules import check_num_steps
from tpflow.types import Conditioning

FLUX2_LORA_TARGETS = (  # Flow-Factory's FLUX.2 default: both streams' attention and feed-forward layers
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)  # fmt: skip
SOURCE_MAX_PIXELS = (
    "Largest area (pixels) of a source image: a larger one is resized to it, aspect kept, before it is cropped to "
    "the VAE's grid (the pipeline's cap is 1024·1024; fewer pixels, fewer reference tokens per call)."
)


class Flux2DevOptions(DiffusersBackboneOptions):
    """Options of ``flux.2-dev`` (the pipeline's defaults: bf16, 1024 px, 512 text tokens; LoRA r=64, alpha=128 as
    Flow-Factory's FLUX.2 configs)."""

    pretrained: str = Field("black-forest-labs/FLUX.2-dev", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    resolution: int = Field(1024, ge=16, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(512, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_rank: int = Field(64, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(128.0, gt=0, description=option_help.LORA_ALPHA)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(FLUX2_LORA_TARGETS), description=option_help.LORA_TARGETS
    )
    source_max_pixels: int = Field(1024 * 1024, ge=64 * 64, description=SOURCE_MAX_PIXELS)


class Klein4BOptions(Flux2DevOptions):
    """Options of ``flux.2-klein-4b`` (the step-distilled FLUX.2-klein-4B; or its base variant, CFG, by folder)."""

    pretrained: str = Field("black-forest-labs/FLUX.2-klein-4B", description=option_help.PRETRAINED)


class Klein9BOptions(Flux2DevOptions):
    """Options of ``flux.2-klein-9b`` (the step-distilled FLUX.2-klein-9B; or its base variant, CFG, by folder)."""

    pretrained: str = Field("black-forest-labs/FLUX.2-klein-9B", description=option_help.PRETRAINED)


def flux2_sigmas(scheduler: Any, num_steps: int, image_seq_len: int) -> Tensor:
    """The FLUX.2 pipelines' σ_0..σ_K (final 0 included), [K + 1] float32, from a copy of their scheduler:
    ``linspace(1, 1/K, K)`` and the empirical mu of ``image_seq_len`` tokens and K steps."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    check_num_steps(num_steps)
    sched = type(scheduler).from_config(scheduler.config)
    sigmas = None if sched.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)
    retrieve_timesteps(sched, num_steps, "cpu", sigmas=sigmas, mu=mu)
    return sched.sigmas.to(torch.float32).clone()


def flux2_static_sigmas(options: Any, num_steps: int, scheduler: Any | None = None, scale: int = 8) -> Any:
    """``Flux2Backbone.sigmas`` before building (capability ``static_sigmas``): ``flux2_sigmas`` of the packed tokens
    its ``img_ids`` hold, (resolution // (2·scale))² (``scale``: the VAE's factor, 8 for the real models);
    ``scheduler``: a twin's, else the real model's config (None when not on this machine)."""
    found = resolved(options, scheduler)
    if found is None:
        return None
    return [float(x) for x in flux2_sigmas(found, num_steps, (options.resolution // (2 * scale)) ** 2)]


class Flux2Backbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``Flux2KleinPipeline``'s or ``Flux2Pipeline``'s components.

    Latents: packed [N, S, 4·C] float32, S = (h/2)·(w/2). ``cond.tensors``: ``prompt_embeds`` [N, L, D]; with
    sources, ``ref_latents`` [N, R, 4·C] (each row's reference tokens, zero-padded to the longest) and ``ref_layout``
    [N] (which entry of ``extras["ref_ids"]`` holds the row's reference ids, [R_j, 4]: rows whose sources have the
    same sizes share one). ``extras``: ``txt_ids`` [L, 4], ``img_ids`` [S, 4], klein's ``negative`` prompt."""

    def __init__(self, pipe: Any, options: Flux2DevOptions) -> None:
        parts = setup_pipeline(pipe, options, ("text_encoder",))
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.scale, self.cache = parts.transformer, parts.vae, parts.scale, parts.cache
        self.latent_side = 2 * (options.resolution // (self.scale * 2))  # unpacked latent side, as the pipeline
        self.grid = self.latent_side // 2  # packed tokens per side
        self.channels = self.transformer.config.in_channels  # 4·C: the patchified channels
        grid = torch.zeros(1, 1, self.grid, self.grid)
        self.img_ids = pipe._prepare_latent_ids(grid)[0].to(self.device)  # [S, 4]
        text = torch.zeros(1, options.max_sequence_length, 1)
        self.txt_ids = pipe._prepare_text_ids(text)[0].to(self.device)  # [L, 4]
        self.embedded_guidance = bool(self.transformer.config.guidance_embeds)  # dev
        config = getattr(pipe, "config", None)
        self.cfg = not self.embedded_guidance and not getattr(config, "is_distilled", False)  # klein base
        self._negative: Tensor | None = None

    # ---- text and sources ----------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            embeds, _ = self.pipe.encode_prompt(
                prompt=prompts,
                device=self.text_device,
                num_images_per_prompt=1,
                max_sequence_length=self.options.max_sequence_length,
            )
        return {"prompt_embeds": embeds.to(self.dtype)}

    def _prepared(self, image: Tensor) -> Tensor:
        """One source [3, H, W] in [0, 1] as the pipeline prepares a reference: [1, 3, h, w] in [-1, 1]."""
        from PIL import Image

        pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        picture, processor = Image.fromarray(pixels), self.pipe.image_processor
        try:
            processor.check_image_input(picture)
        except ValueError as exc:
            raise UserError(f"A source image cannot condition FLUX.2: {exc}.") from None
        width, height = picture.size
        if width * height > self.options.source_max_pixels:
            picture = processor._resize_to_target_area(picture, self.options.source_max_pixels)
            width, height = picture.size
        multiple = self.scale * 2
        width, height = width // multiple * multiple, height // multiple * multiple
        return processor.preprocess(picture, height=height, width=width, resize_mode="crop")

    def _encode_sources(self, sources: Sequence[Sequence[Tensor]]) -> tuple[dict[str, Tensor], list[Tensor]]:
        """Each prompt's references through the pipeline's ``prepare_image_latents``: ``ref_latents`` [N, R, 4·C]
        (zero-padded), ``ref_layout`` [N], and the distinct layouts' ids [R_j, 4]."""
        rows, layouts, ids = [], {}, []
        with torch.no_grad():
            for images in sources:
                prepared = [self._prepared(image) for image in images]
                key = tuple(tuple(p.shape[-2:]) for p in prepared)
                if prepared:
                    latents, latent_ids = self.pipe.prepare_image_latents(
                        images=prepared, batch_size=1, generator=None, device=self.device, dtype=self.vae.dtype
                    )  # [1, R, 4·C], [1, R, 4]
                else:
                    latents = torch.zeros(1, 0, self.channels, device=self.device)
                    latent_ids = torch.zeros(1, 0, 4, dtype=torch.long, device=self.device)
                if key not in layouts:
                    layouts[key] = len(ids)
                    ids.append(latent_ids[0].to(self.device))
                rows.append((latents[0], layouts[key]))
        longest = max(latents.shape[0] for latents, _ in rows)
        padded = torch.zeros(len(rows), longest, self.channels, device=self.device, dtype=self.dtype)
        for i, (latents, _) in enumerate(rows):
            padded[i, : latents.shape[0]] = latents.to(self.dtype)
        layout = torch.tensor([k for _, k in rows], dtype=torch.long, device=self.device)
        return {"ref_latents": padded, "ref_layout": layout}, ids

    def encode(self, prompts: Sequence[str], sources: Sequence[Sequence[Tensor]] | None = None) -> Conditioning:
        """Prompt embeddings [N, L, D] (cached per prompt when ``prompt_cache``), and with ``sources`` (a list of
        [3, H, W] images in [0, 1] per prompt, possibly empty) their reference tokens."""
        extras: dict[str, Any] = {"txt_ids": self.txt_ids, "img_ids": self.img_ids}
        if self.cfg:
            if self._negative is None:
                self._negative = self._encode_text([""])["prompt_embeds"].to(self.device)  # the pipeline's negative
            extras["negative"] = self._negative
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        if sources is not None and any(len(images) for images in sources):
            if len(sources) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(sources)} source lists.")
            refs, extras["ref_ids"] = self._encode_sources(sources)
            tensors = {**tensors, **refs}
        return Conditioning(tensors=tensors, extras=extras)

    # ---- sampling ------------------------------------------------------------------------------------------

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I) drawn [n, 4·C, h/2, w/2] as the pipeline draws it, returned packed [n, S, 4·C] float32."""
        z = randn((n, self.channels, self.grid, self.grid), generator, self.device)  # the generator's device
        return self.pipe._pack_latents(z)

    def sigmas(self, num_steps: int) -> Tensor:
        """linspace(1, 1/K, K) shifted by the pipeline's empirical mu(S, K), plus the final 0: [K + 1] float32."""
        return flux2_sigmas(self.pipe.scheduler, num_steps, self.img_ids.shape[0])

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The transformer's velocity on the image tokens, the rows' reference tokens appended; dev: the guidance
        embedding, klein base: CFG. The position ids are one table per call, so rows whose sources differ in size
        take one call per layout, each over every row (a row's velocity read from its layout's call): each call
        keeps the batch's rows in order, as ``recompute = "reweight"``'s per-row rule reads them."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        embeds = cond.tensors["prompt_embeds"]
        if "ref_layout" not in cond.tensors:
            return self._call(z, t, embeds, None, None, cond, guidance)
        refs, layouts, which = cond.tensors["ref_latents"], cond.extras["ref_ids"], cond.tensors["ref_layout"]
        if len(layouts) == 1:
            return self._call(z, t, embeds, refs, layouts[0], cond, guidance)
        v = None
        for k in sorted(set(which.tolist())):  # the layouts these rows have
            v_k = self._call(z, t, embeds, refs, layouts[k], cond, guidance)
            v = v_k if v is None else torch.where((which == k).view(-1, *[1] * (z.dim() - 1)), v_k, v)
        return v

    def _call(
        self, z: Tensor, t: Tensor, embeds: Tensor, refs: Tensor | None, ref_ids: Tensor | None, cond: Conditioning,
        guidance: float,
    ) -> Tensor:  # fmt: skip
        """One transformer call on rows that share their reference layout: [n, S, 4·C] float32."""
        n, tokens = z.shape[:2]
        x, ids = z.to(self.dtype), cond.extras["img_ids"]
        if ref_ids is not None and ref_ids.shape[0]:
            x = torch.cat([x, refs[:, : ref_ids.shape[0]]], dim=1)  # [n, S + R, 4·C]
            ids = torch.cat([ids, ref_ids])  # [S + R, 4]
        g = torch.full((n,), float(guidance), device=z.device) if self.embedded_guidance else None
        cfg = self.cfg and guidance > 1
        if cfg:
            embeds = torch.cat([cond.extras["negative"].expand(n, -1, -1), embeds])
            x, t = torch.cat([x, x]), t.repeat(2)
        v = self.transformer(
            hidden_states=x,
            timestep=t.to(self.dtype),
            guidance=g,
            encoder_hidden_states=embeds,
            txt_ids=cond.extras["txt_ids"],
            img_ids=ids,
            return_dict=False,
        )[0][:, :tokens].float()
        if not cfg:
            return v
        v_neg, v_cond = v.chunk(2)
        return combine(v_neg, v_cond, guidance)  # v_neg a constant under cfg_gradient = "conditional"

    def vae_latents(self, z: Tensor) -> Tensor:
        """Packed latents [N, S, 4·C] to the VAE's [N, C, h, w]: unpacked, its batch-norm statistics undone, the
        2×2 patches put back (the klein pipeline's ``output_type="latent"``)."""
        n = z.shape[0]
        patches = z.float().permute(0, 2, 1).reshape(n, self.channels, self.grid, self.grid)  # _pack_latents undone
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(patches)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(patches)
        return self.pipe._unpatchify_latents(patches * std + mean)

    def decode(self, z: Tensor) -> Tensor:
        """Packed latents to images [N, 3, H, W] float32 in [0, 1] through the fp32 VAE."""
        with torch.no_grad():
            image = self.vae.decode(self.vae_latents(z), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def distilled_problems(options: Flux2DevOptions, settings: dict) -> list[str]:
    """A step-distilled klein checkpoint (``is_distilled`` in its model_index.json, found on this machine) takes no
    guidance: its pipeline ignores the scale and so does the backbone, so a recipe asking for one is refused."""
    source = pretrained_source(options.pretrained, "FLUX.2-klein")
    try:
        index = json.loads((Path(source.path) / "model_index.json").read_text()) if source.path else {}
    except (OSError, ValueError):
        return []  # loading says what is wrong with the folder
    scales = [(name, getattr(settings.get(name), "guidance", 1.0)) for name in ("rollout", "eval")]
    asked = [f"[{name}] guidance = {g:g}" for name, g in scales if g != 1]
    if not index.get("is_distilled") or not asked:
        return []
    return [
        f"[backbone] '{options.pretrained}' is step-distilled (is_distilled in its model_index.json): its pipeline "
        f"ignores the guidance scale and so does tpflow, so {' and '.join(asked)} would sample as guidance 1. Set "
        "guidance = 1, or train a base checkpoint (black-forest-labs/FLUX.2-klein-base-4B or -9B), which takes CFG."
    ]


def _load(options: Flux2DevOptions, klein: bool, model_name: str) -> Flux2Backbone:
    pipeline = pipeline_class("Flux2KleinPipeline" if klein else "Flux2Pipeline", model_name)
    pipe = load_pipeline(pipeline, options.pretrained, DTYPES[options.dtype], model_name, fp32=fp32_parts(options))
    return Flux2Backbone(pipe, options)


@register("backbone", "flux.2-dev", options=Flux2DevOptions)
def flux_2_dev(options: Flux2DevOptions) -> Flux2Backbone:
    """FLUX.2-dev (a 32 B transformer, a Mistral-Small-3 24 B text encoder) from a hub id (local HF cache) or a local
    folder; fails fast, naming what is missing."""
    return _load(options, False, "FLUX.2-dev")


@register("backbone", "flux.2-klein-4b", options=Klein4BOptions)
def flux_2_klein_4b(options: Klein4BOptions) -> Flux2Backbone:
    """FLUX.2-klein 4B (Qwen3-4B text encoder); as ``flux.2-dev``."""
    return _load(options, True, "FLUX.2-klein-4B")


@register("backbone", "flux.2-klein-9b", options=Klein9BOptions)
def flux_2_klein_9b(options: Klein9BOptions) -> Flux2Backbone:
    """FLUX.2-klein 9B (Qwen3-8B text encoder); as ``flux.2-dev``."""
    return _load(options, True, "FLUX.2-klein-9B")


flux_2_dev.cfg_branch = False  # type: ignore[attr-defined]  # guidance-distilled: the scale is an embedding
# references per prompt: Black Forest Labs' guidance (docs.bfl.ai, "Prompting: editing"): dev at most 6, klein 4
flux_2_dev.source_images = (0, 6)  # type: ignore[attr-defined]
flux_2_klein_4b.source_images = flux_2_klein_9b.source_images = (0, 4)  # type: ignore[attr-defined]
attach_preflight(flux_2_dev, "Flux2Transformer2DModel", "FLUX.2-dev")
attach_preflight(flux_2_klein_4b, "Flux2Transformer2DModel", "FLUX.2-klein-4B")
attach_preflight(flux_2_klein_9b, "Flux2Transformer2DModel", "FLUX.2-klein-9B")


def _refuse_guidance_if_distilled(factory: Any) -> None:
    """Add ``distilled_problems`` to a klein factory's ``check_machine`` (``attach_preflight``'s)."""
    machine = factory.check_machine

    def check_machine(options: Flux2DevOptions, settings: dict) -> list[str]:
        return machine(options, settings) + distilled_problems(options, settings)

    factory.check_machine = check_machine


_refuse_guidance_if_distilled(flux_2_klein_4b)
_refuse_guidance_if_distilled(flux_2_klein_9b)


for _factory in (flux_2_dev, flux_2_klein_4b, flux_2_klein_9b):  # the schedule before loading (entropy-steps' check)
    _factory.static_sigmas = flux2_static_sigmas  # type: ignore[attr-defined]
