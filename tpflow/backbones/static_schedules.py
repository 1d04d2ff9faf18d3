"""A diffusers backbone's σ schedule from its options and its scheduler's config alone, before any weights load.

Capability ``static_sigmas`` (tpflow.interfaces): a recipe check that needs the schedule the run will sample on
(``entropy-steps`` compares its entropy grid with it) reads it from the registered factory before building.
Backbones whose schedule shifts with the image's token count (FLUX.1, FLUX.2, Qwen-Image, Z-Image) would otherwise be
checked only once built, after their weights load. The schedule is the built backbone's own call on the token count
its resolution gives (tests/test_static_schedules.py checks each twin against its built backbone, bit for bit).

A real model's scheduler is read from ``scheduler/scheduler_config.json`` of its local folder or of its snapshot in
the Hugging Face cache (a file of a few hundred bytes; nothing is downloaded). Without it the value is None and the
check runs once the backbone is built, as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tpflow.weights import cached_file, is_local_name

CONFIG = "scheduler/scheduler_config.json"


def scheduler_before_loading(pretrained: str) -> Any | None:
    """The ``FlowMatchEulerDiscreteScheduler`` of ``pretrained``'s scheduler config (local folder or hub cache), or
    None when the file is not on this machine or is not one."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if is_local_name(pretrained):
        path = Path(pretrained).expanduser() / CONFIG
        found = str(path) if path.is_file() else None
    else:
        found = cached_file(pretrained, CONFIG)
    if found is None:
        return None
    try:
        config = json.loads(Path(found).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the loader names a broken file when the backbone is built
    if not isinstance(config, dict) or config.get("_class_name", "FlowMatchEulerDiscreteScheduler") != (
        "FlowMatchEulerDiscreteScheduler"
    ):
        return None
    return FlowMatchEulerDiscreteScheduler.from_config(config)


def packed_sigmas(
    options: Any, num_steps: int, scheduler: Any | None = None, scale: int = 8, static_shift: float | None = None
) -> list[float] | None:
    """The schedule of a FLUX.1 (Kontext), Qwen-Image (Edit) or Z-Image backbone before it is built:
    ``scheduler_sigmas`` of the (resolution // (2·scale))² packed tokens the built backbone's call uses; ``scheduler``:
    the twin's (None: the real model's config, ``from_config``); ``scale``: its VAE's factor (8 for the real
    models)."""
    from tpflow.backbones.diffusers_common import scheduler_sigmas

    found = resolved(options, scheduler)
    if found is None:
        return None
    tokens = (options.resolution // (2 * scale)) ** 2
    return [float(x) for x in scheduler_sigmas(found, num_steps, tokens, True, static_shift=static_shift)]


def resolved(options: Any, scheduler: Any | None) -> Any | None:
    """``scheduler`` (a twin's, built in code), else the real model's from its config (``from_config``), or None."""
    return scheduler if scheduler is not None else from_config(options)


def from_config(options: Any) -> Any | None:
    """A real model's scheduler: ``scheduler_before_loading(options.pretrained)``."""
    return scheduler_before_loading(options.pretrained)
