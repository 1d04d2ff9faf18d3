"""Full fine-tuning: every weight of the transformer trained, as the adapter half of the Backbone protocol.

``[backbone] finetune = "full"`` builds a backbone whose trainable parameters are the whole transformer (text encoders
and VAE stay frozen) instead of a LoRA adapter. What differs from LoRA, and why:

* **fp32 master weights.** The transformer is loaded in float32 (the stored weights exactly, not their rounding to
  ``[backbone] dtype``: ``diffusers_common.fp32_parts``) and trained there; the recipe's ``mixed_precision``
  (autocast) computes in bf16 / fp16. AdamW steps on bf16 weights lose most updates below the weight's precision
  (its 8 mantissa bits), which is why every full fine-tuning recipe of the field keeps fp32 masters (16 bytes a
  parameter with AdamW: weight, gradient, two moments). The backbone's inputs follow the weights (float32).
* **The KL reference is the initial weights.** LoRA gets it for free by disabling the adapter; here a frozen copy of
  the transformer as built is kept on the CPU (host memory, 4 bytes a parameter) and moved to the model's device at
  the first ``reference()`` (β > 0): device memory is spent only by runs that use the reference (sharded with the
  model under FSDP: ``shard_reference``). Inside
  ``reference()`` the live transformer's ``forward`` is the copy's, so the backbone's own ``velocity`` code runs the
  reference unchanged; the copy's parameters do not require gradients, so no autocast cast of them is cached.
* **Saved as a model, not an adapter**: ``save`` writes the transformer in its own format (diffusers'
  ``save_pretrained`` layout, safetensors, for the diffusers backbones), which ``from_pretrained`` reads; ``load``
  reads safetensors only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tpflow.errors import UserError


class FullWeights:
    """The transformer's own weights as the trained parameters (composition: a backbone holds one as its adapter).

    Args:
        module: the transformer, as built (its weights are the KL reference), in float32 (cast here if it is not) and
            unfrozen here.
        save: writes ``module`` into a folder (the backbone's model format, safetensors), its weights from the given
            state dict when there is one (a sharded run's, gathered).
        load_state: reads the state dict ``save`` wrote from a folder (safetensors only; never unpickles).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        save: Callable[[torch.nn.Module, Path, dict[str, torch.Tensor] | None], None],
        load_state: Callable[[Path], dict[str, torch.Tensor]],
    ) -> None:
        self.module = module.float().requires_grad_(True)
        self._save, self._load_state = save, load_state
        # the initial weights, frozen, on the host until a reference pass needs them on the device
        self._reference = _moved(copy.deepcopy(self.module).requires_grad_(False).eval(), torch.device("cpu"))
        self._reference_on_device = False

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of the transformer, in module order (the order EMA and checkpoints key them by)."""
        return list(self.module.parameters())

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The frozen initial transformer: the KL reference. The live module's ``forward`` is the copy's inside."""
        if self._reference is None:
            raise RuntimeError("the KL reference of this full fine-tune was dropped (its optimizer said it uses none)")
        if not self._reference_on_device:
            _moved(self._reference, next(self.module.parameters()).device)
            self._reference_on_device = True
        own = self.module.__dict__.get("forward")  # an instance-level forward someone installed, kept
        reference = self._reference
        self.module.forward = lambda *args, **kwargs: reference(*args, **kwargs)  # through its hooks (FSDP's)
        try:
            yield
        finally:
            if own is None:
                del self.module.forward
            else:
                self.module.forward = own

    def drop_reference(self) -> None:
        """Release the frozen copy: the run's optimizer never calls ``reference()`` (beta = 0)."""
        self._reference = None

    def shard_reference(self, shard: Callable[[torch.nn.Module], object], device: torch.device) -> None:
        """Under FSDP (``tpflow.train.sharding``): the frozen copy moves to the device and is sharded as the live
        model is (1/P of it per process), rather than held whole on the host and then on every device."""
        if self._reference is not None:
            _moved(self._reference, device)
            shard(self._reference)
            self._reference_on_device = True

    def save(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The trained transformer as a model folder (diffusers: ``config.json`` + safetensors); its weights from
        ``state`` when given (a sharded run's, gathered)."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._save(self.module, Path(directory), state)

    def load(self, directory: Path) -> None:
        """Load weights ``save`` wrote (every key must match: another model's file is refused)."""
        state = self._load_state(Path(directory))
        result = self.module.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise UserError(
                f"The weights in {directory} do not fit this transformer (missing {result.missing_keys[:4]}, "
                f"unexpected {result.unexpected_keys[:4]}): was it trained on another model or with LoRA?"
            )

    def save_merged(self, directory: Path) -> None:
        """There is no adapter to merge: the model as ``save`` writes it."""
        self.save(directory)


def _moved(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` on ``device``, moved only if some parameter is elsewhere (a move in place is a no-op otherwise)."""
    if any(p.device != device for p in module.parameters()):
        module.to(device)
    return module


def diffusers_save(module: torch.nn.Module, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` with safetensors: ``config.json`` and ``diffusion_pytorch_model.safetensors`` (from
    ``state`` when given: the config, then the tensors, as ``save_pretrained`` lays them out)."""
    if state is None:
        module.save_pretrained(str(directory), safe_serialization=True)
        return
    import json

    from safetensors.torch import save_file

    # save_config names the module's class, which under FSDP is torch's FSDP<Model> subclass, a name diffusers
    # cannot load; the config names the model's own class (the first of its classes that is not torch's)
    config = json.loads(module.to_json_string())
    config["_class_name"] = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.")).__name__
    (Path(directory) / module.config_name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(Path(directory) / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


def diffusers_state(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict in a diffusers model folder (one safetensors file or an index of shards)."""
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    single = directory / "diffusion_pytorch_model.safetensors"
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(directory / shard)).items()}
    raise UserError(
        f"No transformer weights in {directory}: a full fine-tune's checkpoint and export hold "
        "diffusion_pytorch_model.safetensors (save_pretrained's layout)."
    )
