"""Backbone ``shapes-edit-dit``: the editing shapes world's pixel-space DiT, conditioned on one source image.

    [backbone]
    name = "shapes-edit-dit"
    weights = "runs/shapes-edit-pretrain/shapes_edit_dit.safetensors"   # omit for the shipped weights

What differs from ``shapes-dit`` (whose backbone code it is, hooks replaced): the model is ``ShapesEditDiT``
(``tpflow.shapes.edit_model``: the source's patch tokens appended to the joint sequence, Kontext-style), prompts
are tokenized over the editing vocabulary, and every prompt carries one source image (capability
``source_images = (1, 1)``): ``encode(prompts, sources=...)`` puts it, resized to 32×32 and scaled to [-1, 1],
in the conditioning's per-row tensors beside the word ids, so the rollout indexes and repeats it with them, and
``velocity`` hands it to the model. CFG's unconditional branch swaps the text for the null text and keeps the
source, as Kontext and Qwen-Image-Edit keep the image in that branch. The LoRA targets are shapes-dit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.shapes import ShapesBackbone, ShapesDitOptions, resolve_weights
from tpflow.errors import UserError
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.shapes import edit_world, vocab
from tpflow.shapes.edit_model import ShapesEditConfig, ShapesEditDiT, load_edit_checkpoint
from tpflow.shapes.edit_pretrain import WEIGHTS_FILE
from tpflow.types import Conditioning


class ShapesEditDitOptions(ShapesDitOptions):
    """Options of ``shapes-edit-dit`` (``shapes-dit``'s)."""

    weights: str | None = Field(None, description=option_help.WEIGHTS)


@register("backbone", "shapes-edit-dit", options=ShapesEditDitOptions)
class ShapesEditBackbone(ShapesBackbone):
    """Backbone of the editing shapes world: ShapesEditDiT plus a peft LoRA adapter (``ShapesBackbone``'s code)."""

    source_images = (1, 1)  # one source per prompt (tpflow.sources, tpflow.interfaces.CAPABILITIES)
    weights_file = WEIGHTS_FILE
    model_name = "shapes-edit-dit"
    options_class = ShapesEditDitOptions

    @staticmethod
    def _resolve(weights: str | None) -> Path:
        create = "`tpflow shapes pretrain-edit --out DIR` (about 40 minutes on 2 CPU cores)"
        return resolve_weights(weights, WEIGHTS_FILE, "shapes-edit-dit", create)

    @staticmethod
    def _model(config: Any) -> ShapesEditDiT:
        return ShapesEditDiT(ShapesEditConfig.from_dict(config) if isinstance(config, dict) else config)

    @staticmethod
    def _tokenize(prompts: list[str], max_tokens: int) -> tuple[Tensor, Tensor]:
        return edit_world.tokenize(prompts, max_tokens)

    @staticmethod
    def prompt_warnings(prompts: Sequence[str]) -> list[str]:
        """Words outside the editing world's vocabulary (they become <unk>)."""
        unknown = dict.fromkeys(w for p in prompts for w in vocab.words(p) if w not in edit_world.WORD_IDS)
        if not unknown:
            return []
        return [f"{', '.join(map(repr, unknown))} not in the editing shapes world's vocabulary: they become <unk>."]

    def _load(self, path: Path) -> ShapesEditDiT:
        return load_edit_checkpoint(path, self.device)

    def encode(self, prompts: Sequence[str], sources: Sequence[Sequence[Tensor]] | None = None) -> Conditioning:
        """Word ids and mask [N, max_tokens] and the source [N, 3, 32, 32] in [-1, 1] (``sources``: one [3, H, W]
        image in [0, 1] per prompt)."""
        if sources is None or len(sources) != len(prompts) or any(len(s) != 1 for s in sources):
            got = "none" if sources is None else [len(s) for s in sources]
            raise UserError(
                f"shapes-edit-dit edits one source image per instruction, and got {got} for {len(prompts)} "
                "instruction(s): use an editing dataset (shapes-edit, or edit-jsonl with one source per line)."
            )
        cond = super().encode(prompts)
        size = self.config.image_size
        images = []
        for (image,) in sources:  # [3, H, W] in [0, 1]
            image = image.float().cpu()
            if image.shape[-2:] != (size, size):
                image = torch.nn.functional.interpolate(image[None], size=(size, size), mode="bilinear",
                                                        antialias=True)[0]  # fmt: skip
            images.append(image.clamp(0, 1) * 2 - 1)
        cond.tensors["source"] = torch.stack(images).to(self.device)  # [N, 3, 32, 32]
        return cond

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v = v_u + w·(v_c − v_u) in ONE forward on [z; z], the source in both branches (w = 1: conditional)."""
        n = z.shape[0]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        tokens, mask, source = cond.tensors["tokens"], cond.tensors["mask"], cond.tensors["source"]
        z = z.float()
        if guidance == 1:
            return self.model(z, sigma, tokens, mask, None, source)
        null = torch.arange(2 * n, device=z.device) < n  # [uncond; cond], both with the source
        v = self.model(torch.cat([z, z]), sigma.repeat(2), tokens.repeat(2, 1), mask.repeat(2, 1), null,
                       source.repeat(2, 1, 1, 1))  # fmt: skip
        v_uncond, v_cond = v.chunk(2)
        return combine(v_uncond, v_cond, guidance)
