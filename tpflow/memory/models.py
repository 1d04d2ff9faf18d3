"""The models the estimate runs: tpflow's own backbone classes around diffusers models of given configurations.

Why tpflow's classes and not a stand-in: the estimate is of what tpflow allocates (its LoRA, its CFG batching, its
latent packing), so its own ``SD3Backbone`` / ``FluxBackbone`` / ``QwenImageBackbone`` (and the Wan video
backbones: ``tpflow.memory.wan``) run on the real diffusers transformer and VAE, built at full size under
``FakeTensorMode`` (no weights, nothing allocated). The text encoders are not built: their parameters are counted on
the meta device, and the prompts' embeddings are made at the shapes they give (``conditioning``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tpflow.memory import flux2 as flux2_memory  # FLUX.2's builders (their sizes: tpflow.memory.flux2)
from tpflow.memory import z_image as z_image_memory  # Z-Image's (tpflow.memory.z_image)
from tpflow.memory.configs import CLIP_G, CLIP_L, QWEN25_VL_7B, T5_XXL, UMT5_XXL


def count_bytes(module: torch.nn.Module) -> int:
    """numel × element size of the parameters and buffers (shared storages once)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def largest_block_bytes(module: torch.nn.Module) -> int:
    """Bytes of the largest repeated block (what FSDP2 gathers at once for its forward or backward)."""
    from tpflow.train.sharding import BLOCK_LISTS

    blocks = [b for name in BLOCK_LISTS for b in getattr(module, name, None) or ()]
    return max((count_bytes(b) for b in blocks), default=0)


DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def encoder_size(module: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, bytes) of a text encoder placed in ``dtype`` as tpflow places it (``tpflow.backbones.placement``):
    its float32 islands stay float32, e.g. T5's and UMT5's feed-forward output ``wo`` under fp16 (transformers'
    ``_keep_in_fp32_modules``: 1.0 B of T5-XXL's 4.8 B parameters, 1.9 GiB more than all-fp16)."""
    from tpflow.backbones.placement import fp32_island

    island, width = fp32_island(module, dtype), dtype.itemsize  # bytes per element
    params = nbytes = 0
    for name, param in module.named_parameters():
        params += param.numel()
        nbytes += param.numel() * (4 if island(name) else width)
    return params, nbytes


def text_encoder_sizes(kind: str, dtype: str) -> dict[str, tuple[int, int]]:
    """(parameters, bytes in the recipe's ``dtype``) of the published models' text encoders, built on the meta
    device (nothing allocated)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if kind.startswith("flux2"):  # FLUX.2: Mistral-Small-3 or Qwen3 (tpflow.memory.flux2)
        return {n: encoder_size(m, DTYPE_NAMES[dtype]) for n, m in flux2_memory.flux2_text_encoders(kind).items()}
    if kind == "z-image":  # Qwen3-4B (tpflow.memory.z_image)
        return {n: encoder_size(m, DTYPE_NAMES[dtype]) for n, m in z_image_memory.z_image_text_encoders().items()}
    with torch.device("meta"):
        if kind == "wan":
            from transformers import UMT5Config, UMT5EncoderModel

            encoders = {"UMT5-XXL encoder": UMT5EncoderModel(UMT5Config(**UMT5_XXL))}
        elif kind in ("qwen", "qwen-edit"):
            from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

            encoders = {"Qwen2.5-VL-7B": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B))}
        elif kind == "sd3":
            encoders = {
                "CLIP-L": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L)),
                "CLIP-G": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)),
                "T5-XXL encoder": T5EncoderModel(T5Config(**T5_XXL)),
            }
        else:
            encoders = {
                "CLIP-L": CLIPTextModel(CLIPTextConfig(**CLIP_L)),
                "T5-XXL encoder": T5EncoderModel(T5Config(**T5_XXL)),
            }
    return {name: encoder_size(m, DTYPE_NAMES[dtype]) for name, m in encoders.items()}


def pipe_text_encoder_sizes(backbone: Any, dtype: str) -> dict[str, tuple[int, int]]:
    """(parameters, bytes in ``dtype``) of the text encoders a built backbone's pipeline holds (the tiny backbones
    build theirs)."""
    pipe = getattr(backbone, "pipe", None)
    found = {}
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        encoder = getattr(pipe, name, None)
        if isinstance(encoder, torch.nn.Module):
            found[f"{name} ({type(encoder).__name__})"] = encoder_size(encoder, DTYPE_NAMES[dtype])
    return found


def build_backbone(kind: str, transformer_cfg: dict, vae_cfg: dict, options: Any) -> Any:
    """tpflow's SD3Backbone / FluxBackbone / QwenImageBackbone / WanBackbone around a transformer and VAE of the
    given configurations (no encoders). Call it under FakeTensorMode for full sizes. ``options``: the recipe's
    validated backbone section (its device is replaced by the CPU, its prompt cache by none)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    from tpflow.backbones.flux import FluxBackbone
    from tpflow.backbones.flux_kontext import FluxKontextBackbone
    from tpflow.backbones.sd3 import SD3Backbone

    if kind in ("qwen", "qwen-edit"):
        return _qwen_backbone(transformer_cfg, vae_cfg, options, edit=kind == "qwen-edit")
    if kind == "z-image":  # Z-Image (tpflow.memory.z_image)
        return z_image_memory.build_z_image_backbone(transformer_cfg, vae_cfg, options, fake_module_to())
    if kind.startswith("flux2"):  # FLUX.2 (tpflow.memory.flux2)
        return flux2_memory.build_flux2_backbone(transformer_cfg, vae_cfg, options, fake_module_to())  # flux2
    if kind == "wan":
        from tpflow.memory.wan import build_wan_backbone

        with fake_module_to():
            return build_wan_backbone(transformer_cfg, vae_cfg, options)
    options = options.model_copy(update={"device": "cpu", "prompt_cache": 0})
    vae = AutoencoderKL(**vae_cfg)
    if kind == "sd3":
        from diffusers import SD3Transformer2DModel

        pipe: Any = types.SimpleNamespace(
            transformer=SD3Transformer2DModel(**transformer_cfg),
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae_scale_factor=2 ** (len(vae_cfg["block_out_channels"]) - 1),
        )
    else:
        from diffusers import FluxPipeline, FluxTransformer2DModel

        pipe = types.SimpleNamespace(
            transformer=FluxTransformer2DModel(**transformer_cfg),
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
            vae_scale_factor=2 ** (len(vae_cfg["block_out_channels"]) - 1),
            _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids,
        )
    with fake_module_to():
        return {"sd3": SD3Backbone, "kontext": FluxKontextBackbone}.get(kind, FluxBackbone)(pipe, options)


def _qwen_backbone(transformer_cfg: dict, vae_cfg: dict, options: Any, edit: bool = False) -> Any:
    """tpflow's QwenImageBackbone (``edit``: QwenImageEditBackbone, which holds one) around a transformer and VAE of
    the given configurations (no text encoder)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from tpflow.backbones.qwen_image import QwenImageBackbone
    from tpflow.backbones.qwen_image_edit import QwenImageEditBackbone

    options = options.model_copy(update={"device": "cpu", "prompt_cache": 0})
    pipe: Any = types.SimpleNamespace(
        transformer=QwenImageTransformer2DModel(**transformer_cfg),
        vae=AutoencoderKLQwenImage(**vae_cfg),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                  base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02),
        vae_scale_factor=2 ** len(vae_cfg["temperal_downsample"]),
        _pack_latents=QwenImagePipeline._pack_latents,
        _unpack_latents=QwenImagePipeline._unpack_latents,
    )  # fmt: skip
    with fake_module_to():
        return (QwenImageEditBackbone if edit else QwenImageBackbone)(pipe, options)


def fake_module_to() -> Any:
    """A context in which ``Module.to`` converts FakeTensor parameters (see ``_swap_fake``)."""
    return mock.patch.object(torch.utils, "swap_tensors", _swap_fake)


def _swap_fake(t1: torch.Tensor, t2: torch.Tensor, _swap: Callable = torch.utils.swap_tensors) -> None:
    """``torch.utils.swap_tensors`` after dropping FakeTensorMode's weak memo of the two tensors.

    ``Module.to`` swaps fake parameters with their converted copies, and ``swap_tensors`` refuses tensors that are
    weakly referenced; FakeTensorMode memoizes every fake tensor it makes in a WeakValueDictionary (a cache of
    real-to-fake conversions, which these runs do not use).
    """
    for t in (t1, t2):
        if isinstance(t, FakeTensor):
            t.fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
    _swap(t1, t2)


def conditioning(backbone: Any, kind: str, rows: int, text_len: int, device: str = "cpu", sources: int = 0) -> Any:
    """Prompt embeddings of ``rows`` prompts with the shapes the real encoders give (values irrelevant); an editing
    backbone's ``sources`` per prompt encoded as it encodes them (``source_tokens`` each)."""
    from tpflow.types import Conditioning

    if kind.startswith("flux2"):  # FLUX.2's stacked text layers, klein's negative (tpflow.memory.flux2)
        cond = flux2_memory.flux2_conditioning(backbone, rows, text_len, device)
        return _flux2_references(backbone, cond, kind, sources, device) if sources else cond
    if kind == "z-image":  # Qwen3's caption rows with their lengths (tpflow.memory.z_image)
        return z_image_memory.z_image_conditioning(backbone, rows, text_len, device)
    if kind == "qwen-edit":
        return _qwen_edit_conditioning(backbone, rows, text_len, sources, device)
    if kind == "wan":  # UMT5 embeddings padded to max_sequence_length, and the negative prompt's
        from tpflow.memory.wan import wan_conditioning

        return wan_conditioning(backbone, rows, text_len, device)
    cfg, dtype = backbone.transformer.config, backbone.dtype
    embeds = torch.randn(rows, text_len, cfg.joint_attention_dim, dtype=dtype, device=device)  # [rows, L, D]
    if kind == "qwen":  # prompt embeddings padded to max_sequence_length with their mask, and the negative prompt's
        mask = torch.ones(rows, text_len, dtype=torch.long, device=device)
        negative = {"prompt_embeds": embeds[:1].clone(), "mask": mask[:1].clone()}
        return Conditioning({"prompt_embeds": embeds, "mask": mask}, {"negative": negative})
    pooled_dim = cfg.pooled_projection_dim
    pooled = torch.randn(rows, pooled_dim, dtype=dtype, device=device)  # [rows, P]
    if kind == "sd3":
        negative = {"prompt_embeds": embeds[:1].clone(), "pooled": pooled[:1].clone()}
        return Conditioning({"prompt_embeds": embeds, "pooled": pooled}, {"negative": negative})
    txt_ids = torch.zeros(text_len, 3, dtype=dtype, device=device)
    tensors, img_ids = {"prompt_embeds": embeds, "pooled": pooled}, backbone.img_ids
    if kind == "kontext":  # FLUX.1 Kontext: the source's packed latents appended, as many tokens as the target's
        tensors["source_latents"] = torch.randn(
            rows, img_ids.shape[0], 4 * backbone.channels, dtype=dtype, device=device
        )
        img_ids = torch.cat([img_ids, img_ids])
    return Conditioning(tensors, {"txt_ids": txt_ids, "img_ids": img_ids})


def source_tokens(kind: str, options: Any) -> int:
    """Transformer tokens of one source image as the editing backbone feeds it: Qwen-Image-Edit's at
    ``source_area`` (the output's area when unset) through the pipeline's ``calculate_dimensions``, 16 px per token;
    FLUX.2's at most ``source_max_pixels`` (a square source of that area: a smaller or oblong one gives fewer)."""
    from math import isqrt

    if kind == "qwen-edit":
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        side = 16 * (options.resolution // 16)  # the output's pixels as the pipeline rounds them
        width, height = calculate_dimensions(options.source_area or side * side, 1.0)
        return (height // 16) * (width // 16)
    if kind.startswith("flux2"):
        return (isqrt(options.source_max_pixels) // 16) ** 2
    return 0


def recipe_sources(recipe: Any, kind: str) -> tuple[int, str | None]:
    """Source images per prompt the estimate counts for an editing recipe, and the note that says so (none and no
    note for text-to-image). The count is in the data, which ``--no-machine`` does not read: the backbone's most
    (``source_images``), for an editing dataset (one that declares ``sources``, or ``edit-jsonl``) or a backbone
    that needs a source; so the figure is the largest edit's."""
    from tpflow import registry
    from tpflow.interfaces import capability
    from tpflow.sources import SOURCES

    if kind not in ("qwen-edit",) and not kind.startswith("flux2"):
        return 0, None  # FLUX.1 Kontext counts its one source in its kind; the others take none
    fewest, most = capability(registry.get("backbone", recipe.backbone.name).factory, "source_images")
    dataset = recipe.dataset.name
    keys = capability(registry.get("dataset", dataset).factory, "metadata_keys")
    if most == 0 or not (fewest > 0 or dataset == "edit-jsonl" or (keys is not None and SOURCES in keys)):
        return 0, None
    tokens = source_tokens(kind, recipe.backbone.options)
    note = (
        f"sources: {most} per prompt, the backbone's most ({recipe.backbone.name} takes {fewest} to {most}; the "
        f"data's own count is not read), {tokens} transformer tokens each appended to every call's sequence; fewer "
        f"sources, fewer tokens"
    )
    return most, note


def _qwen_edit_conditioning(backbone: Any, rows: int, text_len: int, sources: int, device: str) -> Any:
    """QwenImageEditBackbone.encode's shapes: the instruction's and the negative prompt's embeddings [rows, L, D]
    with their masks (L = ``max_sequence_length``: the template, each source's image tokens and the text, padded),
    the sources' packed latents [rows, M·S', 4·C] and the output's and sources' ``img_shapes``."""
    from tpflow.types import Conditioning

    dim, dtype = backbone.transformer.config.joint_attention_dim, backbone.dtype
    embeds = torch.randn(rows, text_len, dim, dtype=dtype, device=device)  # [rows, L, D]
    mask = torch.ones(rows, text_len, dtype=torch.long, device=device)  # [rows, L]
    width, height = backbone.source_size
    h, w = height // backbone.image.scale // 2, width // backbone.image.scale // 2  # a source's packed grid
    latents = torch.randn(rows, sources * h * w, 4 * backbone.channels, dtype=dtype, device=device)  # [rows, M·S', 4C]
    side = backbone.image.latent_side // 2
    tensors = {"prompt_embeds": embeds, "mask": mask, "negative_embeds": embeds.clone(), "negative_mask": mask.clone()}
    shapes = [(1, side, side)] + [(1, h, w)] * sources  # the output's, then each source's
    return Conditioning({**tensors, "image_latents": latents}, {"img_shapes": shapes})


def _flux2_references(backbone: Any, cond: Any, kind: str, sources: int, device: str) -> Any:
    """FLUX.2's text-to-image conditioning with ``sources`` references per row appended as ``Flux2Backbone.encode``
    appends them: ``ref_latents`` [rows, M·R, 4·C], one layout (every row's sources of one size) and its ids."""
    from tpflow.types import Conditioning

    rows, tokens = len(cond), sources * source_tokens(kind, backbone.options)
    refs = torch.randn(rows, tokens, backbone.channels, dtype=backbone.dtype, device=device)  # [rows, M·R, 4C]
    layout = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
    ids = torch.zeros(tokens, 4, dtype=torch.long, device=device)  # [M·R, 4]
    tensors = {**cond.tensors, "ref_latents": refs, "ref_layout": layout}
    return Conditioning(tensors, {**cond.extras, "ref_ids": [ids]})


def latents(backbone: Any, rows: int) -> torch.Tensor:
    """Initial noise, float32: [rows, C, h, w] (SD3), packed [rows, S, 4C] (FLUX, Qwen-Image), [rows, C, F', h, w]
    (Wan)."""
    return backbone.initial_noise(rows)
