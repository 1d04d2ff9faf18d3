"""Reward ``hpsv3``: Human Preference Score v3 (Ma et al., arXiv 2508.03789), Qwen2-VL-7B-Instruct fine-tuned with a
reward head that predicts the mean and the uncertainty of a human preference score.

    [reward]
    name = "hpsv3"
    checkpoint = "/models/HPSv3.safetensors"   # or omit: the file of MizzenAI/HPSv3 in the Hugging Face cache
    base = "Qwen/Qwen2-VL-7B-Instruct"         # its config, tokenizer, chat template and image processor

As the ``hpsv3`` package (1.0.0) scores: the image (resized, aspect kept, to 256·28·28 pixels in multiples of 28:
448x448 for a square image) and the package's instruction with the prompt, then "Please provide the overall ratings of
this image: <|Reward|>", go through Qwen2-VL's chat template; the last hidden state at the added ``<|Reward|>`` token
goes through the head (Linear 3584 -> 1024, ReLU, Dropout, Linear -> 16, ReLU, Linear -> 2) in float32, whose first
output is the score μ (what the package reports) and the second the uncertainty σ
(``details["hpsv3_sigma"]``). The package's model calls the language model without Qwen2-VL's 3D rotary positions
(its forward replaces Qwen2VLForConditionalGeneration's and passes no position ids, so the text model numbers all
tokens 0..L-1): so does this reward, since the checkpoint was trained that way. Prompts are right-padded, as the
package pads them; the reward token's state does not depend on what follows it.

Why not the package: it pins transformers 4.45.2 (tpflow has 5.x), pulls deepspeed, peft and trl, and downloads the
checkpoint when no path is given. The published ``HPSv3.safetensors`` (the whole model and the head, in transformers
4.45's names) is read tensor by tensor with safetensors into transformers' ``Qwen2VLModel`` (``model.*`` ->
``language_model.*``, ``visual.*`` as is; ``lm_head`` is not needed) built from the base model's config without its
weights, with the vocabulary the checkpoint has (the base's tokenizer plus ``<|Reward|>``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.rewards._vlm import budget_size, judge_pixels
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource, download_command, hub_checkpoint, model_folder

REPO, FILE = "MizzenAI/HPSv3", "HPSv3.safetensors"
BASE = "Qwen/Qwen2-VL-7B-Instruct"
WHERE = "reward 'hpsv3' (options checkpoint, base)"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # the package's min_pixels = max_pixels
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_BASE_NEEDS = [
    ("config.json",),
    ("preprocessor_config.json", "processor_config.json"),
    ("tokenizer.json", "vocab.json"),
]
_BASE_HOW = "set base to a local folder holding Qwen2-VL's config.json, tokenizer and preprocessor_config.json"

# The hpsv3 package's question (hpsv3/dataset/data_collator_qwen.py, INSTRUCTION and prompt_with_special_token),
# character for character: the checkpoint was trained on exactly this text.
INSTRUCTION = (
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
    "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 "
    "being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be "
    "considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with or "
    "distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
REWARD_QUESTION = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def make_head(width: int) -> nn.Sequential:
    """The package's default ``ranknet`` head: keys ``0, 3, 5`` as in HPSv3.safetensors (``rm_head.*``)."""
    return nn.Sequential(
        nn.Linear(width, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2)
    )


def rename(key: str) -> str | None:
    """HPSv3.safetensors key (transformers 4.45's Qwen2VLForConditionalGeneration, or 5.x's) -> Qwen2VLModel key;
    None for what the score does not use (``lm_head``); ``rm_head.*`` keys are the head's."""
    for old, new in (
        ("model.language_model.", "language_model."),
        ("model.visual.", "visual."),
        ("visual.", "visual."),
    ):
        if key.startswith(old):
            return new + key[len(old) :]
    if key.startswith("model."):
        return "language_model." + key[len("model.") :]
    return None


class HPSv3Options(BaseModel):
    """Options of the HPSv3 reward."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(
        None,
        description=f"The HPSv3 checkpoint ({FILE}: the whole model and its head); None: the file of {REPO} in the "
        f"Hugging Face cache (fetch it once with {download_command(REPO)}).",
    )
    base: str = Field(
        BASE,
        description="Qwen2-VL's config, tokenizer, chat template and image processor (its weights are not read): a "
        "hub id in the Hugging Face cache or a local folder.",
    )
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description=option_help.DTYPE)
    min_pixels: int = Field(
        PIXELS, ge=28 * 28, description="Fewest pixels of the resized image (the package: 200704)."
    )
    max_pixels: int = Field(PIXELS, ge=28 * 28, description=option_help.MAX_PIXELS)
    batch_size: int = Field(8, ge=1, description=option_help.BATCH_SIZE)
    device: str = Field("auto", description=option_help.DEVICE)


def checkpoint_path(options: HPSv3Options) -> Path:
    """The checkpoint file the options name, or a UserError saying how to get it (nothing is downloaded)."""
    return hub_checkpoint(options.checkpoint, REPO, FILE, WHERE, "the HPSv3 checkpoint")


def base_source(options: HPSv3Options) -> WeightSource:
    """Where Qwen2-VL's config and processor are read from, or why they cannot be."""
    return model_folder("reward 'hpsv3' base (option base)", options.base, _BASE_NEEDS, _BASE_HOW)


@dataclass(frozen=True)
class HPSv3Model:
    """The loaded parts of HPSv3."""

    vlm: nn.Module  # transformers Qwen2VLModel: -> last_hidden_state [N, L, D]
    head: nn.Sequential  # [N, D] float32 -> [N, 2] (μ, σ)
    processor: Any  # Qwen2VLProcessor with <|Reward|> added, right padding
    reward_id: int


def load_model(options: HPSv3Options, device: torch.device) -> HPSv3Model:
    """Check every file, then build Qwen2VLModel from the base config without weights and fill it from the
    checkpoint, tensor by tensor (one copy of the 16 GB, on the device)."""
    path = checkpoint_path(options)
    source = base_source(options)
    if source.problem or source.path is None:
        raise UserError(source.problem or f"{WHERE}: {options.base!r} was not found.")
    from safetensors import safe_open
    from transformers import AutoConfig, AutoProcessor, Qwen2VLModel
    from transformers.initialization import no_init_weights

    processor = AutoProcessor.from_pretrained(source.path, local_files_only=True)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})  # as the package does
    processor.tokenizer.padding_side = "right"
    reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    dtype = _DTYPES[options.dtype]
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            embed = next((k for k in keys if rename(k) == "language_model.embed_tokens.weight"), None)
            if embed is None or not any(k.startswith("rm_head.") for k in keys):
                raise UserError(f"{WHERE}: {path} is not an HPSv3 checkpoint (no embeddings or no rm_head).")
            text = getattr(config, "text_config", config)
            text.vocab_size = f.get_slice(embed).get_shape()[0]  # the base vocabulary plus <|Reward|>
            with no_init_weights(), torch.device(device):
                vlm = Qwen2VLModel._from_config(config, dtype=dtype)
                head = make_head(text.hidden_size).float()
            params = {**dict(vlm.named_parameters()), **{f"rm_head.{k}": v for k, v in head.named_parameters()}}
            loaded = set()
            for key in keys:
                name = key if key.startswith("rm_head.") else rename(key)
                if name is None:
                    continue
                if name not in params:
                    raise UserError(f"{WHERE}: {path} has {key!r}, which Qwen2-VL with HPSv3's head does not.")
                tensor = f.get_tensor(key)
                if tensor.shape != params[name].shape:
                    raise UserError(
                        f"{WHERE}: {key} of {path} is {tuple(tensor.shape)}, the model built from {options.base!r} "
                        f"wants {tuple(params[name].shape)}: not the base this checkpoint was trained from."
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
    except (OSError, ValueError) as exc:  # not a safetensors file, a truncated one
        raise UserError(f"{WHERE}: cannot read {path} as safetensors ({type(exc).__name__}: {exc}).") from exc
    missing = sorted(set(params) - loaded)
    if missing:
        raise UserError(f"{WHERE}: {path} lacks {len(missing)} tensors of the model, e.g. {missing[:3]}.")
    return HPSv3Model(vlm.eval().requires_grad_(False), head.eval().requires_grad_(False), processor, reward_id)


@register("reward", "hpsv3", options=HPSv3Options)
class HPSv3Reward:
    """RewardModel: HPSv3's μ of each image for its prompt; ``scores`` [N] float32 on the CPU, ``details``
    ``hpsv3_sigma`` [N] (its uncertainty)."""

    @staticmethod
    def weight_sources(options: HPSv3Options, settings: dict) -> list[WeightSource]:
        """Where the checkpoint and the base's config and processor will be read from, found without the network."""
        what = "reward 'hpsv3' checkpoint (option checkpoint)"
        try:
            path = checkpoint_path(options)
        except UserError as exc:
            checkpoint = WeightSource(what, options.checkpoint or f"{REPO}/{FILE}", None, str(exc))
        else:
            origin = "local file" if options.checkpoint else "Hugging Face cache"
            checkpoint = WeightSource(what, str(path), f"{origin} {path}", path=str(path))
        return [checkpoint, base_source(options)]

    def __init__(self, options: HPSv3Options | None = None):
        self.options = options or HPSv3Options()
        if self.options.min_pixels > self.options.max_pixels:
            raise UserError("reward 'hpsv3': min_pixels is larger than max_pixels.")
        self.device = resolve_device(self.options.device)
        self._lock = threading.Lock()
        self._model: HPSv3Model | None = None

    def load(self) -> HPSv3Model:
        """Load the model now (the first call does it otherwise); the first calls of two threads share one."""
        with self._lock:
            if self._model is None:
                self._model = load_model(self.options, self.device)
            return self._model

    def texts(self, prompts: Sequence[str]) -> list[str]:
        """The model's input text of each prompt: the chat template around the image and the package's question."""
        processor = self.load().processor
        texts = []
        for prompt in prompts:
            question = INSTRUCTION.format(text_prompt=prompt) + REWARD_QUESTION
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            texts.append(processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return texts

    def inputs(self, images: Tensor, prompts: Sequence[str]) -> Any:
        """The processor's batch (ids right-padded, pixel patches, grids) on the model's device: each image quantised
        and resized with PIL's bicubic to the package's pixel budget (``budget_size``), aspect ratio kept."""
        model = self.load()
        ip = model.processor.image_processor
        factor = ip.patch_size * ip.merge_size
        size = budget_size(*images.shape[-2:], factor, self.options.min_pixels, self.options.max_pixels)
        pixels = judge_pixels(images, size).cpu()  # [n, 3, h, w] uint8
        batch = model.processor(
            text=self.texts(prompts), images=list(pixels), padding=True, do_resize=False, return_tensors="pt"
        )
        return batch.to(self.device)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32 (μ)."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        model = self.load()
        outs: list[Tensor] = []
        for start in range(0, len(prompts), self.options.batch_size):
            chunk = slice(start, start + self.options.batch_size)
            batch = self.inputs(images[chunk], prompts[chunk])
            ids = batch["input_ids"]
            at = ids == model.reward_id
            if not bool((at.sum(1) == 1).all()):
                raise UserError(f"reward 'hpsv3': a prompt holds the text {REWARD_TOKEN}, which the score reads.")
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # 0..L-1, as the package
            hidden = model.vlm(
                input_ids=ids,
                attention_mask=batch["attention_mask"],
                pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"],
                position_ids=positions,
            ).last_hidden_state  # [n, L, D]
            outs.append(model.head(hidden[at].float()).cpu())  # [n, 2]
        out = torch.cat(outs) if outs else torch.zeros(0, 2, device="cpu")
        return RewardOutput(scores=out[:, 0].contiguous(), details={"hpsv3_sigma": out[:, 1].contiguous()})
