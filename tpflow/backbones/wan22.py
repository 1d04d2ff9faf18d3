"""Backbone ``wan2.2-t2v-a14b``: Wan2.2's two experts, one trained, switched at a noise boundary as ``WanPipeline``.

    [backbone]
    name = "wan2.2-t2v-a14b"
    pretrained = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    train_expert = "high"      # or "low"

Wan2.2 A14B denoises with two 14 B transformers of Wan2.1's architecture: the pipeline's ``transformer`` (the
high-noise expert) predicts while the timestep 1000·σ is at least ``boundary_ratio``·1000, ``transformer_2`` (the
low-noise expert) below, each with its own guidance scale (the official t2v-A14B config: boundary 0.875, shift 12,
guidance 4.0 high and 3.0 low). One expert trains (a LoRA, or all its weights with ``finetune = "full"``), the
other stays frozen in the model's dtype: ``train_expert`` says which. Everything else is Wan2.1's backbone
(tpflow/backbones/wan.py); rows of one call whose σ fall on both sides of the boundary (DiffusionNFT's per-sample
times) go to their own expert.

Exported LoRA: the file ``WanPipeline.load_lora_weights`` reads, for the expert trained. The pipeline loads it into
``transformer`` by default; an adapter of the low-noise expert loads with ``load_lora_weights(dir,
load_into_transformer_2=True)``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.diffusers_common import DTYPES, attach_preflight, fp32_parts, load_pipeline
from tpflow.backbones.wan import WanBackbone, WanOptions
from tpflow.registry import register
from tpflow.types import Conditioning

EXPERTS = {"high": "transformer", "low": "transformer_2"}  # the pipeline's attribute of each expert
BOUNDARY_RATIO = 0.875  # t2v-A14B's (its model_index.json): what a recipe is checked against before loading


class Wan22Options(WanOptions):
    """Options of ``wan2.2-t2v-a14b`` (the official t2v-A14B inference config where it has one)."""

    pretrained: str = Field("Wan-AI/Wan2.2-T2V-A14B-Diffusers", description=option_help.PRETRAINED)
    flow_shift: float = Field(12.0, gt=0, description=option_help.FLOW_SHIFT)
    train_expert: Literal["high", "low"] = Field("high", description=option_help.TRAIN_EXPERT)
    low_noise_guidance: float | None = Field(None, ge=1.0, description=option_help.LOW_NOISE_GUIDANCE)


class Wan22Backbone(WanBackbone):
    """``WanBackbone`` with two experts: ``transformer`` is the trained one, ``other`` the frozen one."""

    def __init__(self, pipe: Any, options: Wan22Options) -> None:
        if pipe.transformer_2 is None or pipe.config.boundary_ratio is None:
            from tpflow.errors import UserError

            raise UserError(
                f"{options.pretrained} is not a two-expert Wan2.2 pipeline (no transformer_2 or boundary_ratio in "
                'its model_index.json); use backbone "wan2.1-t2v-1.3b" / "wan2.1-t2v-14b" for a one-expert model.'
            )
        trained = EXPERTS[options.train_expert]
        other = EXPERTS["low" if options.train_expert == "high" else "high"]
        super().__init__(pipe, options, trained, (other,))
        self.other = getattr(pipe, other)
        self.boundary = float(pipe.config.boundary_ratio) * 1000  # the pipeline's boundary_timestep

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The high-noise expert where 1000·σ ≥ the boundary (the pipeline's test), the low-noise one below, with
        its guidance (``low_noise_guidance``); rows on both sides go to their own expert."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n) * 1000
        high = t >= self.boundary  # [n]
        experts = {True: self.transformer, False: self.other}
        if self.options.train_expert == "low":
            experts = {True: self.other, False: self.transformer}
        low_guidance = self.options.low_noise_guidance or guidance
        embeds = cond.tensors["prompt_embeds"]
        if bool(high.all()) or not bool(high.any()):
            side = bool(high[0])
            return self._guided(experts[side], z, t, embeds, cond, guidance if side else low_guidance)
        out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        for side in (True, False):
            rows = (high == side).nonzero().squeeze(1)
            part = cond.index(rows)
            out[rows] = self._guided(experts[side], z[rows], t[rows], embeds[rows], part,
                                     guidance if side else low_guidance)  # fmt: skip
        return out


def expert_problems(options: Wan22Options, sections: dict) -> list[str]:
    """Wan2.2's ``check_recipe``: a trained expert that the rollout window reaches (a
    window wholly on the other side of the boundary would train nothing: its rows' gradient is 0), and no sharding
    yet (the frozen expert would stay whole on every process; untested)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from tpflow.backbones.diffusers_common import scheduler_sigmas

    problems: list[str] = []
    rollout, train = sections.get("rollout"), sections.get("train")
    if getattr(train, "shard", "none") == "fsdp":
        problems.append('[train] shard = "fsdp" is not supported for Wan2.2\'s two experts yet; use shard = "none".')
    if rollout is None:
        return problems
    sigmas = scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=options.flow_shift), rollout.num_steps, 0, False)
    boundary = BOUNDARY_RATIO * 1000
    lo, hi = rollout.window_range
    steps = range(lo, min(hi, rollout.num_steps))
    high = [k for k in steps if float(sigmas[k]) * 1000 >= boundary]
    mine = high if options.train_expert == "high" else [k for k in steps if k not in high]
    if steps and not mine:
        problems.append(
            f'[backbone] train_expert = "{options.train_expert}": no step of rollout.window_range = [{lo}, {hi}) '
            f"runs that expert (with flow_shift = {options.flow_shift:g} and {rollout.num_steps} steps, 1000·σ "
            f"falls below the boundary {boundary:g} from step {len(high)} on), so nothing would train. Move the "
            "window, or train the other expert."
        )
    return problems


@register("backbone", "wan2.2-t2v-a14b", options=Wan22Options)
def wan22_t2v_a14b(options: Wan22Options) -> Wan22Backbone:
    """Wan2.2 T2V A14B (two 14 B experts, a UMT5-XXL text encoder) from a hub id (local HF cache) or a local
    folder; fails fast, naming what is missing."""
    from diffusers import WanPipeline

    pipe = load_pipeline(
        WanPipeline,
        options.pretrained,
        DTYPES[options.dtype],
        "Wan2.2-T2V-A14B",
        fp32=fp32_parts(options, EXPERTS[options.train_expert]),
    )
    return Wan22Backbone(pipe, options)


attach_preflight(wan22_t2v_a14b, "WanTransformer3DModel", "Wan2.2-T2V-A14B")
wan22_t2v_a14b.check_recipe = expert_problems  # type: ignore[attr-defined]
wan22_t2v_a14b.samples_clips = True  # type: ignore[attr-defined]  # a clip reward (tpflow.rewards.needs)
