"""Reward ``imagereward``: ImageReward (Xu et al., arXiv 2304.05977), a BLIP model fine-tuned on human preference
rankings, as DanceGRPO and MixGRPO train with it beside HPSv2.1.

    [reward]
    name = "imagereward"
    checkpoint = "/models/ImageReward.pt"   # or omit: the file of THUDM/ImageReward in the Hugging Face cache
    tokenizer = "google-bert/bert-base-uncased"   # the BERT tokenizer BLIP uses (cache or a local folder)

The model, as the ``image-reward`` package (1.5) defines it: BLIP's ViT-L/16 at 224 px encodes the image; a BERT-base
text encoder whose every layer cross-attends to the image tokens reads the prompt ([CLS] prompt [SEP], lower-cased,
padded to 35 tokens); a linear head (768 -> 1024 -> 128 -> 64 -> 16 -> 1, dropouts between, no activation: the
package comments its ReLUs out) maps the [CLS] output to the raw score, and the score is (raw - 0.16717362830052426)
/ 1.0333394966054072, the package's constants. Preprocessing: the image quantised to uint8, its shortest side
resized to 224 with PIL's bicubic, centre-cropped, normalised with CLIP's mean and std (the package's ``_transform``).

Why not the package: it pins timm 0.6.13 and fairscale (tpflow has timm 1.x), downloads ``med_config.json`` and the
BERT tokenizer at load time, and reads the checkpoint with a plain ``torch.load`` (an arbitrary pickle). Instead the
published ``ImageReward.pt`` (a state dict of tensors) is read with ``torch.load(weights_only=True)`` (or a
``.safetensors`` conversion of it) and its keys renamed onto transformers' ``BlipVisionModel`` and ``BlipTextModel``
(with cross-attention), as transformers' convert_blip_original_pytorch_to_hf.py renames BLIP's: ``blocks`` ->
``encoder.layers``, ``attn.proj`` -> ``self_attn.projection``, ``norm1`` -> ``layer_norm1``, the final ``norm`` ->
``post_layernorm``, ``patch_embed.proj`` / ``pos_embed`` / ``cls_token`` -> the embeddings; the text encoder's keys
are transformers' already. ``original_state_dict`` is the inverse (tests write tiny checkpoints in the published
layout with it).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import clip_preprocess
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource, cached_file, download_command, hub_checkpoint, model_folder

REPO, FILE, CONFIG_FILE = "THUDM/ImageReward", "ImageReward.pt", "med_config.json"
TOKENIZER = "google-bert/bert-base-uncased"
WHERE = "reward 'imagereward' (options checkpoint, tokenizer)"
SCORE_MEAN, SCORE_STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.py: (raw - mean) / std
MAX_LENGTH = 35  # the package pads and truncates prompts to 35 tokens
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEAD_WIDTHS = (1024, 128, 64, 16, 1)  # the package's MLP after the text width

# BLIP's configs/med_config.json (THUDM/ImageReward publishes the same file): BERT-base with cross-attention.
MED_CONFIG: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 512,
    "vocab_size": 30524,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
}
# BLIP's create_vit('large'): ViT-L/16, timm blocks (exact GELU, LayerNorm eps 1e-6, qkv with bias).
VIT_LARGE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "patch_size": 16,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
}

# Published ImageReward.pt key (under blip.visual_encoder.) -> transformers BlipVisionModel key.
_VISION_RULES = (
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
)
_VISION_INVERSE = (
    (r"^embeddings\.class_embedding$", "cls_token"),
    (r"^embeddings\.position_embedding$", "pos_embed"),
    (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
    (r"^encoder\.layers\.(\d+)\.layer_norm1\.", r"blocks.\1.norm1."),
    (r"^encoder\.layers\.(\d+)\.layer_norm2\.", r"blocks.\1.norm2."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"blocks.\1.attn.qkv."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.projection\.", r"blocks.\1.attn.proj."),
    (r"^encoder\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."),
    (r"^post_layernorm\.", "norm."),
)
VISION, TEXT, HEAD = "blip.visual_encoder.", "blip.text_encoder.", "mlp.layers."


def _rename(key: str, rules: Sequence[tuple[str, str]]) -> str | None:
    for pattern, replacement in rules:
        if re.search(pattern, key):
            return re.sub(pattern, replacement, key)
    return None


def split_state_dict(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """ImageReward.pt's state dict -> (BlipVisionModel, BlipTextModel, head) state dicts.

    Keys the score does not use (BLIP's ``vision_proj`` / ``text_proj``, the text ``position_ids`` buffer) are
    dropped; a visual-encoder key no rule renames is an error (a checkpoint of another architecture).
    """
    vision, text, head = {}, {}, {}
    for key, value in state.items():
        if key.startswith(VISION):
            renamed = _rename(key[len(VISION) :], _VISION_RULES)
            if renamed is None:
                raise UserError(f"{WHERE}: the checkpoint's {key!r} is not a key of ImageReward's BLIP ViT.")
            vision[renamed] = value
        elif key.startswith(TEXT) and not key.endswith("position_ids"):
            text[key[len(TEXT) :]] = value
        elif key.startswith(HEAD):
            head[key[len(HEAD) :]] = value
    return vision, text, head


def original_state_dict(vision: nn.Module, text: nn.Module, head: nn.Module) -> dict[str, Tensor]:
    """The inverse of ``split_state_dict``: the modules' weights under ImageReward.pt's keys."""
    out = {}
    for key, value in vision.state_dict().items():
        renamed = _rename(key, _VISION_INVERSE)
        if renamed is None:
            raise ValueError(f"BlipVisionModel key {key!r} has no ImageReward name.")
        out[VISION + renamed] = value
    out.update({TEXT + k: v for k, v in text.state_dict().items() if not k.endswith("position_ids")})
    out.update({HEAD + k: v for k, v in head.state_dict().items()})
    return out


def make_head(width: int) -> nn.Sequential:
    """The package's MLP: linear layers with dropouts between, no activation (its ReLUs are commented out), so
    its state dict keys are ``0, 2, 4, 6, 7`` as in ImageReward.pt."""
    w = (width, *HEAD_WIDTHS)
    return nn.Sequential(
        nn.Linear(w[0], w[1]),
        nn.Dropout(0.2),
        nn.Linear(w[1], w[2]),
        nn.Dropout(0.2),
        nn.Linear(w[2], w[3]),
        nn.Dropout(0.1),
        nn.Linear(w[3], w[4]),
        nn.Linear(w[4], w[5]),
    )


def make_modules(
    med: dict[str, Any], vision: dict[str, Any], image_size: int
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(BlipVisionModel, BlipTextModel with cross-attention, head) of the given sizes, randomly initialised.

    Args:
        med: the text encoder's BERT config (``MED_CONFIG`` keys; others are ignored).
        vision: the ViT config (``VIT_LARGE`` keys).
        image_size: the ViT's input size (the checkpoint's position embeddings fix it: 224 for ImageReward).
    """
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    vision_config = BlipVisionConfig(**vision, image_size=image_size, attention_dropout=0.0)
    text_keys = {k: med[k] for k in MED_CONFIG if k in med}
    text_config = BlipTextConfig(
        **text_keys,
        encoder_hidden_size=vision_config.hidden_size,  # BLIP_Pretrain: encoder_width = vision_width
        is_decoder=True,  # transformers adds the cross-attention layers to a "decoder"; called bidirectional below
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        bos_token_id=None,
        sep_token_id=None,
        eos_token_id=None,
    )
    text = BlipTextModel(text_config, add_pooling_layer=False)
    return BlipVisionModel(vision_config), text, make_head(text_config.hidden_size)


class ImageRewardOptions(BaseModel):
    """Options of the ImageReward reward."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(
        None,
        description=f"The ImageReward checkpoint ({FILE}, or a .safetensors of the same state dict); None: the file "
        f"of {REPO} in the Hugging Face cache (fetch it once with {download_command(REPO)}).",
    )
    tokenizer: str = Field(
        TOKENIZER,
        description="The BERT tokenizer BLIP reads prompts with: a hub id in the Hugging Face cache or a local "
        "folder with vocab.txt or tokenizer.json.",
    )
    med_config: str | None = Field(
        None,
        description=f"The text encoder's config ({CONFIG_FILE}); None: the file of {REPO} in the cache when it is "
        "there, else BLIP's published values (BERT-base, built in).",
    )
    image_size: int = Field(224, ge=1, description="Input size of the ViT and of the centre crop (ImageReward: 224).")
    vision: dict[str, int | float] = Field(
        default_factory=dict,
        description="Overrides of the ViT-L/16 config (hidden_size, num_hidden_layers, ...), for checkpoints of "
        "another size; ImageReward's needs none.",
    )
    device: str = Field("auto", description=option_help.DEVICE)


def checkpoint_path(options: ImageRewardOptions) -> Path:
    """The checkpoint file the options name, or a UserError saying how to get it (nothing is downloaded)."""
    return hub_checkpoint(options.checkpoint, REPO, FILE, WHERE, "the ImageReward checkpoint")


def tokenizer_source(options: ImageRewardOptions) -> WeightSource:
    """Where the BERT tokenizer is read from (a local folder or a cache snapshot), or why it cannot be."""
    return model_folder(
        "reward 'imagereward' tokenizer (option tokenizer)",
        options.tokenizer,
        [("vocab.txt", "tokenizer.json")],
        "set tokenizer to a local folder holding BERT's vocab.txt",
        kind="tokenizer folder",
    )


def med_config(options: ImageRewardOptions) -> dict[str, Any]:
    """The text encoder's config: the given file, else the cached file of THUDM/ImageReward, else BLIP's values."""
    if options.med_config is not None:
        path = Path(options.med_config).expanduser()
        if not path.is_file():
            raise UserError(f"{WHERE}: the med_config file {path} does not exist; unset it to use BLIP's values.")
    else:
        found = cached_file(REPO, CONFIG_FILE)
        if found is None:
            return dict(MED_CONFIG)
        path = Path(found)
    try:
        return {**MED_CONFIG, **json.loads(path.read_text())}
    except (OSError, ValueError) as exc:
        raise UserError(f"{WHERE}: cannot read the med_config file {path}: {exc}") from exc


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The checkpoint's tensors: safetensors, or ``torch.load(weights_only=True)`` (tensors only, never code)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle with code, a truncated file: one sentence, no traceback
        raise UserError(
            f"{WHERE}: cannot read {path} as a state dict of tensors ({type(exc).__name__}: {exc})."
        ) from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise UserError(f"{WHERE}: {path} is not a state dict of tensors.")
    return state


@dataclass(frozen=True)
class ImageRewardModel:
    """The loaded parts of ImageReward."""

    vision: nn.Module  # BlipVisionModel: pixels [N, 3, s, s] -> last_hidden_state [N, 1 + (s/16)², 1024]
    text: nn.Module  # BlipTextModel cross-attending to the image tokens
    head: nn.Sequential  # [N, 768] -> [N, 1]
    tokenizer: Any  # BertTokenizer


def load_model(options: ImageRewardOptions, device: torch.device) -> ImageRewardModel:
    """Build the modules and load the checkpoint into them, after checking every file exists (UserError, before any
    weight loads)."""
    path = checkpoint_path(options)
    source = tokenizer_source(options)
    if source.problem:
        raise UserError(source.problem)
    med = med_config(options)
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(source.path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})  # BLIP's
    vision, text, head = make_modules(med, {**VIT_LARGE, **options.vision}, options.image_size)
    parts = split_state_dict(read_state_dict(path))
    for name, module, state in zip(
        ("visual encoder", "text encoder", "head"), (vision, text, head), parts, strict=True
    ):
        try:
            result = module.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # size mismatches
            raise UserError(f"{WHERE}: {path} does not fit ImageReward's {name}: {exc}") from exc
        buffers = {n for n, _ in module.named_buffers()}
        missing = [k for k in result.missing_keys if k not in buffers]
        if missing or result.unexpected_keys:
            raise UserError(
                f"{WHERE}: {path} is not an ImageReward checkpoint: its {name} lacks {missing[:3]} and has "
                f"unexpected {result.unexpected_keys[:3]}."
            )
    for module in (vision, text, head):
        module.to(device).eval().requires_grad_(False)
    return ImageRewardModel(vision, text, head, tokenizer)


@register("reward", "imagereward", options=ImageRewardOptions)
class ImageRewardReward:
    """RewardModel: ImageReward of each image for its prompt; ``scores`` [N] float32 on the CPU (the raw score
    standardised by the package's mean and std: mostly within -2..2)."""

    @staticmethod
    def weight_sources(options: ImageRewardOptions, settings: dict) -> list[WeightSource]:
        """Where the checkpoint and the tokenizer will be read from, found without the network."""
        what = "reward 'imagereward' checkpoint (option checkpoint)"
        try:
            path = checkpoint_path(options)
        except UserError as exc:
            checkpoint = WeightSource(what, options.checkpoint or f"{REPO}/{FILE}", None, str(exc))
        else:
            origin = "local file" if options.checkpoint else "Hugging Face cache"
            checkpoint = WeightSource(what, str(path), f"{origin} {path}", path=str(path))
        return [checkpoint, tokenizer_source(options)]

    def __init__(self, options: ImageRewardOptions | None = None):
        self.options = options or ImageRewardOptions()
        self.device = resolve_device(self.options.device)
        self._lock = threading.Lock()
        self._model: ImageRewardModel | None = None

    def load(self) -> ImageRewardModel:
        """Load the model now (the first call does it otherwise); the first calls of two threads share one."""
        with self._lock:
            if self._model is None:
                self._model = load_model(self.options, self.device)
            return self._model

    def preprocess(self, images: Tensor) -> Tensor:
        """[N, 3, H, W] in [0, 1] -> [N, 3, s, s] normalised ViT input on the model's device (s = image_size): the
        package's Resize(s, bicubic), CenterCrop(s), CLIP normalisation, done in torch (``clip_preprocess``)."""
        s = self.options.image_size
        return clip_preprocess(images.to(self.device), s, (s, s), CLIP_MEAN, CLIP_STD, "bicubic", offset="round")

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts; ``scores`` [N] float32."""
        if len(images) != len(prompts):
            raise ValueError(f"Got {len(images)} images for {len(prompts)} prompts.")
        model = self.load()
        pixels = self.preprocess(images)
        tokens = model.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        image_tokens = model.vision(pixel_values=pixels).last_hidden_state
        text = model.text(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
            encoder_hidden_states=image_tokens,  # no mask: every image token is attended to, as the package does
            is_decoder=False,  # bidirectional self-attention over the prompt, as BLIP's encoder
        ).last_hidden_state[:, 0]
        raw = model.head(text.float())[:, 0]
        return RewardOutput(scores=((raw - SCORE_MEAN) / SCORE_STD).float().cpu(), details={})
