"""Peak GPU memory per process of each paper recipe, ESTIMATED without a GPU (fake tensors, full size).

    .venv/bin/python benchmarks/memory_estimate.py --out docs/results     # the four paper recipes, full size
    .venv/bin/python benchmarks/memory_estimate.py --tiny                 # tiny-sd3 / tiny-flux sizes (a check)

Why: the distributed-training doc needs the memory each recipe needs per GPU, and the machines that write it have no
GPU. How: the real diffusers classes with the real configurations are built under ``FakeTensorMode`` (tensors
with shapes, dtypes and storages but no data: nothing is allocated or computed), wrapped in tpflow's own
``SD3Backbone`` / ``FluxBackbone`` with tpflow's own LoRA, and the real code paths run on them: one rollout
velocity call, one GRPO training step (``GRPO._step_loss`` + backward), one VAE decode. ``LiveBytes`` counts the
bytes of every tensor storage as ops create it and subtracts them when the storage dies (weakref finalizers), so
its peak is the peak of live tensor bytes. Activations are that peak minus what was alive before the call.
Weights, LoRA state and epoch buffers are numel × element size. Caveats are listed in ``CAVEATS``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import SD3_VAE, SD35_MEDIUM_TRANSFORMER  # noqa: E402

GIB = 2**30
RECIPES = (
    "geneval_tp", "ocr_tp", "pickscore_tp", "flux_pickscore_tp", "pickscore_sd35large_tp", "geneval_qwenimage_tp",
    "geneval_flowgrpo_full", "geneval_qwenimage_flowgrpo_sharded",
)  # fmt: skip

# ---- configurations (published config.json values) -----------------------------------------------------------

FLUX_DEV_TRANSFORMER = {  # black-forest-labs/FLUX.1-dev transformer/config.json (11.9 B parameters)
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_VAE = SD3_VAE | {"scaling_factor": 0.3611, "shift_factor": 0.1159}  # FLUX.1-dev vae/config.json
QWEN_IMAGE_TRANSFORMER = {  # Qwen/Qwen-Image transformer/config.json (20.4 B parameters)
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWEN_VAE = {  # Qwen/Qwen-Image vae/config.json (the latent mean and std do not change the memory)
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
}  # fmt: skip
QWEN25_VL_7B = {  # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B: 8.29 B parameters with its vision tower)
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584},
    "vocab_size": 152064, "hidden_size": 3584,
}  # fmt: skip
SD35_LARGE_TRANSFORMER = SD35_MEDIUM_TRANSFORMER | {  # stabilityai/stable-diffusion-3.5-large transformer/config.json
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
    "dual_attention_layers": (),
}  # 8.1 B parameters
CLIP_L = {  # openai/clip-vit-large-patch14 text_config (SD3 text_encoder, FLUX text_encoder)
    "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
    "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu",
}  # fmt: skip
CLIP_G = {  # laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower (SD3 text_encoder_2/config.json)
    "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32,
    "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu",
}  # fmt: skip
T5_XXL = {  # google/t5-v1_1-xxl encoder (SD3 text_encoder_3, FLUX text_encoder_2 config.json)
    "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
}  # fmt: skip
# the test sizes of docs/architecture.md (tiny-sd3 / tiny-flux), for --tiny
# (two blocks so that gradient checkpointing has something to save)
TINY_SD3 = {
    "sample_size": 32, "patch_size": 1, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4, "caption_projection_dim": 32, "joint_attention_dim": 32, "pooled_projection_dim": 64,
    "out_channels": 4, "dual_attention_layers": (0,), "qk_norm": "rms_norm",
}  # fmt: skip
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 4, 8),
    "guidance_embeds": True,
}  # fmt: skip
TINY_VAE = {
    "block_out_channels": (4,), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 1,
    "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip

CAVEATS = """\
**Estimated, not measured on a GPU; validate with `benchmarks/gpu_smoke.py` on a GPU** (it prints
`torch.cuda.max_memory_allocated`).

Method. The real diffusers transformer and VAE classes with the published configurations (SD3.5-M's from
`benchmarks/gpu_smoke.py`, FLUX.1-dev's and the text encoders' in `benchmarks/memory_estimate.py`) are built under
`torch._subclasses.fake_tensor.FakeTensorMode`: every tensor has its real shape, dtype and storage size but no data,
so nothing is allocated and nothing is computed. tpflow's own `SD3Backbone` / `FluxBackbone` (with tpflow's peft
LoRA on the recipe's targets and rank) run their real code on them: `velocity` for the largest rollout call,
`GRPO._step_loss` + `backward()` for one training micro-batch, `decode` for one scoring chunk. A
`TorchDispatchMode` (`LiveBytes`) adds the bytes of each new tensor storage and subtracts them when the storage is
freed, so its peak is the peak of live tensor bytes; an activation figure is that peak minus what was alive before
the call. Weights, LoRA state and epoch buffers are numel × element size (the text encoders' parameters counted on
the meta device).

Caveats.
- Attention kernel: the fake tensors live on the CPU device (autograd cannot run backward on fake CUDA tensors
  without a CUDA driver), where `scaled_dot_product_attention` dispatches to the flash kernel
  (`_scaled_dot_product_flash_attention_for_cpu`): it keeps the output and a float32 log-sum-exp [B, H, L], never
  the L×L matrix — the same footprint as the flash / memory-efficient kernels PyTorch picks on an A100/H100 for
  these fp16/bf16, head-dim 64/128 shapes. The math kernel would add B·H·L² elements per attention (about 13 GiB
  per attention for the SD3.5-M rollout call) and is not what a GPU runs. The kernels' backward workspaces (flash
  v2 keeps a float32 dq accumulator of the size of q) are not modelled.
- Autocast: the trainer runs rollouts and updates under `accelerator.autocast()` (CUDA autocast with the recipe's
  `mixed_precision`). CUDA autocast cannot be switched on without a CUDA device, so `CudaAutocast` (a
  `TorchFunctionMode`) applies its policy at the Python call: matmul-type ops (linear, matmul, conv,
  scaled_dot_product_attention, ...) cast their floating inputs to the low-precision dtype, with the cast of leaf
  weights cached as autocast caches them; `layer_norm`, `group_norm`, `softmax`, `exp`, `pow`, `sum`, ... cast to
  float32. Ops reached only through a C++ decomposition are not cast, unlike CUDA autocast.
- The CUDA caching allocator rounds blocks up (512 B, 2 MiB segments) and fragments; `max_memory_reserved` is
  typically 5-20 % above the live-bytes peak estimated here. The CUDA context (~0.5 GiB) and cuBLAS/cuDNN
  workspaces are not counted.
- Data-dependent Python reads of fake tensors (validity checks such as `bool((std == 0).all())`, logged floats)
  read 0, so checks pass and logged diagnostics are 0; no memory depends on them.
- Not counted: reward models (GenEval's Mask2Former + CLIP, PickScore's CLIP-H ~2 GiB in fp16; OCR runs on the CPU),
  evaluation sampling (`eval.batch_size` rows, ODE, no completions: smaller than the rollout call), and the
  prompt-encoding forward of the text encoders (short, before the rollout).

What the code does about it (tpflow/train/trainer.py, tpflow/train/scoring.py), after the first version of this
estimate showed three problems:
- The scoring worker decodes and scores `train.score_batch` latents per call (default 16; it used to decode a
  whole rollout batch, n·(W+1) latents, in one fp32 VAE call, the largest activation of every recipe at 512 px).
- The decoded images are dropped once scored (they used to stay referenced until the update ended).
- The rollouts keep no completion latents once scored, and the per-batch list is released right after
  `Rollout.cat`: the update holds one copy of the epoch's rollout tensors (two only during the concatenation).
- Epoch buffers scale with the trajectories a process holds, so they shrink with more processes; weights and the
  activations do not.
"""


# ---- live tensor bytes -------------------------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now (``live``) and at most (``peak``), counted as ops create them.

    Works on real and on fake tensors (a fake tensor's storage has its real size). Tensors created before the mode
    was entered are counted only when passed to ``add``. Scalar reads of fake tensors (``bool``, ``float``) return
    0: under FakeTensorMode they have no value, and tpflow's reads are checks and logged diagnostics.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.ops: set[str] = set()  # names of the ops seen (to tell which attention kernel ran)
        self._seen = WeakIdKeyDictionary()

    def add(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> int:
        """Start a new peak at the current live bytes; returns them."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return False if args[0].dtype == torch.bool else 0
        self.ops.add(str(func))
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        return out


LOWER_PRECISION_OPS = frozenset(  # CUDA autocast's float16/bfloat16 list (torch docs, "Autocast Op Reference")
    "linear matmul __matmul__ __rmatmul__ mm bmm baddbmm addmm addbmm addmv addr mv chain_matmul multi_dot prelu "
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d scaled_dot_product_attention".split()
)
FLOAT32_OPS = frozenset(  # CUDA autocast's float32 list (the ops a diffusion transformer or VAE reaches)
    "layer_norm group_norm softmax log_softmax softmin exp expm1 log log1p log2 log10 pow __pow__ __rpow__ rsqrt "
    "reciprocal sum prod cumsum cumprod norm normalize softplus mse_loss cosine_similarity".split()
)


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casting policy applied at the Python call, for devices where autocast cannot be enabled."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # leaf weight -> its cast, as autocast
        self._depth = 0

    def __enter__(self) -> CudaAutocast:
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._cache.clear()  # as autocast empties its cache when the outermost context exits
        super().__exit__(*exc)

    def _cast(self, to: torch.dtype, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype in (to, torch.float64):
            return t
        if to != torch.float32 and t.is_leaf and t.requires_grad:
            hit = self._cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = self._cache[id(t)] = (t, t.to(to))
            return hit[1]
        return t.to(to)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.backward and len(args) == 1 and not any((kwargs or {}).values()):
            # A handler runs with its mode off, so ``loss.backward()`` would recompute checkpointed blocks without
            # the policy (autocast keeps it on there); run the engine directly with the mode on.
            from torch.autograd.graph import _engine_run_backward

            with self:
                _engine_run_backward(
                    (args[0],),
                    (torch.ones_like(args[0]),),
                    False,
                    False,
                    (),
                    allow_unreachable=True,
                    accumulate_grad=True,
                )
            return None
        to = self.dtype if name in LOWER_PRECISION_OPS else torch.float32 if name in FLOAT32_OPS else None
        if to is not None:
            args, kwargs = tree_map_only(torch.Tensor, functools.partial(self._cast, to), (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


# ---- models --------------------------------------------------------------------------------------------------


def count_bytes(module: torch.nn.Module) -> int:
    """numel × element size of the parameters and buffers (shared storages once)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def largest_block_bytes(module: torch.nn.Module) -> int:
    """Bytes of the largest repeated block (what FSDP2 gathers at once for its forward or backward)."""
    from tpflow.train.sharding import BLOCK_LISTS

    blocks = [b for name in BLOCK_LISTS for b in getattr(module, name, None) or ()]
    return max((count_bytes(b) for b in blocks), default=0)


def text_encoder_params(kind: str) -> dict[str, int]:
    """Parameter counts of the real text encoders, built on the meta device."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if kind == "qwen":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B))
        return {"Qwen2.5-VL-7B": sum(p.numel() for p in model.parameters())}
    with torch.device("meta"):
        if kind == "sd3":
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
    return {name: sum(p.numel() for p in m.parameters()) for name, m in encoders.items()}


def build_backbone(kind: str, transformer_cfg: dict, vae_cfg: dict, options: Any) -> Any:
    """tpflow's SD3Backbone / FluxBackbone around a transformer and VAE of the given configurations (no encoders).

    Call it under FakeTensorMode for full sizes. ``options`` is the recipe's validated backbone section.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    from tpflow.backbones.flux import FluxBackbone
    from tpflow.backbones.sd3 import SD3Backbone

    if kind == "qwen":
        return _qwen_backbone(transformer_cfg, vae_cfg, options)
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
        return (SD3Backbone if kind == "sd3" else FluxBackbone)(pipe, options)


def _qwen_backbone(transformer_cfg: dict, vae_cfg: dict, options: Any) -> Any:
    """tpflow's QwenImageBackbone around a transformer and VAE of the given configurations (no text encoder)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from tpflow.backbones.qwen_image import QwenImageBackbone

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
        return QwenImageBackbone(pipe, options)


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


def conditioning(backbone: Any, kind: str, rows: int, text_len: int, device: str = "cpu") -> Any:
    """Prompt embeddings of ``rows`` prompts with the shapes the real encoders give (values irrelevant)."""
    from tpflow.types import Conditioning

    cfg, dtype = backbone.transformer.config, backbone.dtype
    embeds = torch.randn(rows, text_len, cfg.joint_attention_dim, dtype=dtype, device=device)
    if kind == "qwen":  # prompt embeddings padded to max_sequence_length with their mask, and the negative prompt's
        mask = torch.ones(rows, text_len, dtype=torch.long, device=device)
        negative = {"prompt_embeds": embeds[:1].clone(), "mask": mask[:1].clone()}
        return Conditioning({"prompt_embeds": embeds, "mask": mask}, {"negative": negative})
    pooled_dim = cfg.pooled_projection_dim
    pooled = torch.randn(rows, pooled_dim, dtype=dtype, device=device)
    if kind == "sd3":
        negative = {"prompt_embeds": embeds[:1].clone(), "pooled": pooled[:1].clone()}
        return Conditioning({"prompt_embeds": embeds, "pooled": pooled}, {"negative": negative})
    txt_ids = torch.zeros(text_len, 3, dtype=dtype, device=device)
    return Conditioning({"prompt_embeds": embeds, "pooled": pooled}, {"txt_ids": txt_ids, "img_ids": backbone.img_ids})


def latents(backbone: Any, rows: int) -> torch.Tensor:
    return backbone.initial_noise(rows)  # [rows, C, h, w] (SD3) or packed [rows, S, 4C] (FLUX), float32


# ---- the rollout's largest velocity call ---------------------------------------------------------------------


def rollout_rows(num_steps: int, width: int, start: int, n: int, noise_rows: int | None = None,
                 completions: str | None = "ode", baseline_noise: str = "shared") -> list[int]:  # fmt: skip
    """Rows of the one velocity call of each step k of ``tpflow.rollout.rollout`` (max_batch unset), [K] ints.

    At step k: the main trajectory (n rows; the P noise rows before the window), an independent baseline (n rows,
    from step 0), and every ODE branch started before k: the shared baseline j = 0 (P rows) and completions
    j = 1..W-1 (n rows each). ``noise_rows`` P defaults to n (``same_noise`` off).
    """
    p = n if noise_rows is None else noise_rows
    rows = []
    for k in range(num_steps):
        count = n if k >= start else p
        if completions is not None and baseline_noise == "independent":
            count += n
        if completions == "ode":
            started = [j for j in range(width) if start + j < k]
            count += sum((p if baseline_noise == "shared" else 0) if j == 0 else n for j in started)
        rows.append(count)
    return rows


# ---- measurements --------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """What one estimate needs from a recipe (all validated recipe values)."""

    name: str
    kind: str  # "sd3" or "flux"
    backbone: Any  # the backbone options
    rollout: Any
    train: Any
    optimizer: Any
    transformer_cfg: dict
    vae_cfg: dict
    text_len: int  # tokens of the transformer's text sequence
    figures: dict[str, float] = field(default_factory=dict)
    sampler: str = "cps"  # the recipe's [sampler] (the training step's log-probability)


def load_setup(path: Path) -> Setup:
    from tpflow.recipe import load_recipe

    recipe = load_recipe(path)
    options = recipe.backbone.options
    name = recipe.backbone.name
    kind = "flux" if "flux" in name else "qwen" if "qwen" in name else "sd3"
    text_len = options.max_sequence_length + (77 if kind == "sd3" else 0)  # SD3: CLIP 77 tokens + T5, concatenated
    return Setup(
        path.stem, kind, options, recipe.rollout, recipe.train, recipe.optimizer.options,
        {"sd3.5-large": SD35_LARGE_TRANSFORMER}.get(name, SD35_MEDIUM_TRANSFORMER) if kind == "sd3"
        else QWEN_IMAGE_TRANSFORMER if kind == "qwen" else FLUX_DEV_TRANSFORMER,
        {"sd3": SD3_VAE, "qwen": QWEN_VAE}.get(kind, FLUX_VAE), text_len, sampler=recipe.sampler.name,
    )  # fmt: skip


def measure(setup: Setup, fake: bool = True) -> dict[str, Any]:
    """Activation peaks (bytes) of the rollout call, the training step (checkpointing on and off) and a decode."""
    from tpflow.backbones.diffusers_common import DTYPES
    from tpflow.optim.grpo import GRPO
    from tpflow.registry import build
    from tpflow.types import Rollout, RolloutCost

    r, t, o = setup.rollout, setup.train, setup.optimizer
    precision = t.mixed_precision
    n = t.rollout_batch
    lo, hi = r.window_range
    rows = max(max(rollout_rows(r.num_steps, r.window_size, s, n)) for s in range(lo, hi - r.window_size + 1))
    rows = min(rows, r.max_batch or rows)
    out: dict[str, Any] = {"rollout_rows": rows}
    with ExitStack() as stack:
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        tracker = stack.enter_context(LiveBytes())
        backbone = build_backbone(setup.kind, setup.transformer_cfg, setup.vae_cfg, setup.backbone)
        lora = backbone.trainable_parameters()  # a full fine-tune's: every transformer weight (fp32 masters)
        out["latent_numel"] = latents(backbone, 1).numel()
        out["weights_tracked"] = tracker.live
        out["transformer_bytes"] = count_bytes(backbone.transformer) - sum(p.numel() * 4 for p in lora)
        out["largest_block_bytes"] = largest_block_bytes(backbone.transformer)
        out["vae_bytes"] = count_bytes(backbone.vae)
        out["lora_params"] = sum(p.numel() for p in lora)
        autocast = CudaAutocast(DTYPES[precision]) if precision != "no" else None

        def peak_of(fn: Callable[[], Any], autocast: CudaAutocast | None = autocast) -> int:
            with ExitStack() as inner:
                if autocast is not None:
                    inner.enter_context(autocast)
                before = tracker.reset_peak()
                fn()
            return tracker.peak - before

        # (a) the largest rollout velocity call, no grad (CFG doubles the transformer's rows inside for SD3)
        cond, z = conditioning(backbone, setup.kind, rows, setup.text_len), latents(backbone, rows)
        sigma = torch.full((rows,), 0.5)
        with torch.no_grad():
            out["rollout_act"] = peak_of(lambda: backbone.velocity(z, sigma, cond, r.guidance))
        cond = z = sigma = None  # free before the next baseline

        # (b) one training micro-batch: GRPO's own step loss (policy forward, reference forward, KL) + backward
        b = o.micro_batch_size
        shape = latents(backbone, b).shape
        part = Rollout(
            latents=torch.randn(b, 1, *shape[1:]), next_latents=torch.randn(b, 1, *shape[1:]),
            log_probs=torch.zeros(b, 1), sigmas=torch.tensor([[0.6, 0.5]]).expand(b, 2).clone(),
            noise_level=r.noise_level, guidance=r.guidance, cond=conditioning(backbone, setup.kind, b, setup.text_len),
            final=torch.randn(shape), completions=None, cost=RolloutCost(nfe=0.0),
        )  # fmt: skip
        for p in lora:  # steady state: grads exist from the previous micro-batch and are accumulated in place
            p.grad = torch.zeros_like(p)
        grpo, sampler = GRPO(o), build("sampler", setup.sampler)

        def train_step() -> None:
            grpo._step_loss(backbone, sampler, part, torch.ones(b), 0).total.backward()

        for ckpt in (False, True):
            if ckpt:
                backbone.transformer.enable_gradient_checkpointing()
            else:
                backbone.transformer.disable_gradient_checkpointing()
            out[f"train_act_ckpt_{ckpt}"] = peak_of(train_step)
        cfg_rows = (setup.kind == "sd3" and r.guidance != 1) or (setup.kind == "qwen" and r.guidance > 1)
        out["train_rows"] = b * (2 if cfg_rows else 1)
        part = None

        # (c) one decode chunk of the scoring worker (train.score_batch of the n·W completions + n finals of a rollout
        # batch), fp32 VAE, in the worker's thread, where the trainer's autocast (thread-local) is off
        chunk = min(setup.train.score_batch, n * (r.window_size + 1))
        zc = latents(backbone, chunk)
        with torch.no_grad():
            out["decode_act"] = peak_of(lambda: backbone.decode(zc), autocast=None)
        out["decode_rows"] = chunk
        out["attention_ops"] = sorted(op for op in tracker.ops if "attention" in op)
    return out


# ---- the report --------------------------------------------------------------------------------------------------


def epoch_buffers(setup: Setup, m: dict[str, Any], trajectories: int) -> dict[str, int]:
    """Bytes the trainer keeps on the GPU across an epoch (tpflow/train/trainer.py ``train_epoch``, types.Rollout).

    Per trajectory (``rollout``): latents and next_latents [W, *latent] fp32, final [*latent] fp32 (the completions
    are dropped once scored), prompt embeddings [L, D] + pooled [P] in the model dtype, sigmas and log-probs. The
    update concatenates the batches (``Rollout.cat``) and then releases them: two copies only at that moment
    (``rollout_copy``). Decoded images are not kept.
    """
    wbytes = {"fp16": 2, "bf16": 2, "fp32": 4}[setup.backbone.dtype]
    w, cfg = setup.rollout.window_size, setup.transformer_cfg
    latent = m["latent_numel"] * 4  # fp32; SD3.5 / FLUX: 16 channels at 1/8 of the resolution (FLUX packed)
    embeds = (setup.text_len * cfg["joint_attention_dim"] + cfg.get("pooled_projection_dim", 0)) * wbytes
    per_traj = (2 * w + 1) * latent + embeds + (w + 1) * 4 + w * 4  # + sigmas [W+1], log_probs [W] fp32
    return {"rollout": trajectories * per_traj, "rollout_copy": trajectories * per_traj}


def peaks(setup: Setup, m: dict[str, Any], static: int, trajectories: int) -> tuple[int, int]:
    """(sampling phase, update phase) peaks: static + what the epoch keeps + the phase's largest activation.

    Sampling: the rollout tensors, a rollout call and a decode running at once (the scoring thread decodes batch b
    while batch b+1 is sampled). Update: the larger of the concatenation (two rollout copies) and one copy plus the
    training step with the recipe's ``gradient_checkpointing``.
    """
    buf = epoch_buffers(setup, m, trajectories)
    sampling = static + buf["rollout"] + m["rollout_act"] + m["decode_act"]
    train = m[f"train_act_ckpt_{setup.backbone.gradient_checkpointing}"]
    update = static + buf["rollout"] + max(buf["rollout_copy"], train)
    return sampling, update


def state_rows(setup: Setup, m: dict[str, Any]) -> list[tuple[str, int, str, bool]]:
    """The trained model's weights and optimizer state: (name, bytes, note, sharded under ``shard = "fsdp"``).

    LoRA: the frozen base in the recipe's dtype, the adapter, its gradient, AdamW moments and EMA in fp32. Full
    fine-tuning: fp32 master weights, gradients, moments, EMA, and the KL reference's frozen copy when beta > 0 (in
    fp32, on the device once used; tpflow/backbones/full_finetune.py). Sharded, each process holds 1/P of each."""
    b, t, o = setup.backbone, setup.train, setup.optimizer
    n = m["lora_params"]
    if getattr(b, "finetune", "lora") == "full":
        return [
            (f"transformer weights, fp32 masters ({n / 1e9:.2f} B params)", n * 4, "fp32, trained", True),
            ("transformer buffers", m["transformer_bytes"], "", False),
            ("gradients", n * 4, "fp32", True),
            ("AdamW states (exp_avg, exp_avg_sq)", n * 8, "fp32", True),
            ("EMA copy of the model", n * 4 if t.ema else 0, "fp32" if t.ema else "ema off", True),
            ("KL reference: frozen initial copy", n * 4 if getattr(o, "beta", 0) > 0 else 0,
             "fp32" if getattr(o, "beta", 0) > 0 else "beta = 0: none", True),
        ]  # fmt: skip
    return [
        (
            "transformer weights and buffers",
            m["transformer_bytes"],
            f"{b.dtype}; SD3's pos_embed buffer included" if setup.kind == "sd3" else b.dtype,
            True,
        ),
        (f"LoRA r={b.lora_rank} ({n / 1e6:.1f} M params)", n * 4, "fp32", True),
        ("LoRA grads", n * 4, "fp32", True),
        ("AdamW states (exp_avg, exp_avg_sq)", n * 8, "fp32", True),
        ("EMA copy of the LoRA", n * 4 if t.ema else 0, "fp32" if t.ema else "ema off", True),
    ]


def static_bytes(setup: Setup, m: dict[str, Any], rows: list[tuple[str, int, str, bool]], world: int) -> int:
    """What a process holds outside the activations on ``world`` processes: with ``shard = "fsdp"`` (and more than one
    process) the sharded rows over ``world`` plus two gathered blocks (the one computing and the one prefetched)."""
    if setup.train.shard != "fsdp" or world == 1:
        return sum(v for _, v, _, _ in rows)
    sharded = sum(v for _, v, _, s in rows if s)
    return sum(v for _, v, _, s in rows if not s) + -(-sharded // world) + 2 * m["largest_block_bytes"]


def report(setup: Setup, m: dict[str, Any], world_sizes: tuple[int, ...] = (1, 8, 32), unit: int = GIB) -> str:
    """One recipe's markdown section: the component table and the peaks per number of processes."""
    b, t = setup.backbone, setup.train
    u = {GIB: "GiB", 2**20: "MiB", 2**10: "KiB"}[unit]
    wbytes = {"fp16": 2, "bf16": 2, "fp32": 4}[b.dtype]
    on_gpu = b.text_encoders_device == "model"
    trained = state_rows(setup, m)
    rows: list[tuple[str, int, str, bool]] = [trained[0], ("VAE weights", m["vae_bytes"], "fp32", False)]
    for name, count in (text_encoder_params(setup.kind) if unit == GIB else {}).items():
        where = b.dtype if on_gpu else f"on the CPU (text_encoders_device), {count * wbytes / unit:.2f} {u} there"
        rows.append((f"{name} weights ({count / 1e9:.2f} B params)", count * wbytes if on_gpu else 0, where, False))
    rows += trained[1:]
    static = static_bytes(setup, m, rows, 1)
    ckpt = b.gradient_checkpointing
    cfg = " (×2 with CFG)" if setup.kind in ("sd3", "qwen") and setup.rollout.guidance != 1 else ""
    rows_t = m["train_rows"]
    act = [
        (f"largest rollout velocity call, {m['rollout_rows']} rows{cfg}", m["rollout_act"], "no_grad"),
        (
            f"VAE decode of one scoring chunk, {m['decode_rows']} latents",
            m["decode_act"],
            "no_grad, fp32, scoring thread",
        ),
        (
            f"training micro-batch, {rows_t} transformer rows, no checkpointing",
            m["train_act_ckpt_False"],
            "policy fwd + reference fwd + bwd" + ("" if ckpt else "; **recipe**"),
        ),
        (
            f"training micro-batch, {rows_t} transformer rows, gradient checkpointing",
            m["train_act_ckpt_True"],
            "policy fwd + reference fwd + bwd" + ("; **recipe**" if ckpt else ""),
        ),
    ]
    total = t.prompts_per_epoch * t.group_size
    buf = epoch_buffers(setup, m, total)
    kept = [
        ("rollout tensors of the epoch", buf["rollout"], f"{total} trajectories"),
        ("`Rollout.cat` copy during the update", buf["rollout_copy"], "while concatenating only"),
    ]
    model = {"flux": "FLUX.1-dev", "qwen": "Qwen-Image"}.get(setup.kind) or (
        "SD3.5-Large" if setup.transformer_cfg is SD35_LARGE_TRANSFORMER else "SD3.5-Medium"
    )
    lines = [f"## {setup.name} ({model}, {b.dtype}, {b.resolution} px, mixed_precision = {t.mixed_precision})", ""]
    lines += [f"| component | {u} | note |", "|---|---:|---|"]
    sharded = t.shard == "fsdp"
    lines += [f"| {n} | {v / unit:.2f} | {note}{'; sharded' if s and sharded else ''} |" for n, v, note, s in rows]
    lines += [f"| **weights and optimizer state** | **{static / unit:.2f}** | |"]
    lines += [f"| activations: {n} | {v / unit:.2f} | {note} |" for n, v, note in act]
    lines += [f"| epoch, one process: {n} | {v / unit:.2f} | {note} |" for n, v, note in kept]
    sampling, update = peaks(setup, m, static, total)
    phases = f"sampling {sampling / unit:.1f}, update {update / unit:.1f}"
    lines += [f"| **peak, one process** ({phases}) | **{max(sampling, update) / unit:.1f}** | |", ""]
    lines += [f"| processes | trajectories each | sampling peak ({u}) | update peak ({u}) | peak ({u}) |"]
    lines += ["|---:|---:|---:|---:|---:|"]
    for world in world_sizes:
        each = -(-total // world)
        sampling, update = peaks(setup, m, static_bytes(setup, m, rows, world), each)
        lines.append(
            f"| {world} | {each} | {sampling / unit:.1f} | {update / unit:.1f} | {max(sampling, update) / unit:.1f} |"
        )
    if sharded:
        block = m["largest_block_bytes"] / unit
        lines += ["", f"Sharded (FSDP2): on P > 1 processes each holds 1/P of the rows marked sharded, plus two "
                  f"gathered blocks ({block:.2f} {u} each: the one computing and the one prefetched)."]  # fmt: skip
    lines += ["", f"Attention ops that ran: {', '.join(f'`{a}`' for a in m['attention_ops'])}.", ""]
    return "\n".join(lines)


def tiny_setup(kind: str) -> Setup:
    """A recipe-shaped setup at the test sizes of docs/architecture.md (fp32, no autocast): what --tiny and the tests
    run."""
    from tpflow.backbones.flux import FluxOptions
    from tpflow.backbones.sd3 import SD3Options
    from tpflow.optim.grpo import GRPOOptions
    from tpflow.settings import RolloutSettings, TrainSettings

    sd3 = kind == "sd3"
    options = (SD3Options if sd3 else FluxOptions)(
        dtype="fp32", resolution=16 if sd3 else 32, lora_rank=4, max_sequence_length=8
    )
    rollout = RolloutSettings(num_steps=4, window_size=3, window_range=(0, 3), guidance=4.5 if sd3 else 3.5)
    return Setup(
        f"tiny-{kind}", kind, options, rollout, TrainSettings(rollout_batch=2, prompts_per_epoch=2, group_size=2),
        GRPOOptions(micro_batch_size=2), TINY_SD3 if sd3 else TINY_FLUX, TINY_VAE, 8 + (77 if sd3 else 0),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write memory_estimate.md into this folder")
    parser.add_argument("--tiny", action="store_true", help="tiny-sd3 / tiny-flux sizes: checks the code, seconds")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), help="recipe stems under recipes/")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    if args.tiny:
        setups = [tiny_setup("sd3"), tiny_setup("flux")]
    else:
        setups = [load_setup(root / "recipes" / f"{name}.toml") for name in args.recipes]
    sections, cache = [], {}
    for setup in setups:
        key = (setup.kind, repr(setup.backbone), repr(setup.rollout), repr(setup.train), repr(setup.optimizer))
        start = time.perf_counter()
        if key not in cache:  # geneval / ocr / pickscore share every memory-relevant setting
            cache[key] = measure(setup)
        print(f"{setup.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        sections.append(report(setup, cache[key], unit=2**10 if args.tiny else GIB))
    text = "# Estimated peak GPU memory per process\n\n" + CAVEATS + "\n" + "\n".join(sections)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_estimate.md").write_text(text)


if __name__ == "__main__":
    main()
