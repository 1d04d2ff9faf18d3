"""tiny-qwen-image-edit's reference: ``QwenImageEditPlusPipeline`` called the way a batch of tpflow rows is compared
with it. The pipeline takes one prompt per call (diffusers 0.42 refuses more), so each prompt is a call of its own,
and it sizes the sources by two module constants (384² for the text encoder, 1024² for the VAE): they are set to
the twin's ``condition_area`` and ``source_area`` for the call."""

from __future__ import annotations

import types
from typing import Any
from unittest import mock

import torch

from tpflow.backbones.tiny_qwen_edit import TinyQwenImageEditOptions, tiny_qwen_image_edit_pipeline


class OnePromptAtATime:
    """The tiny edit pipeline behind a batched ``__call__``: prompt i with ``image[i]``, ``negative_prompt[i]`` and
    ``latents[i]``, at the twin's source sizes; ``.images`` stacks the rows. Any other attribute (``transformer``,
    ``load_lora_weights``) is the pipeline's own."""

    def __init__(self, pipe: Any, resolution: int) -> None:
        options = TinyQwenImageEditOptions(resolution=resolution)
        object.__setattr__(self, "pipe", pipe)
        object.__setattr__(self, "areas", (options.condition_area, options.source_area or resolution**2))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.pipe, name, value)

    def __call__(self, prompt: list[str], image: list, latents: torch.Tensor, negative_prompt: list[str],
                 **kwargs: Any) -> Any:  # fmt: skip
        module = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"
        condition, vae = self.areas
        rows = []
        with mock.patch(f"{module}.CONDITION_IMAGE_SIZE", condition), mock.patch(f"{module}.VAE_IMAGE_SIZE", vae):
            for i, text in enumerate(prompt):
                out = self.pipe(prompt=text, image=image[i], negative_prompt=negative_prompt[i],
                                latents=latents[i : i + 1], **kwargs)  # fmt: skip
                rows.append(out.images)
        return types.SimpleNamespace(images=torch.cat(rows))


def tiny_edit_reference(resolution: int = 32) -> OnePromptAtATime:
    """A fresh ``tiny_qwen_image_edit_pipeline(0)`` called one prompt at a time."""
    return OnePromptAtATime(tiny_qwen_image_edit_pipeline(0), resolution)
