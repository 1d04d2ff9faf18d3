"""Placing a pipeline's models on a device in a dtype, each model's float32 islands kept as its library keeps them.

Some models name modules that must stay float32 whatever dtype the rest runs in (``_keep_in_fp32_modules``), and
their library's ``from_pretrained(torch_dtype=...)`` keeps them so; ``module.to(dtype)`` casts them with the rest
(diffusers' ``ModelMixin.to`` too: it only warns). The islands of the models tpflow loads:

* diffusers' ``WanTransformer3DModel``: ``rope`` (its RoPE tables), ``time_embedder``, ``scale_shift_table``,
  ``norm1``–``norm3``: float32 in every dtype (a parameter is kept when one of the dotted parts of its name is
  listed);
* transformers' T5 and UMT5 encoders: the feed-forward output ``wo``, float32 under fp16 only (transformers keeps
  ``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict`` under fp16 and bf16; a listed name
  matches anywhere in the parameter's name).

:func:`place` applies those rules to a model built in float32 (the tiny twins) or loaded in its dtype already (then
nothing is cast), so that a twin is placed exactly as ``from_pretrained`` loads the real model
(tests/test_placement.py). Buffers that are not saved (non-persistent: RoPE tables, rotary frequencies) are left in
the dtype they were built in, as the loaders leave them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import torch


def fp32_island(module: torch.nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether the parameter or buffer of ``module`` of a given name stays float32 when ``module`` is in ``dtype``,
    by its library's rule (module docstring); nothing is an island in float32."""
    if dtype == torch.float32:
        return lambda name: False
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None and isinstance(module, modeling.PreTrainedModel):
        listed = list(getattr(module, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
        if dtype in (torch.float16, torch.bfloat16):
            listed += list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
        if not listed:
            return lambda name: False
        pattern = re.compile("|".join(m.replace("*", ".*") for m in listed))  # transformers' dtype plan: a search
        return lambda name: pattern.search(name) is not None
    listed = set(getattr(module, "_keep_in_fp32_modules", None) or [])  # diffusers: one dotted part equal
    return lambda name: any(part in listed for part in name.split("."))


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``module`` to ``dtype`` but for its float32 islands (:func:`fp32_island`), then move it to ``device``;
    a tensor already in its dtype is not copied. Non-persistent buffers keep their dtype. Returns ``module``."""
    island = fp32_island(module, dtype)
    for name, param in module.named_parameters():
        target = torch.float32 if island(name) else dtype
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)
    for prefix, owner in module.named_modules():
        for leaf, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is None or not buffer.is_floating_point() or leaf in owner._non_persistent_buffers_set:
                continue
            target = torch.float32 if island(f"{prefix}.{leaf}" if prefix else leaf) else dtype
            if buffer.dtype != target:
                owner._buffers[leaf] = buffer.to(target)
    return module.to(device)
