"""Backbone ``shapes-dit``: the embedded shapes world's tiny pixel-space DiT with a peft LoRA adapter.

    [backbone]
    name = "shapes-dit"
    weights = "runs/shapes-pretrain/shapes_dit.safetensors"   # omit for the weights shipped in the package
    lora_rank = 8

The model (``tpflow.shapes.model.ShapesDiT``) predicts the rectified-flow velocity of 32×32 RGB images scaled to
[-1, 1]; its "latents" are those pixels, so ``decode`` only rescales. CFG runs the unconditional branch on the
learned null text, batched with the conditional one in a single call (docs/algorithm.md §1.1).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.backbones import option_help
from tpflow.backbones.shapes_lora import ShapesLora
from tpflow.devices import randn, resolve_device
from tpflow.errors import UserError
from tpflow.guidance import combine
from tpflow.registry import register
from tpflow.samplers.schedules import sd3_sigmas
from tpflow.shapes import vocab
from tpflow.shapes.model import LORA_TARGETS, ShapesDiT, load_checkpoint
from tpflow.types import Conditioning
from tpflow.weights import WeightSource

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "shapes" / "weights"
WEIGHTS_FILE = "shapes_dit.safetensors"


def save_model(
    model: torch.nn.Module, directory: Path, state: dict[str, Tensor] | None = None, file: str = WEIGHTS_FILE
) -> None:
    """A full fine-tune's weights: ``shapes_dit.safetensors`` (``file``) with its .json config, as ``shapes
    pretrain`` writes them (so the folder is also a ``weights`` value for a later run); from ``state`` when given."""
    from tpflow.shapes.model import save_checkpoint

    save_checkpoint(model, Path(directory) / file, state=state)


def model_state(directory: Path, file: str = WEIGHTS_FILE) -> dict[str, Tensor]:
    """The state dict ``save_model`` wrote (safetensors)."""
    from safetensors.torch import load_file

    path = Path(directory) / file
    if not path.is_file():
        raise UserError(f"No shapes-world weights at {path}: a full fine-tune's checkpoint holds {file}.")
    return load_file(str(path))


class ShapesDitOptions(BaseModel):
    """Options of the ``shapes-dit`` backbone."""

    model_config = ConfigDict(extra="forbid")

    weights: str | None = Field(None, description=option_help.WEIGHTS)
    finetune: Literal["lora", "full"] = Field("lora", description=option_help.FINETUNE)
    lora_rank: int = Field(8, ge=1, description=option_help.LORA_RANK)
    lora_alpha: float = Field(16.0, gt=0, description=option_help.LORA_ALPHA)
    lora_targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), description=option_help.LORA_TARGETS)
    lora_init: Literal["default", "gaussian"] = Field("default", description=option_help.LORA_INIT)
    device: str = Field("cpu", description=option_help.DEVICE)
    shift: float = Field(
        3.0, gt=0, description="Static time shift of the SD3 sigma schedule (dropping it costs accuracy)."
    )
    compile_blocks: bool = Field(False, description=option_help.COMPILE_BLOCKS)


def resolve_weights(
    weights: str | None, file: str = WEIGHTS_FILE, name: str = "shapes-dit",
    create: str = "`tpflow shapes pretrain --out DIR` (about 45 minutes on 2 CPU cores)",
) -> Path:  # fmt: skip
    """The .safetensors path named by the ``weights`` option (``file`` in a folder, or the shipped one); UserError
    saying how to create it (``create``) when missing."""
    path = WEIGHTS_DIR / file if weights is None else Path(weights).expanduser()
    if path.is_dir():
        path = path / file
    if not path.is_file():
        where = f"The shipped {name} weights are" if weights is None else f"The {name} weights {str(path)!r} are"
        raise UserError(
            f"{where} missing ({path}). Create them with {create} and pass weights = 'DIR/{file}' in the [backbone] "
            "section."
        )
    return path


@register("backbone", "shapes-dit", options=ShapesDitOptions)
class ShapesBackbone:
    """Backbone (tpflow.interfaces) of the embedded shapes world: ShapesDiT plus a peft LoRA adapter.

    Options (``ShapesDitOptions``): ``weights``, ``lora_rank``, ``lora_alpha``, ``lora_targets``, ``lora_init``,
    ``device``, ``shift``. Latents are pixels [N, 3, 32, 32] in [-1, 1] (float32). The base weights are frozen;
    ``trainable_parameters`` are the LoRA matrices only.
    """

    # what the video shapes world's backbone (tpflow/backbones/shapes_video.py) replaces
    weights_file = WEIGHTS_FILE
    model_name = "shapes-dit"
    options_class: type[BaseModel] = ShapesDitOptions

    @staticmethod
    def _resolve(weights: str | None) -> Path:
        return resolve_weights(weights)

    @staticmethod
    def _model(config: Any) -> torch.nn.Module:
        from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig

        return ShapesDiT(ShapesDiTConfig.from_dict(config) if isinstance(config, dict) else config)

    @staticmethod
    def _tokenize(prompts: list[str], max_tokens: int) -> tuple[Tensor, Tensor]:
        return vocab.tokenize(prompts, max_tokens)

    def _load(self, path: Path) -> ShapesDiT:
        return load_checkpoint(path, self.device)

    @staticmethod
    def prompt_warnings(prompts: Sequence[str]) -> list[str]:
        """What the closed vocabulary loses of these prompts (``vocab.prompt_warnings``); no weights needed."""
        return vocab.prompt_warnings(list(prompts))

    @classmethod
    def check_machine(cls, options: ShapesDitOptions, settings: dict) -> list[str]:
        """The weights file exists, is a safetensors file and has its model config (the .json beside it or the
        file's metadata), and the LoRA targets name layers of that model (built from the config, random weights); the
        header is read, not the weights."""
        from tpflow.backbones.lora_targets import structure, target_problems
        from tpflow.files import safetensors_problem
        from tpflow.shapes.model import read_config

        name = cls.model_name
        try:
            path = cls._resolve(options.weights)
        except UserError as exc:
            return [f"[backbone] {exc}"]
        problem = safetensors_problem(path, f"[backbone] The {name} weights")
        if problem is None:
            try:
                config = read_config(path)
                cls._model(config)  # the config builds the model (a bad value raises here)
            except Exception as exc:  # no config in the metadata, or a .json beside it that does not parse
                problem = (
                    f"[backbone] The {name} weights {path} have no readable model config ({type(exc).__name__}: "
                    f"{exc}): expected {path.with_suffix('.json')} or a 'config' in the file's metadata."
                )
        if problem:
            return [f"{problem} Use a file written by `tpflow shapes pretrain`."]
        model = structure(lambda: cls._model(config), meta=False)  # 1.7 M parameters
        return target_problems(model, options.lora_targets, name)

    @classmethod
    def weight_sources(cls, options: ShapesDitOptions, settings: dict) -> list[WeightSource]:
        """Where the weights come from (``tpflow.weights``); a missing file is ``check_machine``'s problem."""
        try:
            path = cls._resolve(options.weights)
        except UserError:
            return []
        origin = "shipped file" if options.weights is None else "local file"
        return [WeightSource(f"{cls.model_name} weights (option weights)", str(path), f"{origin} {path}")]

    def __init__(self, options: ShapesDitOptions | None = None) -> None:
        self.options = options = options or type(self).options_class()
        self.device = resolve_device(options.device)
        self.weights_path = self._resolve(options.weights)
        try:
            model = self._load(self.weights_path)
        except Exception as exc:  # random bytes, another model's weights, a bad config beside the file
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"The {self.model_name} weights {self.weights_path} could not be loaded ({type(exc).__name__}: "
                f"{reason}): expected a safetensors file written by `tpflow shapes pretrain`, with its .json config "
                "beside it."
            ) from None
        model.requires_grad_(False)
        if options.finetune == "full":
            from tpflow.backbones.full_finetune import FullWeights

            file = self.weights_file
            self.model: ShapesDiT = model
            self.adapter: ShapesLora | FullWeights = FullWeights(
                model, functools.partial(save_model, file=file), functools.partial(model_state, file=file)
            )
        else:
            self.adapter = ShapesLora(model, options, self.device)
            self.model = self.adapter.model
        self.model.eval()  # no dropout or batch statistics: train and eval modes compute the same function
        self.config = model.config
        if options.compile_blocks:
            from tpflow.backbones.diffusers_common import compile_blocks

            compile_blocks(self.model)

    # ---- Backbone protocol -------------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Word ids and their mask, [N, max_tokens] each (the text encoder runs inside ``velocity``)."""
        tokens, mask = self._tokenize(list(prompts), self.config.max_tokens)
        return Conditioning(tensors={"tokens": tokens.to(self.device), "mask": mask.to(self.device)})

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I): [n, 3, 32, 32] float32 on the model's device, drawn on the generator's device (the CPU by
        tpflow's rule, ``tpflow.devices``)."""
        return randn((n, *self.latent_shape()), generator, self.device)

    def latent_shape(self) -> tuple[int, ...]:
        """One sample's pixels: (C, H, W)."""
        cfg = self.config
        return (cfg.channels, cfg.image_size, cfg.image_size)

    def sigmas(self, num_steps: int) -> Tensor:
        """SD3's shifted schedule ``sd3_sigmas(num_steps, shift)``: [K + 1] float32, the final 0 included."""
        return sd3_sigmas(num_steps, self.options.shift)

    @staticmethod
    def static_sigmas(options: Any, num_steps: int) -> list[float]:
        """``sigmas`` from the options alone (capability ``static_sigmas``: recipe checks read it before building)."""
        return [float(s) for s in sd3_sigmas(num_steps, options.shift)]

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v = v_u + w·(v_c − v_u), both branches in ONE forward on [z; z] (w = 1: the conditional call alone)."""
        n = z.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=z.device).reshape(-1).expand(n)
        tokens, mask = cond.tensors["tokens"], cond.tensors["mask"]
        if len(cond) != n:
            raise ValueError(f"Conditioning has {len(cond)} rows but z has {n}; index or repeat it to match.")
        z = z.float()
        if guidance == 1:
            return self.model(z, sigma, tokens, mask)
        null = torch.arange(2 * n, device=z.device) < n  # [uncond; cond]
        v = self.model(torch.cat([z, z]), sigma.repeat(2), tokens.repeat(2, 1), mask.repeat(2, 1), null)
        v_uncond, v_cond = v.chunk(2)
        return combine(v_uncond, v_cond, guidance)

    def decode(self, z: Tensor) -> Tensor:
        """Pixels in [-1, 1] to images [N, 3, H, W] float32 in [0, 1] (clamped)."""
        return (z.float().clamp(-1, 1) + 1) / 2

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA matrices (lora_A, lora_B of every targeted layer), or every weight (``finetune = "full"``)."""
        return self.adapter.parameters()

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """The frozen base model: the adapter disabled, or the initial weights (``finetune = "full"``)."""
        return self.adapter.disabled()

    def save_adapter(self, directory: Path) -> None:
        """The LoRA in peft's format, or the whole model as ``tpflow shapes pretrain`` writes it."""
        self.adapter.save(directory)

    def load_adapter(self, directory: Path) -> None:
        """Load what ``save_adapter`` wrote (safetensors only)."""
        self.adapter.load(directory)

    def eval(self) -> ShapesBackbone:
        """Nothing to switch (no dropout or batch statistics); kept for trainers that call it."""
        return self

    def train(self, mode: bool = True) -> ShapesBackbone:
        """Nothing to switch (no dropout or batch statistics); kept for trainers that call it."""
        return self
