"""LoRA on a diffusers transformer through peft, saved in the format ``pipe.load_lora_weights(dir)`` reads.

Shared by the SD3 and FLUX backbones (plain functions, no base class). The adapter is injected with the
transformer's own ``add_adapter`` (diffusers' PeftAdapterMixin, i.e. peft's ``inject_adapter_in_model``) under
the adapter name ``default``. It is saved with the pipeline class's ``save_lora_weights``: one
``pytorch_lora_weights.safetensors`` whose keys start with ``transformer.`` and whose header carries the
LoraConfig (so ``load_lora_weights`` applies alpha / r, not 1).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tpflow.errors import UserError

LORA_FILE = "pytorch_lora_weights.safetensors"
PREFIX = "transformer."


def add_lora(transformer: torch.nn.Module, rank: int, alpha: float, targets: Sequence[str], init: str) -> Any:
    """Inject a LoRA adapter into ``transformer`` and freeze everything but its matrices; returns the LoraConfig.

    The adapter's matrices are float32 whatever the base dtype (peft casts the layer input to them and the sum back
    to the base dtype), as the reference does with ``cast_training_params``.
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=True if init == "default" else init,
    )
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(config)
    except ValueError as exc:  # peft: no module matched the targets
        raise UserError(f"LoRA targets {list(targets)} do not fit the transformer: {exc}") from None
    for name, param in transformer.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name:  # train the adapter in fp32 under an fp16/bf16 base: Adam's steps would underflow
            param.data = param.data.float()
    return config


def lora_parameters(transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA matrices (lora_A, lora_B of every adapted layer), in module order."""
    return [p for name, p in transformer.named_parameters() if "lora_" in name]


def lora_layers(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The peft layers of the transformer (each adapted Linear), in module order."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapter_disabled(transformer: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> Iterator[None]:
    """The frozen base transformer: adapters off inside the block, back on at exit (even on error).

    Toggles peft's layers (``layers``, or every one of the transformer) as diffusers' ``disable_adapters`` /
    ``enable_adapters`` do, without their per-call check of the installed peft version: it reads package metadata,
    about 6 ms a call, twice per KL reference pass (0.28 s of a tiny-sd3 epoch, docs/results.md)."""
    layers = lora_layers(transformer) if layers is None else layers
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def save_lora(
    pipeline_cls: Any, transformer: torch.nn.Module, config: Any, directory: Path, state: dict | None = None
) -> None:
    """Write ``pytorch_lora_weights.safetensors`` (diffusers' LoRA format, the LoraConfig in its header); from
    ``state`` (the transformer's full state dict, e.g. gathered from shards) when given."""
    from peft import get_peft_model_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lora = get_peft_model_state_dict(transformer, state_dict=state)
    state = {k: v.detach().contiguous().cpu() for k, v in lora.items()}
    metadata = json.loads(json.dumps(config.to_dict(), default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    pipeline_cls.save_lora_weights(
        str(directory), transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
    )


def load_lora(transformer: torch.nn.Module, config: Any, directory: Path) -> None:
    """Load an adapter written by ``save_lora`` into the injected adapter (rank and targets must match)."""
    from peft import set_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(directory) / LORA_FILE
    if not path.is_file():
        raise UserError(f"No LoRA adapter at {path}: save_adapter writes {LORA_FILE} into the folder.")
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    packed = json.loads(header.get("lora_adapter_metadata", "{}"))  # {"transformer.r": 32, ...}
    saved = {k.removeprefix(PREFIX): v for k, v in packed.items() if k.startswith(PREFIX)}
    if saved:
        mine = {"r": config.r, "lora_alpha": config.lora_alpha, "target_modules": sorted(config.target_modules)}
        theirs = {k: saved.get(k) for k in mine}
        theirs["target_modules"] = sorted(theirs["target_modules"] or [])
        if mine != theirs:
            raise UserError(
                f"The adapter in {directory} has {theirs} but this backbone has {mine}; set lora_rank, lora_alpha "
                "and lora_targets in [backbone] to the saved values."
            )
    state = {k.removeprefix(PREFIX): v for k, v in load_file(str(path)).items() if k.startswith(PREFIX)}
    device = next(transformer.parameters()).device
    result = set_peft_model_state_dict(transformer, {k: v.to(device) for k, v in state.items()})
    if result.unexpected_keys:
        raise UserError(f"The adapter in {directory} has keys this model lacks: {result.unexpected_keys[:4]}...")


def merged_copy_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's weights with the adapter merged in (W + alpha/r·B·A), adapter keys dropped; no side effect."""
    from peft.tuners.lora import LoraLayer

    state: dict[str, torch.Tensor] = {}
    layers = {name: m for name, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in transformer.state_dict().items():
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        if owner.endswith(".base_layer") and layer_name in layers and leaf == "weight":
            layer = layers[layer_name]
            tensor = tensor + layer.get_delta_weight("default").to(tensor.dtype)
        state[name.replace(".base_layer.", ".")] = tensor.detach().contiguous().cpu()
    return state


def save_merged(transformer: torch.nn.Module, directory: Path) -> None:
    """The transformer with the adapter merged in, as a diffusers model folder (``from_pretrained`` reads it)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    transformer.save_config(str(directory))
    save_file(merged_copy_state(transformer), str(directory / "diffusion_pytorch_model.safetensors"))


class LoraAdapter:
    """The peft LoRA on a diffusers pipeline's transformer, as a backbone holds it (composition, no base class).

    SD3 and FLUX differ only in the pipeline class whose ``load_lora_weights`` reads the saved file; the backbone
    forwards the adapter half of the Backbone protocol (trainable parameters, KL reference, save / load / merge) here.
    """

    def __init__(self, pipeline_class: type, transformer: torch.nn.Module, config: Any) -> None:
        self.pipeline_class = pipeline_class
        self.transformer = transformer  # the LoRA-injected transformer
        self.config = config  # the peft LoraConfig that ``add_lora`` returned
        self._layers: list[torch.nn.Module] | None = None  # the peft layers, found once

    def parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA matrices."""
        return lora_parameters(self.transformer)

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """The frozen base transformer (adapter disabled): the KL reference."""
        if self._layers is None:
            self._layers = lora_layers(self.transformer)
        return adapter_disabled(self.transformer, self._layers)

    def save(self, directory: Path, state: dict | None = None) -> None:
        """``pytorch_lora_weights.safetensors`` that the pipeline class's ``load_lora_weights(dir)`` reads (from
        ``state``, the transformer's full state dict, when given: a sharded run's)."""
        save_lora(self.pipeline_class, self.transformer, self.config, directory, state)

    def load(self, directory: Path) -> None:
        """Load an adapter written by ``save`` (rank, alpha and targets must match)."""
        load_lora(self.transformer, self.config, directory)

    def save_merged(self, directory: Path) -> None:
        """The transformer with the adapter merged in, as a diffusers model folder (``from_pretrained`` reads it)."""
        save_merged(self.transformer, directory)


class AdapterMethods:
    """The adapter half of the Backbone protocol for a backbone that holds a ``LoraAdapter`` as ``self.adapter``:
    each method forwards to it (SD3 and FLUX share these; shapes-dit has its own peft model). ``eval`` / ``train``
    return the backbone: sampling and training share one module state."""

    adapter: LoraAdapter

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.adapter.parameters()

    def reference(self) -> contextlib.AbstractContextManager[None]:
        return self.adapter.disabled()

    def save_adapter(self, directory: Path) -> None:
        self.adapter.save(directory)

    def load_adapter(self, directory: Path) -> None:
        self.adapter.load(directory)

    def save_merged(self, directory: Path) -> None:
        self.adapter.save_merged(directory)

    def eval(self):  # noqa: ANN201
        return self

    def train(self, mode: bool = True):  # noqa: ANN201
        return self
