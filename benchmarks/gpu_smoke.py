"""One TP-GRPO epoch with an SD3.5-Medium-sized transformer (random weights, no download): time per phase, memory.

    .venv/bin/python benchmarks/gpu_smoke.py [--resolution 512] [--prompts 3] [--group 12] [--dtype fp16]
    .venv/bin/python benchmarks/gpu_smoke.py --tiny        # the same code path on tiny-sd3 (CPU, seconds)
    .venv/bin/python benchmarks/gpu_smoke.py --set optimizer.beta=0 optimizer.recompute=reweight   # a variant

The transformer is ``SD3Transformer2DModel`` with SD3.5-Medium's real configuration (24 joint blocks, 13 with dual
attention, RMS qk-norm, 2.24 B parameters) and random weights, the VAE has SD3's real configuration, and the text
encoders are one-layer stand-ins with the real output widths (CLIP-L 768 + CLIP-G 1280 pooled, T5 4096), so
everything downstream of text encoding has the paper's shapes. The epoch is the trainer's own (recipe below):
K = 10, W = 9, cps 0.7, CFG 4.5, ODE completions, consistent turning points, GRPO micro-batches of 9 with 2
accumulation steps, LoRA r = 32 on the paper's targets. The default 3 prompts × 12 is one GPU's share (36
trajectories) of the reference's 8-GPU epoch. The reward is a pixel statistic, so reward time is not the real one.
Prints seconds per phase (sampling, decode, reward, update) and peak GPU memory; record them in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from tpflow.backbones.diffusers_common import DTYPES, DiffusersBackboneOptions
from tpflow.backbones.sd3 import SD3_LORA_TARGETS, SD3Backbone
from tpflow.backbones.tiny_tokenizers import clip_tokenizer, t5_tokenizer
from tpflow.memory.configs import SD3_VAE, SD35_MEDIUM_TRANSFORMER  # the published configurations
from tpflow.registry import names, register


class RandomSD35Options(DiffusersBackboneOptions):
    lora_targets: list[str] = Field(default_factory=lambda: list(SD3_LORA_TARGETS))
    negative_prompt: str = ""
    max_sequence_length: int = 256


def _stand_in_text_encoders() -> dict[str, Any]:
    """One-layer CLIP-L / CLIP-G / T5 encoders with the real output widths, and tokenizers built in code."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def clip(width: int) -> Any:
        cfg = CLIPTextConfig(
            hidden_size=width, intermediate_size=4 * width, num_attention_heads=width // 64, num_hidden_layers=1,
            vocab_size=1000, projection_dim=width, bos_token_id=998, eos_token_id=999, pad_token_id=999,
        )  # fmt: skip
        return CLIPTextModelWithProjection(cfg)

    t5_tok = t5_tokenizer()
    t5 = T5EncoderModel(
        T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=1, vocab_size=len(t5_tok))
    )
    return {
        "text_encoder": clip(768),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": clip(1280),
        "tokenizer_2": clip_tokenizer(pad_token="!"),
        "text_encoder_3": t5,
        "tokenizer_3": t5_tok,
    }


def random_sd35_backbone(
    resolution: int = 512, device: str = "cuda", dtype: str = "fp16", options: RandomSD35Options | None = None
) -> SD3Backbone:
    """An SD3Backbone whose transformer and VAE have SD3.5-Medium's real configurations, with random weights."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    options = options or RandomSD35Options(resolution=resolution, device=device, dtype=dtype)
    with torch.device(options.device or device):  # initialise directly on the GPU: seconds instead of minutes
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER).to(DTYPES[options.dtype])
        vae = AutoencoderKL(**SD3_VAE)
        encoders = _stand_in_text_encoders()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **encoders
    )
    return SD3Backbone(pipe, options)


if "sd3.5-medium-random" not in names("backbone"):

    @register("backbone", "sd3.5-medium-random", options=RandomSD35Options)
    def _random_sd35(options: RandomSD35Options) -> SD3Backbone:
        return random_sd35_backbone(options=options)


def recipe_data(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The epoch as a recipe: the paper's SD3.5-M algorithm settings at the requested scale."""
    if args.tiny:
        backbone: dict[str, Any] = {"name": "tiny-sd3", "resolution": 16, "lora_rank": 32, "lora_alpha": 64}
    else:
        backbone = {"name": "sd3.5-medium-random", "resolution": args.resolution, "dtype": args.dtype}
        backbone |= {"gradient_checkpointing": args.gradient_checkpointing, "lora_init": "gaussian"}
    return {
        "backbone": backbone,
        "reward": {"name": "image-stat"},
        "dataset": {"name": "shapes", "test_size": 4},
        "sampler": {"name": "cps"},
        "credit": {"name": "consistent", "balanced": True},
        "optimizer": {
            "name": "grpo",
            "learning_rate": 3e-4,
            "clip_range": 1e-5,
            "beta": 1e-4,
            "micro_batch_size": 9,
            "gradient_accumulation_steps": 2,
        },  # fmt: skip
        "rollout": {"num_steps": 10, "window_size": 9, "window_range": [0, 9], "noise_level": 0.7, "guidance": 4.5},
        "train": {
            "seed": 42,
            "epochs": 1,
            "prompts_per_epoch": args.prompts,
            "group_size": args.group,
            "rollout_batch": 9,
            "save_every": 0,
            "ema": False,
            "run_dir": str(run_dir),
            "mixed_precision": args.dtype,  # --tiny: torch's CPU autocast (tpflow.precision), the same code path
        },  # fmt: skip
        "eval": {"every": 0},
    }


def with_overrides(data: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """``--set section.key=value`` items (the value as TOML reads it: 0, true, "x"; else the bare word) applied."""
    import tomllib

    for item in items:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        try:
            parsed: Any = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word: recompute=reweight
        data.setdefault(section, {})[field] = parsed
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--group", type=int, default=12)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny-sd3 on the CPU: checks the script, measures nothing")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides: section.key=value (TOML values)")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu_smoke.py needs a CUDA GPU (or --tiny to check the code path on the CPU).")

    from tpflow.recipe import validate_recipe
    from tpflow.train.trainer import Trainer

    cuda = torch.cuda.is_available() and not args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        recipe = validate_recipe(with_overrides(recipe_data(args, Path(tmp) / "run"), args.set), where="gpu_smoke")
        trainer = Trainer(recipe, run_dir=Path(tmp) / "run")
        build_s = time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        metrics = trainer.fit()
        if cuda:
            torch.cuda.synchronize()
    report = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "overrides": " ".join(args.set),
        "backbone": recipe.backbone.name,
        "trajectories": args.prompts * args.group,
        "resolution": 16 if args.tiny else args.resolution,
        "trainable_params": sum(p.numel() for p in trainer.backbone.trainable_parameters()),
        "transformer_params": sum(p.numel() for p in trainer.backbone.transformer.parameters()),
        "build_s": build_s,
        **{
            k: metrics[k]
            for k in (
                "sample_s",
                "model_s",
                "decode_s",
                "reward_s",
                "update_s",
                "epoch_s",
                "nfe_per_traj",
                "first_ratio_max_deviation",
                "ratio_max_deviation",
                "clip_fraction",
                "rows_trained",
                "optimizer_steps",
                "skipped_steps",
                "nonfinite_losses",
                "loss",
                "kl",
            )  # fmt: skip
        },
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    for key, value in report.items():
        print(f"{key:>26}: {value:.3g}" if isinstance(value, float) else f"{key:>26}: {value}")
    # first_ratio_max_deviation: rollout against update before any step (batch shapes and precision only);
    # ratio_max_deviation includes the steps after it, which must move the ratio (docs/training.md, "Mixed precision")
    if report["nonfinite_losses"] or report["optimizer_steps"] < 1:
        raise SystemExit(f"gpu_smoke: no finite optimizer step ({report['nonfinite_losses']:g} non-finite losses).")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
