"""Backbone ``flux.1-kontext-dev``: FLUX.1 Kontext [dev], FLUX.1-dev's transformer trained to edit one source image.

    [backbone]
    name = "flux.1-kontext-dev"
    pretrained = "black-forest-labs/FLUX.1-Kontext-dev"   # or a local folder in diffusers layout
    dtype = "bf16"

Kontext is FLUX.1-dev's architecture run on a longer sequence: the source image is VAE-encoded, normalised with the
VAE's shift and scale, packed 2×2 like the latents and appended to them; its position ids are the latents' with the
first coordinate 1 instead of 0. The transformer sees [z; source] and the velocity is its output on the first S
tokens (``FluxKontextPipeline.__call__``'s loop). Everything else is ``flux.1-dev``'s (``FluxBackbone``): the text
encoders, the schedule (its shift from the S target tokens only, as the pipeline's ``mu``), the distilled guidance
embedding (the pipeline's default scale is 2.5, not FLUX.1-dev's 3.5), no CFG branch, the VAE in fp32.

The sources are encoded through the pipeline's own helpers: ``image_processor.preprocess`` (a PIL resize with its
Lanczos filter, then [-1, 1]) and ``prepare_latents`` (VAE mode, shift/scale, packing, ids). One departure: the
pipeline's default ``_auto_resize`` moves the source to the nearest of Kontext's preferred resolutions
(``PREFERRED_KONTEXT_RESOLUTIONS``, about 1 MP); tpflow resizes every source to the recipe's square ``resolution``
instead, so that every row of a batch has one sequence length; a source's aspect ratio is not kept. The pipeline
computes what tpflow does when called with ``height = width = resolution``, ``max_area = resolution²`` (its default
1024² rescales the output), ``_auto_resize=False`` and the source at that size; flow_grpo's Kontext script resizes
its sources to its resolution too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.diffusers_common import DTYPES, attach_preflight, fp32_parts, load_pipeline, pipeline_class
from tpflow.backbones.flux import FluxBackbone, FluxOptions, flux_static_sigmas
from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.types import Conditioning


class FluxKontextOptions(FluxOptions):
    """Options of ``flux.1-kontext-dev``: ``flux.1-dev``'s, its own weights (paper-scale defaults: bf16, 512 px)."""

    pretrained: str = Field("black-forest-labs/FLUX.1-Kontext-dev", description=option_help.PRETRAINED)


def source_images(sources: Sequence[Tensor]) -> list[Any]:
    """[3, H, W] float32 in [0, 1] -> RGB PIL images (round(x · 255): a source read from a file is its pixels
    exactly), the input the pipeline's image processor resizes with PIL's filter."""
    from PIL import Image

    out = []
    for image in sources:
        pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # [3, H, W]
        out.append(Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).cpu().numpy())))  # [H, W, 3]
    return out


class FluxKontextBackbone(FluxBackbone):
    """Backbone (tpflow.interfaces) around a ``FluxKontextPipeline``'s components: ``FluxBackbone`` with one source
    image per prompt appended to the token sequence.

    ``cond.tensors`` adds ``source_latents`` [N, S', 4·C] (S' = S: the source at the recipe's resolution), in the
    transformer's dtype; ``extras["img_ids"]`` is [S + S', 3], the latents' ids then the source's (first coordinate
    1), shared by every row. Capability ``source_images = (1, 1)``: on the class, which the trainer reads off the
    built backbone (``tpflow.sources.takes_sources``), and on the factory, which the recipe checks read.
    """

    source_images = (1, 1)

    def encode(self, prompts: Sequence[str], sources: Sequence[Sequence[Tensor]] | None = None) -> Conditioning:
        """The text as ``flux.1-dev`` encodes it, plus each prompt's one source image as packed latents."""
        if sources is None or len(sources) != len(prompts) or any(len(s) != 1 for s in sources):
            counts = "none" if sources is None else sorted({len(s) for s in sources})
            raise UserError(
                f"FLUX.1 Kontext edits one source image per instruction, and got {counts} for {len(prompts)} "
                "prompt(s): use an editing dataset whose items carry one source each (metadata 'sources')."
            )
        cond = super().encode(prompts)
        latents, ids = [], None
        for image in source_images([s[0] for s in sources]):  # one at a time: the VAE's activations stay small
            packed, ids = self._encode_source(image)
            latents.append(packed)
        cond.tensors["source_latents"] = torch.cat(latents)  # [N, S', 4·C]
        cond.extras["img_ids"] = torch.cat([self.img_ids, ids])  # [S + S', 3]
        return cond

    def _encode_source(self, image: Any) -> tuple[Tensor, Tensor]:
        """One PIL source -> (packed latents [1, S', 4·C] in the transformer's dtype, ids [S', 3]) by the pipeline's
        ``image_processor.preprocess`` and ``prepare_latents`` (the VAE in fp32, its mode, not a sample)."""
        side = self.latent_side * self.scale  # pixels, a multiple of 2·scale as the pipeline rounds
        pixels = self.pipe.image_processor.preprocess([image], height=side, width=side)  # [1, 3, side, side]
        with torch.no_grad():
            _, packed, _, ids = self.pipe.prepare_latents(
                pixels, 1, self.channels, side, side, torch.float32, self.device,
                latents=torch.zeros((), device=self.device),  # the target latents are ours: nothing drawn here
            )  # fmt: skip
        return packed.to(self.dtype), ids.to(self.dtype)

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The transformer on [z; source] with ids [img_ids; source ids], its output on z's S tokens kept."""
        source = cond.tensors["source_latents"]  # [N, S', 4·C]
        joint = torch.cat([z.to(source.dtype), source], dim=1)  # [N, S + S', 4·C]
        return super().velocity(joint, sigma, cond, guidance)[:, : z.shape[1]]


@register("backbone", "flux.1-kontext-dev", options=FluxKontextOptions)
def flux_1_kontext_dev(options: FluxKontextOptions) -> FluxKontextBackbone:
    """FLUX.1 Kontext [dev] from a hub id (local HF cache) or a local folder; fails fast, naming what is missing."""
    pipeline = pipeline_class("FluxKontextPipeline", "FLUX.1 Kontext")
    pipe = load_pipeline(
        pipeline, options.pretrained, DTYPES[options.dtype], "FLUX.1-Kontext-dev", fp32=fp32_parts(options)
    )
    return FluxKontextBackbone(pipe, options)


flux_1_kontext_dev.cfg_branch = False  # guidance-distilled as FLUX.1-dev: the scale is an embedding
flux_1_kontext_dev.source_images = (1, 1)  # one source image per instruction
flux_1_kontext_dev.static_sigmas = flux_static_sigmas  # type: ignore[attr-defined]  # FLUX.1's, of the output


attach_preflight(flux_1_kontext_dev, "FluxTransformer2DModel", "FLUX.1-Kontext-dev")
