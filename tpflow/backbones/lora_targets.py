"""LoRA targets checked against the model's structure before any weight loads (the backbones' ``check_machine``).

peft adapts every module whose name equals a target or ends with ``.`` + target. A target that matches nothing is
ignored silently when another target matches, and is an error only once the weights have loaded when none does
(8 s on shapes-dit, minutes on FLUX). Here the model is built from its config without its weights (on the meta
device: no memory, under a second even for FLUX) and each target is matched by peft's rule (``matches``): every
target must name at least one layer, and only layers LoRA can wrap. peft itself is not imported: it imports
transformers, seconds that ``tpflow validate`` of a shapes-dit recipe need not spend (the rule is tested against
peft's ``check_target_module_exists``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

JOINT_ATTENTION = (  # the joint (image + text) attention projections of an MMDiT block: SD3, FLUX, Qwen-Image
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)  # what peft's LoRA wraps, of these models
SHOWN = 12  # adaptable layer names listed in the error; the rest are counted


def structure(build: Callable[[], nn.Module], meta: bool = True) -> nn.Module:
    """``build()`` for its module structure: on the meta device (no memory, no weights) for a real model; with
    ``meta=False`` on the CPU, for a model small enough to build for real in a tenth of a second (shapes-dit and
    the tiny twins, a few million parameters), where the first random init on the meta device would cost seconds
    of torch imports. The global random state is left as it was."""
    with torch.random.fork_rng(devices=[]), torch.device("meta" if meta else "cpu"):
        return build()


def layer_name(name: str) -> str:
    """A module name as a target names every copy of it: the part after the block index, if any
    (``transformer_blocks.3.attn.to_out.0`` -> ``attn.to_out.0``)."""
    match = re.match(r"^.*?\.\d+\.(.+)$", name)
    return match.group(1) if match else name


def matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names (``check_target_module_exists`` without ``layers_to_transform`` or
    ``exclude_modules``, which tpflow does not use): the module name equals the target or ends with ``.`` + it."""
    return name == target or name.endswith(f".{target}")


def target_problems(model: nn.Module, targets: Sequence[str], what: str) -> list[str]:
    """One ``[backbone]`` sentence group naming every target that matches no module of ``model`` (with close names)
    or matches modules LoRA cannot wrap, and the model's adaptable layers (abbreviated); empty when all fit."""
    modules = [(name, module) for name, module in model.named_modules() if name]
    names = [name for name, module in modules if isinstance(module, ADAPTABLE)]
    in_blocks = [layer_name(name) for name in names if layer_name(name) != name]  # the usual targets first
    layers = list(dict.fromkeys(in_blocks + [name for name in names if layer_name(name) == name]))
    problems = []
    for target in targets:
        matched = [module for name, module in modules if matches(name, target)]
        if not matched:
            close = difflib.get_close_matches(target, layers, n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            problems.append(f"LoRA target {target!r} names no layer of {what}{hint}.")
            continue
        kinds = sorted({type(m).__name__ for m in matched if not isinstance(m, ADAPTABLE)})
        if kinds:
            problems.append(
                f"LoRA target {target!r} names {' and '.join(kinds)} modules of {what}, which LoRA cannot adapt: "
                "name the Linear layers inside them."
            )
    if not problems:
        return []
    listed = ", ".join(layers[:SHOWN]) + (f" and {len(layers) - SHOWN} more" if len(layers) > SHOWN else "")
    return [
        f"[backbone] {' '.join(problems)} Its adaptable layers (a target matches a module name or its end after a "
        f"dot): {listed}. Fix lora_targets in [backbone]."
    ]
