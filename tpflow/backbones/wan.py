"""Backbone ``wan2.1-t2v-1.3b`` / ``wan2.1-t2v-14b``: Wan2.1 text-to-video through diffusers, with a peft LoRA.

    [backbone]
    name = "wan2.1-t2v-1.3b"
    pretrained = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"   # or a local folder in diffusers layout
    dtype = "bf16"
    resolution = 240          # height in pixels; width defaults to the height
    width = 416
    num_frames = 33           # 4k + 1: the VAE compresses 4 frames into one latent frame after the first

What differs from SD3, all as ``WanPipeline.__call__`` does it: text through the pipeline's own ``encode_prompt``
(UMT5, padded with zeros past each prompt's tokens to ``max_sequence_length``, no pooled vector); latents
[N, C, F', h, w] with F' = (num_frames − 1)/4 + 1 and h, w the pixel sizes / 8 (the Wan VAE's temporal and spatial
compression), drawn as the pipeline draws them; the transformer called with timestep 1000·σ; CFG v_u + w·(v_c − v_u)
(the pipeline calls the two branches one after the other, here batched as [uncond; cond] in one call); decoding
through the Wan VAE with its per-channel latent mean and std, into clips [N, F, 3, H, W] in [0, 1] (frames first:
an image reward scores them frame by frame through the ``frames`` reward).

The schedule is the flow-matching Euler one with Wan's flow shift (diffusers' ``FlowMatchEulerDiscreteScheduler``,
static ``shift = flow_shift``): the per-step SDE samplers need σ_k, and a rollout at noise level 0 is the Euler ODE
on it. The Wan checkpoints ship a UniPC multistep scheduler for inference, which tpflow does not use; the flow shift
is the one number they share (3.0 for 480p as Wan's model card; 5.0 for 720p).
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
from tpflow.devices import randn
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.types import Conditioning

# the self- and cross-attention projections of every block
WAN_LORA_TARGETS = tuple(f"attn{a}.{p}" for a in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0"))


class WanOptions(DiffusersBackboneOptions):
    """Options of the Wan2.1 text-to-video backbones (bf16; 33 frames of 240×416, as flow_grpo's Wan recipe)."""

    pretrained: str = Field("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    resolution: int = Field(240, ge=16, description=option_help.RESOLUTION)
    width: int | None = Field(None, ge=16, description=option_help.WIDTH)
    num_frames: int = Field(33, ge=1, description=option_help.NUM_FRAMES)
    flow_shift: float = Field(3.0, gt=0, description=option_help.FLOW_SHIFT)
    max_sequence_length: int = Field(226, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(WAN_LORA_TARGETS),
        description=option_help.LORA_TARGETS,
    )
    negative_prompt: str = Field("", description=option_help.NEGATIVE_PROMPT)


def check_clip_size(options: WanOptions, temporal: int, spatial: int) -> None:
    """A UserError unless the frame count and sizes fit the VAE's compression and the transformer's 2×2 patches."""
    from tpflow.errors import UserError

    width = options.width or options.resolution
    if (options.num_frames - 1) % temporal:
        raise UserError(
            f"[backbone] num_frames = {options.num_frames}: the Wan VAE encodes the first frame alone and then "
            f"{temporal} frames per latent frame, so num_frames must be {temporal}k + 1 (e.g. "
            f"{(options.num_frames - 1) // temporal * temporal + 1})."
        )
    if options.resolution % (2 * spatial) or width % (2 * spatial):
        raise UserError(
            f"[backbone] resolution = {options.resolution}, width = {width}: each must be a multiple of "
            f"{2 * spatial} (the VAE's {spatial}× downsampling, then the transformer's 2×2 patches)."
        )


class WanBackbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``WanPipeline``'s components.

    Latents: [N, C, F', h, w] float32. ``cond.tensors``: ``prompt_embeds`` [N, L, D]; ``extras``: the negative
    prompt's. ``decode`` gives clips [N, F, 3, H, W]."""

    def __init__(self, pipe: Any, options: WanOptions, trained: str = "transformer", frozen: tuple = ()) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        check_clip_size(options, temporal, spatial)
        parts = setup_pipeline(pipe, options, ("text_encoder",), trained, frozen)
        self.options, self.pipe, self.adapter = options, pipe, parts.adapter
        self.device, self.dtype, self.text_device = parts.device, parts.dtype, parts.text_device
        self.transformer, self.vae, self.cache = parts.transformer, parts.vae, parts.cache
        self.frames = (options.num_frames - 1) // temporal + 1
        self.size = (options.resolution // spatial, (options.width or options.resolution) // spatial)
        self.schedule = FlowMatchEulerDiscreteScheduler(shift=options.flow_shift)
        self._negative: dict[str, Tensor] | None = None

    # ---- text ----------------------------------------------------------------------------------------------

    def _encode_text(self, prompts: list[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            embeds, _ = self.pipe.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=False, device=self.text_device,
                max_sequence_length=self.options.max_sequence_length,
            )  # fmt: skip
        return {"prompt_embeds": embeds.to(self.dtype)}

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Prompt embeddings [N, L, D] (zeros past each prompt's tokens; cached per prompt when ``prompt_cache``)."""
        if self._negative is None:
            neg = self._encode_text([self.options.negative_prompt])
            self._negative = {k: v.to(self.device) for k, v in neg.items()}
        tensors = self.cache.encode(prompts, self._encode_text, self.device)
        return Conditioning(tensors=tensors, extras={"negative": self._negative})

    # ---- sampling ------------------------------------------------------------------------------------------

    def latent_shape(self) -> tuple[int, ...]:
        """(C, F', h, w) of one clip's latents."""
        return (self.transformer.config.in_channels, self.frames, *self.size)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I): [n, C, F', h, w] float32, drawn on the generator's device as the pipeline draws it."""
        return randn((n, *self.latent_shape()), generator, self.device)

    def sigmas(self, num_steps: int) -> Tensor:
        """σ_0..σ_K of the Euler flow-matching schedule with static shift ``flow_shift``, [K + 1] float32."""
        return scheduler_sigmas(self.schedule, num_steps, 0, flux_style=False)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v = v_u + w·(v_c − v_u) from ONE transformer call on [z; z] (w = 1: the conditional call alone)."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n) * 1000
        return self._guided(self.transformer, z, t, cond.tensors["prompt_embeds"], cond, guidance)

    def _guided(self, model: Any, z: Tensor, t: Tensor, embeds: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """One expert's guided velocity for rows z [n, ...] at timesteps t [n] (1000·σ)."""
        n, x = z.shape[0], z.to(self.dtype)
        if getattr(self.pipe.config, "expand_timesteps", False):  # Wan2.2 TI2V: one timestep per token, as the pipe
            _, _, f, h, w = z.shape
            _, ph, pw = model.config.patch_size
            t = t[:, None].expand(n, f * (h // ph) * (w // pw))  # [n, tokens]
        if guidance != 1:
            embeds = torch.cat([cond.extras["negative"]["prompt_embeds"].expand(n, -1, -1), embeds])
            x, t = torch.cat([x, x]), torch.cat([t, t])
        v = model(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
        if guidance == 1:
            return v.float()
        v_uncond, v_cond = v.float().chunk(2)
        return combine(v_uncond, v_cond, guidance)

    def decode(self, z: Tensor) -> Tensor:
        """Latents [N, C, F', h, w] to clips [N, F, 3, H, W] float32 in [0, 1]: the VAE's latent mean and std
        undone, decoded in fp32."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=z.device).view(1, -1, 1, 1, 1)
        with torch.no_grad():
            video = self.vae.decode(z.float() * std + mean, return_dict=False)[0]  # [N, 3, F, H, W] in [-1, 1]
        return (video.float().transpose(1, 2) / 2 + 0.5).clamp(0, 1)


@register("backbone", "wan2.1-t2v-1.3b", options=WanOptions)
def wan21_t2v_1_3b(options: WanOptions) -> WanBackbone:
    """Wan2.1 T2V 1.3B (a 1.3 B video DiT with a UMT5-XXL text encoder) from a hub id (local HF cache) or a local
    folder; fails fast, naming what is missing."""
    from diffusers import WanPipeline

    pipe = load_pipeline(
        WanPipeline, options.pretrained, DTYPES[options.dtype], "Wan2.1-T2V-1.3B", fp32=fp32_parts(options)
    )
    return WanBackbone(pipe, options)


class Wan14BOptions(WanOptions):
    pretrained: str = Field("Wan-AI/Wan2.1-T2V-14B-Diffusers", description=option_help.PRETRAINED)


@register("backbone", "wan2.1-t2v-14b", options=Wan14BOptions)
def wan21_t2v_14b(options: Wan14BOptions) -> WanBackbone:
    """Wan2.1 T2V 14B; as ``wan2.1-t2v-1.3b``."""
    from diffusers import WanPipeline

    pipe = load_pipeline(
        WanPipeline, options.pretrained, DTYPES[options.dtype], "Wan2.1-T2V-14B", fp32=fp32_parts(options)
    )
    return WanBackbone(pipe, options)


class WanTI2VOptions(WanOptions):
    """Options of ``wan2.2-ti2v-5b`` (its text-to-video use; the official ti2v-5B config: 121 frames of 704×1280,
    shift 5, guidance 5)."""

    pretrained: str = Field("Wan-AI/Wan2.2-TI2V-5B-Diffusers", description=option_help.PRETRAINED)
    resolution: int = Field(704, ge=16, description=option_help.RESOLUTION)
    width: int | None = Field(1280, ge=16, description=option_help.WIDTH)
    num_frames: int = Field(121, ge=1, description=option_help.NUM_FRAMES)
    flow_shift: float = Field(5.0, gt=0, description=option_help.FLOW_SHIFT)


@register("backbone", "wan2.2-ti2v-5b", options=WanTI2VOptions)
def wan22_ti2v_5b(options: WanTI2VOptions) -> WanBackbone:
    """Wan2.2 TI2V 5B as a text-to-video model (its 16× VAE; one timestep per token, the pipeline's
    ``expand_timesteps``); as ``wan2.1-t2v-1.3b``."""
    from diffusers import WanPipeline

    pipe = load_pipeline(
        WanPipeline, options.pretrained, DTYPES[options.dtype], "Wan2.2-TI2V-5B", fp32=fp32_parts(options)
    )
    return WanBackbone(pipe, options)


attach_preflight(wan22_ti2v_5b, "WanTransformer3DModel", "Wan2.2-TI2V-5B")
attach_preflight(wan21_t2v_1_3b, "WanTransformer3DModel", "Wan2.1-T2V-1.3B")
attach_preflight(wan21_t2v_14b, "WanTransformer3DModel", "Wan2.1-T2V-14B")
# clips [N, F, 3, H, W]: every reward of the recipe must take clips (tpflow.rewards.needs)
wan21_t2v_1_3b.samples_clips = wan21_t2v_14b.samples_clips = wan22_ti2v_5b.samples_clips = True  # type: ignore[attr-defined]
