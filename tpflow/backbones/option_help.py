"""The descriptions of the option fields several backbones declare, each written once.

A backbone's options keep their own defaults and bounds (a model's public config: ``tpflow components backbone NAME``
lists them) and take the field's description from here, so ``lora_alpha`` or ``device`` reads the same on every
backbone; where the models differ, the one text says how (tests/test_option_descriptions.py holds it: no two
backbones describe one name two ways). Plain strings, no import: every backbone module can read them.
"""

from __future__ import annotations

PRETRAINED = "Hub id (read from the local HF cache) or a local folder in diffusers layout."
DTYPE = (
    "Transformer and text-encoder dtype, but for the modules each model keeps in fp32 (the VAE is loaded and "
    "decodes in fp32; a full fine-tune's transformer is loaded in fp32)."
)
DEVICE = (
    "Torch device of the model and its latents; None (where the model allows it) or 'auto': CUDA when available, "
    "else the CPU. The test-size models (tiny-*, shapes-*) default to the CPU."
)
RESOLUTION = (
    "Image height and width in pixels; a video model's clip height (its width is the width option). The default is "
    "the model's (a released model's card's). A size must suit the VAE's downsampling and the transformer's patches "
    "(the tiny SD3 and FLUX VAEs do not downsample, the tiny Qwen-Image one 4×); the Wan models take a multiple of "
    "twice their VAE's factor (Wan2.1 and the tiny Wan ones: 16, Wan2.2 TI2V: 32), checked when the model is built."
)
WIDTH = (
    "Clip width in pixels; None: the height. A multiple of 16 for Wan2.1, of 32 for Wan2.2 TI2V (checked when the "
    "model is built)."
)
NUM_FRAMES = "Frames per clip: 4k + 1 (the Wan VAE's temporal compression)."
FLOW_SHIFT = (
    "Static shift of the flow-matching schedule; the default is the model's config (Wan2.1 480p: 3, 720p: 5; "
    "Wan2.2 t2v-A14B: 12, ti2v-5B: 5)."
)
MAX_SEQUENCE_LENGTH = (
    "Text-encoder tokens per prompt, its pipeline's default: T5's for SD3, FLUX.1 and Kontext, UMT5's for Wan, "
    "Qwen2.5-VL's after its template for Qwen-Image (and Edit), Qwen3's for FLUX.2-klein and Z-Image, "
    "Mistral-Small-3's for FLUX.2-dev. Longer prompts are cut, as the pipeline does; Qwen-Image and FLUX.2 pad every "
    "prompt to it (Qwen-Image masked)."
)
NEGATIVE_PROMPT = (
    "Prompt of the unconditional CFG branch (Qwen-Image: of its true-CFG negative branch); the default is the "
    "pipeline's ('', Qwen-Image's model card ' ')."
)
FINETUNE = (
    "What trains: a LoRA adapter ('lora'), or every weight of the transformer ('full': fp32 master weights, the "
    "recipe's mixed_precision computes; the lora_* options unused; tpflow/backbones/full_finetune.py)."
)
LORA_RANK = "LoRA rank r."
LORA_ALPHA = "LoRA alpha: the update is (alpha / r)·B·A."
LORA_TARGETS = (
    "Module names (suffixes) peft adapts. The default is the model's (`tpflow components backbone NAME` lists it): "
    "the attention projections of every block (SD3: the joint attention; Wan: self- and cross-attention; shapes-dit: "
    "its joint blocks'), and for FLUX both feed-forward networks too (docs/algorithm.md §6.3); a tiny model's list "
    "leaves out what its blocks lack."
)
LORA_INIT = (
    "peft's init of A: 'gaussian' N(0, 1/r) (as in the paper's code), 'default' Kaiming-uniform; B = 0 in both, so "
    "training starts at the base model."
)
COMPILE_BLOCKS = (
    "torch.compile each repeated transformer block (regional compilation, as diffusers documents; its "
    "compile_repeated_blocks does not list SD3's blocks in 0.42; on the CPU it needs a C++ compiler). Compiles once "
    "per shape regime, grad mode and adapter state. Off by default: compiling takes minutes on a CPU, and the "
    "rollout (no grad) and the update (grad) run different compiled graphs, so the on-policy ratio is 1 only to "
    "rounding (docs/results.md, epoch cost)."
)
WEIGHTS = (
    "Pretrained weights: a .safetensors written by `tpflow shapes pretrain` (shapes-dit) or `tpflow shapes "
    "video-pretrain` (shapes-video-dit), its .json config beside it, or the folder holding it "
    "(shapes_dit.safetensors, shapes_video_dit.safetensors). None: the weights shipped in tpflow/shapes/weights/."
)
TRAIN_EXPERT = (
    "Which expert trains: 'high' (the pipeline's transformer, σ at or above the boundary) or 'low' (transformer_2, "
    "below it); the other is frozen."
)
TIME_SHIFT = (
    "None: FLUX's resolution-dependent dynamic shift, as FluxPipeline (Flow-GRPO, TP-GRPO). A number s: the static "
    "shift σ = s·t/(1 + (s − 1)·t) on the same grid, as DanceGRPO and MixGRPO sample FLUX (s = 3; "
    "docs/backbones.md)."
)
LOW_NOISE_GUIDANCE = (
    "CFG scale of the low-noise expert (the pipeline's guidance_scale_2; t2v-A14B: 3.0 against 4.0 high); default: "
    "the rollout's guidance, as the pipeline's default."
)
