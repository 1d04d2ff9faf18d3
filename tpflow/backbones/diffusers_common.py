"""What the SD3 and FLUX backbones share: options, loading a pipeline with clear errors, schedules, prompt cache.

Plain functions, one options base model and the ``PipelineParts`` container; the backbones are separate classes
(one model per file) that hold their parts and a ``diffusers_lora.LoraAdapter`` (composition, no base class).
"""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow.backbones import option_help
from tpflow.backbones.placement import place
from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.samplers.schedules import check_num_steps
from tpflow.weights import WeightSource, cached_file, hub_cache_dir, is_local_name

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DiffusersBackboneOptions(BaseModel):
    """Options every diffusers backbone takes (the model-specific defaults are set by the subclasses, with the
    descriptions of ``option_help``)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp16", description=option_help.DTYPE)
    device: str | None = Field(None, description=option_help.DEVICE)
    resolution: int = Field(512, ge=16, description=option_help.RESOLUTION)
    max_sequence_length: int = Field(256, ge=8, description=option_help.MAX_SEQUENCE_LENGTH)
    finetune: Literal["lora", "full"] = Field("lora", description=option_help.FINETUNE)
    lora_rank: int = Field(32, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(64.0, gt=0, description=option_help.LORA_ALPHA)
    lora_targets: list[str] = Field(default_factory=list, description=option_help.LORA_TARGETS)
    lora_init: Literal["gaussian", "default"] = Field("gaussian", description=option_help.LORA_INIT)
    gradient_checkpointing: bool = Field(False, description="Recompute transformer activations in the backward.")
    compile_blocks: bool = Field(False, description=option_help.COMPILE_BLOCKS)
    prompt_cache: int = Field(
        0, ge=0, description="Prompt embeddings kept (on the CPU, least recently used dropped); 0 turns it off."
    )
    text_encoders_device: Literal["model", "cpu"] = Field(
        "model",
        description="Where the frozen text encoders live: with the transformer, or on the CPU (with prompt_cache "
        "this keeps them off the GPU at the cost of slower encoding of new prompts).",
    )


def _how(pretrained: str) -> str:
    from tpflow.weights import download_command, login_command

    hub = pretrained if not is_local_name(pretrained) else "<hub id>"
    return (
        f"Download them with {download_command(hub)} (accept the model's licence on the Hub and log in with "
        f"{login_command()} first), or set pretrained = '/path/to/folder' in [backbone] to a folder holding the "
        "diffusers layout (model_index.json, transformer/, vae/, text_encoder*/, tokenizer*/, scheduler/)."
    )


def _folder_problem(folder: Path, model_name: str, what: str) -> str | None:
    """Why ``folder`` is not a complete diffusers layout: model_index.json and each component's subfolder."""
    index = folder / "model_index.json"
    if not index.is_file():
        return f"The {model_name} weights {what} {folder} has no model_index.json."
    try:
        components = [k for k, v in json.loads(index.read_text()).items() if isinstance(v, list) and v[0]]
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        return f"The {model_name} weights {what}'s {index} is not a diffusers model index ({exc})."
    missing = [c for c in components if not (folder / c).is_dir() or not any((folder / c).iterdir())]
    if missing:
        return f"The {model_name} weights {what} {folder} lacks {', '.join(missing)}."
    return None


def transformer_config(pretrained: str) -> dict[str, Any] | None:
    """The transformer's ``config.json`` in a local diffusers folder or in the Hugging Face cache for a hub id;
    None when it is not on this machine (nothing is downloaded) or does not parse (loading then says why)."""
    if is_local_name(pretrained):
        path: Path | None = Path(pretrained).expanduser() / "transformer" / "config.json"
    else:
        found = cached_file(pretrained, "transformer/config.json")  # the cache only, never the network
        path = Path(found) if found else None
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def lora_target_problems(
    transformer_class: str, pretrained: str, targets: Sequence[str], model_name: str
) -> list[str]:
    """``lora_targets`` checked against the transformer (``diffusers.<transformer_class>``) built on the meta device
    from its config (no weights are read; ``tpflow.backbones.lora_targets``); nothing to say when the config is not
    on this machine (and then diffusers is not even imported)."""
    config = transformer_config(pretrained)
    if config is None:
        return []
    import diffusers

    from tpflow.backbones.lora_targets import structure, target_problems

    try:
        model = structure(lambda: getattr(diffusers, transformer_class).from_config(config))
    except Exception as exc:  # a config of another model: loading the weights would fail as well
        return [f"[backbone] The {model_name} transformer config of '{pretrained}' does not build ({exc})."]
    return target_problems(model, targets, f"the {model_name} transformer")


def pretrained_source(pretrained: str, model_name: str) -> WeightSource:
    """Where ``pretrained`` will be read from (a local folder, or its snapshot in the Hugging Face cache), found
    without loading anything and without the network; ``problem`` says why it cannot be, with the download command.

    A hub id is looked up in the cache only, with or without HF_HUB_OFFLINE: tpflow never downloads weights.
    """
    what = f"{model_name} weights (option pretrained)"
    how = _how(pretrained)
    if is_local_name(pretrained):
        local = Path(pretrained).expanduser()
        problem = _folder_problem(local, model_name, "folder")
        if problem:
            return WeightSource(what, pretrained, None, f"{problem} {how}")
        return WeightSource(what, pretrained, f"local folder {local}", path=str(local))
    index = cached_file(pretrained, "model_index.json")
    if index is None:
        problem = (
            f"The {model_name} weights '{pretrained}' are not in the Hugging Face cache ({hub_cache_dir()}), and "
            f"tpflow never downloads weights. {how}"
        )
        return WeightSource(what, pretrained, None, problem)
    snapshot = Path(index).parent
    problem = _folder_problem(snapshot, model_name, f"'{pretrained}' in the Hugging Face cache, snapshot")
    if problem:
        return WeightSource(what, pretrained, None, f"{problem} The download was partial. {how}")
    return WeightSource(what, pretrained, f"Hugging Face cache {snapshot}", path=str(snapshot))


def pretrained_problem(pretrained: str, model_name: str) -> str | None:
    """Why ``pretrained`` cannot be loaded here (``pretrained_source``'s problem), or None."""
    return pretrained_source(pretrained, model_name).problem


def cpu_problem(options: DiffusersBackboneOptions, model_name: str) -> str | None:
    """Why a paper-scale backbone will not start here: no CUDA GPU and ``device`` not set to "cpu" explicitly.

    An unset device means the CPU on a machine without CUDA, where SD3.5-M or FLUX takes hours per rollout batch;
    the user asks for that with device = "cpu", not by accident.
    """
    if options.device not in (None, "auto") or torch.cuda.is_available():
        return None
    return (
        f"[backbone] device: this machine has no CUDA GPU, so {model_name} would run on the CPU (device "
        f"{'unset' if options.device is None else repr(options.device)} resolves to cpu), hours per rollout batch "
        f"in {options.dtype}. Run it on a GPU machine, or set device = 'cpu' in [backbone] to run it on the CPU "
        "anyway."
    )


def attach_preflight(factory: Any, transformer_class: str, model_name: str) -> None:
    """Give a paper-scale backbone's factory its two preflight hooks (``tpflow.preflight``), which load nothing:

    * ``check_machine``: the model needs a GPU, or device = "cpu" said explicitly, and the LoRA targets must name
      layers of its transformer (``transformer_class``, built on the meta device from its config when that is on
      this machine);
    * ``weight_sources``: ``pretrained`` is read from a complete local folder or its Hugging Face cache snapshot,
      never the network (``tpflow.weights``).
    """

    def check_machine(options: DiffusersBackboneOptions, settings: dict) -> list[str]:
        problem = cpu_problem(options, model_name)
        targets = lora_target_problems(transformer_class, options.pretrained, options.lora_targets, model_name)  # type: ignore[attr-defined]
        return ([problem] if problem else []) + targets

    def weight_sources(options: DiffusersBackboneOptions, settings: dict) -> list[WeightSource]:
        return [pretrained_source(options.pretrained, model_name)]  # type: ignore[attr-defined]

    factory.check_machine = check_machine
    factory.weight_sources = weight_sources


def fp32_parts(options: DiffusersBackboneOptions, trained: str = "transformer") -> tuple[str, ...]:
    """The pipeline parts loaded in float32 whatever ``dtype``: the VAE (it decodes in fp32: loaded in ``dtype`` and
    upcast, it would decode with rounded weights) and, under ``finetune = "full"``, the trained transformer (its
    fp32 masters and KL reference are then the stored weights exactly, not their rounding to ``dtype``)."""
    return ("vae", trained) if options.finetune == "full" else ("vae",)


def load_pipeline(
    pipeline_cls: Any, pretrained: str, dtype: torch.dtype, model_name: str, fp32: Sequence[str] = ("vae",),
    **kwargs: Any,
) -> Any:  # fmt: skip
    """``pipeline_cls.from_pretrained`` with a UserError that says which weights are missing and how to get them.

    The weights are found first (``pretrained_source``: a local folder, or a snapshot in the Hugging Face cache) and
    that folder is loaded, with ``local_files_only=True``: never the network, so no hub warnings and no stall, with
    or without HF_HUB_OFFLINE. Every part is loaded in ``dtype`` by its own class, which keeps the float32 modules
    its class names (``tpflow.backbones.placement``), but the parts named in ``fp32`` (``fp32_parts``): those are
    loaded in float32 from their subfolder and handed to the pipeline.
    """
    source = pretrained_source(pretrained, model_name)
    if source.problem or source.path is None:
        raise UserError(source.problem or f"The {model_name} weights '{pretrained}' were not found.")
    # a diffusers with _resolve_dtype (0.42 has it) takes `dtype` and warns (FutureWarning) on `torch_dtype`; older
    # ones know only `torch_dtype`
    from diffusers.pipelines import pipeline_utils

    kwargs["dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"] = dtype
    try:
        index = json.loads((Path(source.path) / "model_index.json").read_text())
        for name in fp32:
            library, class_name = index.get(name) or (None, None)
            if class_name is not None and name not in kwargs:
                part_cls = getattr(importlib.import_module(library), class_name)
                kwargs[name] = part_cls.from_pretrained(
                    source.path, subfolder=name, local_files_only=True, torch_dtype=torch.float32
                )
        return pipeline_cls.from_pretrained(source.path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"Could not load the {model_name} weights from '{pretrained}': {first}. {_how(pretrained)}"
        ) from None


def scheduler_sigmas(
    scheduler: Any, num_steps: int, image_seq_len: int, flux_style: bool, static_shift: float | None = None
) -> torch.Tensor:
    """The pipeline's sigma table σ_0..σ_K (final 0 included), [K + 1] float32, from a copy of its scheduler.

    SD3 calls ``set_timesteps(K)`` (static shift); FLUX passes ``linspace(1, 1/K, K)`` and the resolution-dependent
    ``mu`` (dynamic shifting: diffusers' ``calculate_shift`` of ``image_seq_len`` packed tokens). Both mirror
    diffusers' pipelines so rollouts match them step for step; this is tpflow's FLUX schedule by default (FLUX.1-dev
    at 512², 1024 tokens, K = 6: 1.0, 0.90374, …, 0.27300, 0). ``static_shift`` s replaces the dynamic shift by the
    scheduler's static one on the same grid, σ = s·t/(1 + (s − 1)·t): DanceGRPO's and MixGRPO's FLUX schedule
    (s = 3, docs/algorithm.md §10).
    """
    import numpy as np

    check_num_steps(num_steps)
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    overrides = {} if static_shift is None else {"shift": static_shift, "use_dynamic_shifting": False}
    sched = type(scheduler).from_config(scheduler.config, **overrides)
    cfg = sched.config
    kwargs: dict[str, Any] = {}
    if cfg.get("use_dynamic_shifting", False):
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15 if flux_style else 1.16),
        )
    if flux_style:
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", **kwargs)
    else:
        sched.set_timesteps(num_steps, device="cpu", **kwargs)
    return sched.sigmas.to(torch.float32).clone()


class PromptCache:
    """Prompt -> embedding rows, least recently used dropped beyond ``size`` entries (stored on the CPU)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def encode(
        self, prompts: Sequence[str], encode: Callable[[list[str]], dict[str, torch.Tensor]], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Rows of ``encode(prompts)`` [N, ...] on ``device``; only prompts not cached are encoded, each once (a
        rollout batch holds G copies of a prompt: its text encoders run on the distinct prompts, rows repeated)."""
        if self.size == 0:
            unique = list(dict.fromkeys(prompts))
            out = encode(unique)
            if len(unique) < len(prompts):
                where = {prompt: i for i, prompt in enumerate(unique)}
                rows = torch.tensor([where[p] for p in prompts], device=device)
                return {k: v.to(device)[rows] for k, v in out.items()}  # the distinct rows moved, then repeated
            return {k: v.to(device) for k, v in out.items()}
        todo = list(dict.fromkeys(p for p in prompts if p not in self._rows))
        if todo:
            fresh = encode(todo)
            for i, prompt in enumerate(todo):
                self._rows[prompt] = {k: v[i : i + 1].cpu() for k, v in fresh.items()}
        rows = []
        for prompt in prompts:
            self._rows.move_to_end(prompt)
            rows.append(self._rows[prompt])
        out = {k: torch.cat([r[k] for r in rows]).to(device) for k in rows[0]}
        while len(self._rows) > self.size:
            self._rows.popitem(last=False)
        return out


@dataclass
class PipelineParts:
    """A diffusers pipeline's parts, placed for training: what both diffusers backbones hold."""

    device: torch.device  # of the transformer, the VAE and the latents
    dtype: torch.dtype  # of the transformer and its inputs (float32 under full fine-tuning: its master weights)
    text_device: torch.device  # of the text encoders (the model's device or the CPU)
    transformer: Any  # in ``dtype``, LoRA added, eval mode
    vae: Any  # fp32, frozen
    scale: int  # the VAE's spatial factor
    cache: PromptCache
    adapter: Any  # diffusers_lora.LoraAdapter on ``transformer``, or full_finetune.FullWeights (finetune = "full")


def setup_pipeline(
    pipe: Any, options: DiffusersBackboneOptions, encoders: Sequence[str], trained: str = "transformer",
    frozen: Sequence[str] = (),
) -> PipelineParts:  # fmt: skip
    """Place a pipeline's parts and add the LoRA (or unfreeze the transformer: ``finetune = "full"``). The text
    encoders named in ``encoders`` are frozen on the text device; ``trained`` names the transformer that trains
    (Wan2.2: one of its two experts) and ``frozen`` other transformers, placed with it in its dtype and frozen."""
    from tpflow.backbones import diffusers_lora as lora
    from tpflow.backbones import full_finetune

    device, dtype = resolve_device(options.device), DTYPES[options.dtype]
    text_device = device if options.text_encoders_device == "model" else torch.device("cpu")
    full = options.finetune == "full"  # fp32 masters: the transformer is placed in float32, never rounded first
    transformer = place(getattr(pipe, trained), device, torch.float32 if full else dtype)
    for name in frozen:
        place(getattr(pipe, name), device, dtype).requires_grad_(False).eval()
    vae = place(pipe.vae, device, torch.float32).requires_grad_(False).eval()
    for name in encoders:
        encoder = getattr(pipe, name, None)
        if encoder is not None:
            place(encoder, text_device, dtype).requires_grad_(False).eval()
    if full:  # before compiling: the reference copy is a plain module
        adapter: Any = full_finetune.FullWeights(
            transformer, full_finetune.diffusers_save, full_finetune.diffusers_state
        )
        dtype = torch.float32
    else:
        config = lora.add_lora(
            transformer, options.lora_rank, options.lora_alpha, options.lora_targets, options.lora_init
        )
        adapter = lora.LoraAdapter(type(pipe), transformer, config)
    transformer.eval()  # no dropout: rollout and training compute the same function
    if options.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if options.compile_blocks:
        compile_blocks(transformer)
    cache = PromptCache(options.prompt_cache)
    scale = getattr(pipe, "vae_scale_factor", None) or pipe.vae_scale_factor_spatial  # Wan: spatial and temporal
    return PipelineParts(device, dtype, text_device, transformer, vae, scale, cache, adapter)


# SD3, FLUX, FLUX.2, Qwen-Image, shapes-dit, Wan; Z-Image's main stack and its refiners
REPEATED_BLOCKS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers", "noise_refiner",
                   "context_refiner", "siglip_refiner")  # fmt: skip


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` every block of the model's repeated-block lists in place (``nn.Module.compile``: names,
    state dicts and LoRA adapters are unchanged); returns the number compiled. Blocks of one class share their
    compiled code, so the compile time is that of one block per shape regime."""
    count = 0
    for name in REPEATED_BLOCKS:
        for block in getattr(model, name, None) or ():
            block.compile()
            count += 1
    if not count:
        raise UserError(f"compile_blocks: {type(model).__name__} has none of {REPEATED_BLOCKS} to compile.")
    return count


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """VAE latents (model space, unscaled) [N, C, h, w] to images [N, 3, H, W] float32 in [0, 1], in fp32."""
    cfg = vae.config
    x = latents.float() / cfg.scaling_factor + (cfg.shift_factor or 0.0)
    with torch.no_grad():
        image = vae.decode(x.to(next(vae.parameters()).device), return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)


def pipeline_class(name: str, model_name: str) -> Any:
    """diffusers' pipeline class ``name``; a UserError saying which diffusers has it when the installed one does not
    (the editing and 2026 pipelines came with diffusers 0.42, after the oldest release tpflow otherwise supports)."""
    import diffusers

    found = getattr(diffusers, name, None)  # diffusers' lazy module: an unknown name is None here, not an import
    if found is None:
        raise UserError(
            f"{model_name} needs diffusers' {name}, which the installed diffusers {diffusers.__version__} does not "
            "have: upgrade it (pip install 'diffusers>=0.42')."
        )
    return found
