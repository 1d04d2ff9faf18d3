"""Backbone ``tiny-flux-kontext``: FLUX.1 Kontext's pipeline at test size, built in code (docs/architecture.md,
"Real models at test size, offline").

    [backbone]
    name = "tiny-flux-kontext"
    seed = 0
    resolution = 16

``tiny-flux``'s components (the same transformer, VAE, text encoders and scheduler from ``seed``) in a
``FluxKontextPipeline``, wrapped by the same ``FluxKontextBackbone`` as ``flux.1-kontext-dev``: the editing code
path (one source image per prompt, appended to the sequence) on a CPU in seconds; its images are noise.
"""

from __future__ import annotations

from typing import Any

from tpflow.backbones.flux_kontext import FluxKontextBackbone
from tpflow.backbones.tiny import TinyFluxOptions, _check_machine, tiny_flux, tiny_flux_pipeline
from tpflow.registry import register


def tiny_flux_kontext_pipeline(seed: int = 0) -> Any:
    """A ``FluxKontextPipeline`` over ``tiny_flux_pipeline(seed)``'s components (random weights)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_pipeline(seed).components)


@register("backbone", "tiny-flux-kontext", options=TinyFluxOptions)
def tiny_flux_kontext(options: TinyFluxOptions) -> FluxKontextBackbone:
    """FluxKontextBackbone over ``tiny_flux_kontext_pipeline(seed)``."""
    return FluxKontextBackbone(tiny_flux_kontext_pipeline(options.seed), options)


tiny_flux_kontext.cfg_branch = False  # as flux.1-kontext-dev
tiny_flux_kontext.static_sigmas = tiny_flux.static_sigmas  # type: ignore[attr-defined]  # the same scheduler and VAE
tiny_flux_kontext.source_images = (1, 1)  # type: ignore[attr-defined]
tiny_flux_kontext.check_machine = _check_machine  # type: ignore[attr-defined]
