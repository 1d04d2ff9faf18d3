"""Backbone ``qwen-image-edit``: Qwen-Image-Edit-2509 (the "Plus" editing model) through diffusers, one to three
source images per instruction, with a peft LoRA adapter.

    [backbone]
    name = "qwen-image-edit"
    pretrained = "Qwen/Qwen-Image-Edit-2509"    # or a local folder in diffusers layout
    dtype = "bf16"

Everything ``qwen-image`` does (``QwenImageBackbone``, which this backbone holds: placement, LoRA, the packed noise,
the resolution-shifted schedule from the output's tokens alone, true CFG with its norm rescale, the decode) and, as
``QwenImageEditPlusPipeline.__call__`` does it:

* the Qwen2.5-VL text encoder sees the sources: each is resized to ``condition_area`` pixels (the pipeline's
  ``CONDITION_IMAGE_SIZE``, 384²) with the pipeline's image processor and passed to its own
  ``encode_prompt(image=[...])``, which writes "Picture i: <|vision_start|><|image_pad|><|vision_end|>" per source
  before the instruction in its edit template and drops the template's system part. The negative prompt is encoded
  with the same sources, so its embedding is per row too;
* the sources are VAE-encoded (the distribution's mode, normalised by the VAE's latent mean and std: the pipeline's
  ``_encode_vae_image``), packed 2×2 and appended to the latents, [z; source 1; ...]; ``img_shapes`` lists the
  output's shape then each source's, and the velocity is the transformer's output on z's tokens.

``cond.tensors`` (per row): ``prompt_embeds`` and ``mask`` [N, L, D] / [N, L], ``negative_embeds`` and
``negative_mask`` the same, padded to ``max_sequence_length`` with the mask zero there (the image tokens count:
about 200 per source at 384²); ``image_latents`` [N, M·S', 4·C], the M sources' packed latents in the transformer's
dtype. ``extras["img_shapes"]``: the output's and the sources' (1, h/2, w/2), shared by the batch.

Where tpflow departs from the pipeline, following flow_grpo's ``scripts/train_qwenimage_edit_plus.py`` and its
``config/grpo.py::dual_ref_qwenimage_edit_plus_fast`` (github.com/yifan123/flow_grpo, 9dcdc35 and c7bb5fe):

* the VAE sees each source at ``source_area`` pixels, by default the output's (``resolution``²) where the pipeline
  uses 1024² whatever the output size: flow_grpo's ``calculate_dimensions(512 * 512, ...)`` at its 512 px;
* every source is resized to the output's aspect ratio (square), as flow_grpo resizes each to its resolution, so that
  every row of a batch has one sequence length; the pipeline keeps each source's aspect ratio. A source of the
  output's aspect is encoded exactly as the pipeline encodes it;
* flow_grpo hands the text encoder its 512² sources; tpflow keeps the pipeline's 384² (``condition_area``);
* flow_grpo's rollout passes the first row's ``prompt_embeds`` back into ``encode_prompt`` for the negative prompt
  and for the later rows (at 9dcdc35), so its negative branch repeats the conditional one; tpflow encodes every
  instruction and the negative prompt with its own sources, as the pipeline does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.diffusers_common import DTYPES, attach_preflight, fp32_parts, load_pipeline, pipeline_class
from tpflow.backbones.diffusers_lora import AdapterMethods
from tpflow.backbones.qwen_image import QwenImageBackbone, QwenImageOptions
from tpflow.backbones.static_schedules import packed_sigmas
from tpflow.errors import UserError
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.types import Conditioning

CONDITION_AREA = (
    "Pixels of each source image as the Qwen2.5-VL text encoder sees it (the pipeline's CONDITION_IMAGE_SIZE, 384²): "
    "resized to that area at the output's aspect ratio, then to the vision tower's 28 px grid."
)
SOURCE_AREA = (
    "Pixels of each source image as the VAE encodes it and the transformer sees it; None: the output's area "
    "(resolution², flow_grpo's choice; the pipeline's is 1024² whatever the output size)."
)
MOST_SOURCES = 3
# The pipeline's calculate_dimensions rounds each side to a multiple of 32: below 32 × 32 pixels (a resolution under
# 32, with source_area unset) a source's side rounds to 0 and the VAE cannot encode it.
MIN_SIDE = 32


class QwenImageEditOptions(QwenImageOptions):
    """Options of ``qwen-image-edit``: ``qwen-image``'s, its own weights, a text length that holds the sources' image
    tokens, and the two source sizes."""

    pretrained: str = Field("Qwen/Qwen-Image-Edit-2509", description=option_help.PRETRAINED)
    dtype: Literal["fp32", "fp16", "bf16"] = Field("bf16", description=option_help.DTYPE)
    max_sequence_length: int = Field(1024, ge=8, le=1024, description=option_help.MAX_SEQUENCE_LENGTH)
    resolution: int = Field(1024, ge=MIN_SIDE, description=option_help.RESOLUTION)
    condition_area: int = Field(384 * 384, ge=MIN_SIDE**2, description=CONDITION_AREA)
    source_area: int | None = Field(None, ge=MIN_SIDE**2, description=SOURCE_AREA)


def pil_images(sources: Sequence[Tensor], pipe: Any) -> list[Any]:
    """[3, H, W] float32 in [0, 1] -> RGB PIL images by the pipeline's own ``numpy_to_pil`` (round(x · 255): a
    source read from a file is its pixels exactly)."""
    arrays = [s.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() for s in sources]  # [H, W, 3] each
    return [pipe.image_processor.numpy_to_pil(a[None])[0] for a in arrays]


def source_key(prompt: str, sources: Sequence[Tensor]) -> str:
    """The prompt cache's key of an instruction with its sources: the text and a digest of the pixels."""
    digest = hashlib.blake2b(digest_size=16)
    for image in sources:
        digest.update(str(tuple(image.shape)).encode())
        digest.update(image.detach().float().cpu().contiguous().numpy().tobytes())
    return f"{prompt}\x00{digest.hexdigest()}"


class QwenImageEditBackbone(AdapterMethods):
    """Backbone (tpflow.interfaces) around a ``QwenImageEditPlusPipeline``'s components: a ``QwenImageBackbone``
    (``self.image``) for what editing shares with text-to-image, the sources' conditioning here (module docstring).
    ``source_images`` is declared here (the built backbone: ``tpflow.sources`` reads it) and on the factories (the
    recipe's checks, before anything is built)."""

    source_images = (1, MOST_SOURCES)

    def __init__(self, pipe: Any, options: QwenImageEditOptions) -> None:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        self.image = QwenImageBackbone(pipe, options)
        self.options, self.pipe, self.adapter = options, pipe, self.image.adapter
        self.device, self.dtype, self.text_device = self.image.device, self.image.dtype, self.image.text_device
        self.transformer, self.vae, self.cache = self.image.transformer, self.image.vae, self.image.cache
        side = self.image.latent_side * self.image.scale  # the output's pixels, as the pipeline rounds them
        self.condition_size = calculate_dimensions(options.condition_area, 1.0)  # (width, height)
        self.source_size = calculate_dimensions(options.source_area or side * side, 1.0)
        self.channels = self.image.channels

    # ---- what text-to-image shares ---------------------------------------------------------------------------

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 packed [n, S, 4·C] float32, drawn as the pipeline draws it (``QwenImageBackbone``)."""
        return self.image.initial_noise(n, generator)

    def sigmas(self, num_steps: int) -> Tensor:
        """[K + 1] float32: the pipeline's schedule, its shift from the output's S tokens alone (its ``mu``)."""
        return self.image.sigmas(num_steps)

    def decode(self, z: Tensor) -> Tensor:
        """Packed latents to images [N, 3, H, W] float32 in [0, 1] (``QwenImageBackbone.decode``)."""
        return self.image.decode(z)

    # ---- the sources -----------------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str], sources: Sequence[Sequence[Tensor]] | None = None) -> Conditioning:
        """Each instruction and the negative prompt encoded with the row's sources, and the sources' packed latents
        (module docstring); cached per (instruction, sources) when ``prompt_cache``."""
        counts = sorted({len(s) for s in sources}) if sources is not None and len(sources) == len(prompts) else []
        if len(counts) != 1 or not 1 <= counts[0] <= MOST_SOURCES:
            raise UserError(
                f"Qwen-Image-Edit-2509 edits from 1 to {MOST_SOURCES} source images per instruction, the same number "
                f"for every instruction of a dataset; got {counts or 'none'} for {len(prompts)} prompt(s). Use an "
                "editing dataset whose items carry their sources (metadata 'sources')."
            )
        keys = [source_key(p, s) for p, s in zip(prompts, sources, strict=True)]  # type: ignore[arg-type]
        rows = dict(zip(keys, zip(prompts, sources, strict=True), strict=True))  # type: ignore[arg-type]
        tensors = self.cache.encode(keys, lambda todo: self._encode_rows([rows[k] for k in todo]), self.device)
        width, height = self.source_size
        side = self.image.latent_side // 2
        shapes = [(1, side, side)] + [(1, height // self.image.scale // 2, width // self.image.scale // 2)] * counts[0]
        return Conditioning(tensors=tensors, extras={"img_shapes": shapes})

    def _encode_rows(self, rows: list[tuple[str, Sequence[Tensor]]]) -> dict[str, Tensor]:
        """The per-row tensors of ``encode`` for (instruction, sources) rows, on the devices they were made on."""
        images = [pil_images(s, self.pipe) for _, s in rows]
        width, height = self.condition_size
        out: dict[str, list[Tensor]] = {k: [] for k in ("prompt_embeds", "mask", "negative_embeds", "negative_mask")}
        for (prompt, _), pil in zip(rows, images, strict=True):
            shown = [self.pipe.image_processor.resize(p, height, width) for p in pil]  # the pipeline's condition
            for name, text in (("prompt_embeds", prompt), ("negative_embeds", self.options.negative_prompt)):
                embeds, mask = self._encode_text(text, shown)
                out[name].append(embeds)
                out["mask" if name == "prompt_embeds" else "negative_mask"].append(mask)
        tensors = {k: torch.cat(v) for k, v in out.items()}
        tensors["image_latents"] = self._encode_sources(images)
        return tensors

    def _encode_text(self, text: str, shown: list[Any]) -> tuple[Tensor, Tensor]:
        """One text with its condition images -> embeddings [1, L, D] in the model dtype and mask [1, L], padded to
        ``max_sequence_length`` (the pipeline's ``encode_prompt``, batch 1 as the pipeline runs it)."""
        length = self.options.max_sequence_length
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt(prompt=[text], image=shown, device=self.text_device)
        used = embeds.shape[1]
        if used > length:
            raise UserError(
                f"[backbone] max_sequence_length = {length}: an instruction with its {len(shown)} source image(s) "
                f"encodes to {used} tokens (the text and about {self._image_tokens()} image tokens per source). "
                "Raise max_sequence_length (at most 1024), or lower condition_area."
            )
        padded = embeds.new_zeros((1, length, embeds.shape[2]))
        padded[:, :used] = embeds
        full = torch.zeros((1, length), dtype=torch.long, device=embeds.device)
        full[:, :used] = 1 if mask is None else mask
        return padded.to(self.dtype), full

    def _image_tokens(self) -> int:
        width, height = self.condition_size
        return max(1, round(width / 28) * round(height / 28))

    def _encode_sources(self, images: list[list[Any]]) -> Tensor:
        """PIL sources of each row -> packed latents [N, M·S', 4·C] in the transformer's dtype: the pipeline's
        ``image_processor.preprocess`` at ``source_area``, ``_encode_vae_image`` (fp32, the mode) and packing."""
        width, height = self.source_size
        packed = []
        for row in images:
            pixels = torch.cat([self.pipe.image_processor.preprocess(p, height, width) for p in row])  # [M, 3, H, W]
            with torch.no_grad():
                latents = self.pipe._encode_vae_image(pixels.unsqueeze(2).to(self.device), generator=None)
            m, c, _, h, w = latents.shape  # [M, C, 1, h, w]
            tokens = self.pipe._pack_latents(latents, m, c, h, w)  # [M, S', 4·C]
            packed.append(tokens.reshape(1, m * tokens.shape[1], -1))
        return torch.cat(packed).to(self.dtype)

    # ---- sampling --------------------------------------------------------------------------------------------

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """The transformer on [z; sources] with the output's and the sources' shapes, its output on z's S tokens;
        with ``guidance`` > 1 the pipeline's true CFG (norm-rescaled), both branches in one call as [negative;
        conditional]."""
        n, s = z.shape[:2]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        t = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        sources = cond.tensors["image_latents"]  # [N, M·S', 4·C]
        x = torch.cat([z.to(self.dtype), sources.to(self.dtype)], dim=1)  # [N, S + M·S', 4·C]
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["mask"]
        cfg = guidance > 1
        if cfg:
            embeds = torch.cat([cond.tensors["negative_embeds"], embeds])
            mask = torch.cat([cond.tensors["negative_mask"], mask])
            x, t = torch.cat([x, x]), t.repeat(2)
        v = self.transformer(
            hidden_states=x,
            timestep=t.to(self.dtype),
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[cond.extras["img_shapes"]] * x.shape[0],
            return_dict=False,
        )[0][:, :s].float()
        if not cfg:
            return v
        v_neg, v_cond = v.chunk(2)
        combined = combine(v_neg, v_cond, guidance)  # v_neg a constant under cfg_gradient = "conditional"
        return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


@register("backbone", "qwen-image-edit", options=QwenImageEditOptions)
def qwen_image_edit(options: QwenImageEditOptions) -> QwenImageEditBackbone:
    """Qwen-Image-Edit-2509 (Qwen-Image's 20 B MMDiT and Qwen2.5-VL 7 B, which sees the sources) from a hub id
    (local HF cache) or a local folder; fails fast, naming what is missing."""
    pipeline = pipeline_class("QwenImageEditPlusPipeline", "Qwen-Image-Edit")
    pipe = load_pipeline(
        pipeline, options.pretrained, DTYPES[options.dtype], "Qwen-Image-Edit-2509", fp32=fp32_parts(options)
    )
    return QwenImageEditBackbone(pipe, options)


qwen_image_edit.source_images = QwenImageEditBackbone.source_images  # type: ignore[attr-defined]
qwen_image_edit.static_sigmas = packed_sigmas  # type: ignore[attr-defined]  # the output's schedule, before loading

attach_preflight(qwen_image_edit, "QwenImageTransformer2DModel", "Qwen-Image-Edit-2509")
