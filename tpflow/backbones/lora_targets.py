"""LoRA targets checked against the model's structure before any weight loads (the backbones' ``check_machine``).

peft adapts every module whose name equals a target or ends with ``.`` + target. A target that matches nothing is
ignored silently when another target matches, and is an error only once the weights have loaded when none does
(8 s on shapes-dit, minutes on FLUX). Here the model is built on the meta device from its config (no memory, no
weights, under a second even for FLUX's structure) and each target is matched with peft's own
``check_target_module_exists``: every target must name at least one layer, and only layers LoRA can wrap.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)  # what peft's LoRA wraps, of these models
SHOWN = 12  # adaptable layer names listed in the error; the rest are counted


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with every parameter and buffer created on the meta device: the structure, no weights."""
    with torch.device("meta"):
        return build()


def layer_name(name: str) -> str:
    """A module name as a target names every copy of it: the part after the block index, if any
    (``transformer_blocks.3.attn.to_out.0`` -> ``attn.to_out.0``)."""
    match = re.match(r"^.*?\.\d+\.(.+)$", name)
    return match.group(1) if match else name


def target_problems(model: nn.Module, targets: Sequence[str], what: str) -> list[str]:
    """One ``[backbone]`` sentence group naming every target that matches no module of ``model`` (with close names)
    or matches modules LoRA cannot wrap, and the model's adaptable layers (abbreviated); empty when all fit."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    modules = [(name, module) for name, module in model.named_modules() if name]
    names = [name for name, module in modules if isinstance(module, ADAPTABLE)]
    in_blocks = [layer_name(name) for name in names if layer_name(name) != name]  # the usual targets first
    layers = list(dict.fromkeys(in_blocks + [name for name in names if layer_name(name) == name]))
    problems = []
    for target in targets:
        config = LoraConfig(target_modules=[target])
        matched = [module for name, module in modules if check_target_module_exists(config, name)]
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
