"""shapes-dit's LoRA: a peft adapter injected into the DiT, saved in peft's format (safetensors).

The adapter half of the Backbone protocol for ``shapes-dit`` with ``finetune = "lora"`` (the default); the backbone
holds one as its ``adapter`` (``tpflow.backbones.full_finetune.FullWeights`` is the other kind).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from tpflow.errors import UserError

ADAPTER_FILE = "adapter_model.safetensors"


class ShapesLora:
    """A peft LoRA on a ShapesDiT (``options``: lora_rank, lora_alpha, lora_targets, lora_init)."""

    def __init__(self, model: torch.nn.Module, options: Any, device: torch.device) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        self.device = device
        self.lora_config = LoraConfig(
            r=options.lora_rank,
            lora_alpha=options.lora_alpha,
            target_modules=list(options.lora_targets),
            init_lora_weights=True if options.lora_init == "default" else "gaussian",
        )
        try:
            self.model = inject_adapter_in_model(self.lora_config, model)
        except ValueError as exc:  # peft: no module matched the targets
            raise UserError(f"shapes-dit: LoRA targets {options.lora_targets} do not fit the model: {exc}") from None
        for name, param in self.model.named_parameters():
            param.requires_grad_("lora_" in name)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA matrices (lora_A, lora_B of every targeted layer)."""
        return [p for name, p in self.model.named_parameters() if "lora_" in name]

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """The frozen base model: adapters disabled on every peft layer, re-enabled on exit."""
        from tpflow.backbones.diffusers_lora import adapter_disabled

        return adapter_disabled(self.model, self.layers())

    def save(self, directory: Path, state: dict | None = None) -> None:
        """Write ``adapter_model.safetensors`` and ``adapter_config.json`` (peft's format, adapter name dropped);
        from ``state``, the model's full state dict (a sharded run's, gathered), when given."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, state_dict=state)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(directory / ADAPTER_FILE))
        self.lora_config.save_pretrained(str(directory))

    def load(self, directory: Path) -> None:
        """Load an adapter written by ``save`` (safetensors only); its rank and targets must match."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        directory = Path(directory)
        path = directory / ADAPTER_FILE
        if not path.is_file():
            raise UserError(f"No LoRA adapter at {path}: save_adapter writes {ADAPTER_FILE} into the folder.")
        config_path = directory / "adapter_config.json"
        if config_path.is_file():
            saved = json.loads(config_path.read_text())
            mine = {"r": self.lora_config.r, "target_modules": sorted(self.lora_config.target_modules)}
            theirs = {"r": saved.get("r"), "target_modules": sorted(saved.get("target_modules") or [])}
            if mine != theirs:
                raise UserError(
                    f"The adapter in {directory} has {theirs} but this shapes-dit has {mine}; set lora_rank and "
                    "lora_targets in [backbone] to the saved values."
                )
        result = set_peft_model_state_dict(self.model, load_file(str(path), device=str(self.device)))
        if result.unexpected_keys:
            raise UserError(f"The adapter in {directory} has keys this model lacks: {result.unexpected_keys[:4]}...")

    def layers(self) -> list[torch.nn.Module]:
        """The peft layers of the model, in module order."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
