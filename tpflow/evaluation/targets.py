"""What ``tpflow eval`` and ``tpflow sample`` look at: a run, a checkpoint, an exported LoRA, or a recipe's base model.

``resolve_target`` only reads small files (JSON, the checkpoint's manifest-verified state) and decides which recipe
builds the backbone and which adapter goes into it; ``load_model`` then builds the backbone (where weights load) and
puts the adapter in, with the EMA weights when the run kept them and they are asked for (the paper evaluates them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from tpflow import registry
from tpflow.errors import UserError
from tpflow.recipe import Recipe, apply_overrides, load_recipe, validate_recipe
from tpflow.train.checkpoints.resume import does_not_fit

EXPORT_MANIFEST = "tpflow_export.json"  # what ``tpflow export`` writes beside the adapter
EXPORT_RECIPE = "recipe.json"


@dataclass(frozen=True)
class Target:
    """A resolved TARGET: the recipe that builds its backbone and the adapter (if any) to load into it."""

    kind: Literal["run", "checkpoint", "export", "recipe"]
    path: Path
    recipe: Recipe
    adapter_dir: Path | None = None
    checkpoint: Any = None  # a run's or checkpoint's: its weights load through it (an adapter or a sharded run's)
    ema_state: dict[str, torch.Tensor] | None = None  # the run's EMA of the adapter, when it kept one
    step: int | None = None  # optimizer step of the checkpoint
    scored_as: str | None = None  # a baseline's: the target whose recipe scores it (tpflow.evaluation.scorer)

    @property
    def label(self) -> str:
        """A short name for tables: ``runs/x@step 40`` / ``lora/`` / ``recipes/x.toml (base)``."""
        if self.kind in ("run", "checkpoint"):
            return f"{self.path}@{self.step}"
        return f"{self.path} (base)" if self.kind == "recipe" else str(self.path)

    @property
    def short_name(self) -> str:
        """A name short enough for a grid's column header: ``shapes_tp@40`` / ``lora`` / ``shapes_tp (base)``."""
        if self.kind in ("run", "checkpoint"):  # path is the run dir for both
            return f"{self.path.name}@{self.step}"
        return f"{self.path.stem} (base)" if self.kind == "recipe" else self.path.name

    def describe(self, ema: bool) -> dict[str, Any]:
        """The target as eval.json records it."""
        return {
            "target": str(self.path),
            "kind": self.kind,
            "backbone": self.recipe.backbone.name,
            "step": self.step,
            "ema": bool(ema and self.ema_state is not None),
            **({"scored_as": self.scored_as} if self.scored_as is not None else {}),
        }


def resolve_target(
    target: str | Path,
    recipe: Path | None = None,
    checkpoint: str | None = None,
    overrides: list[str] | None = None,
    resolution: int | None = None,
) -> Target:
    """Decide what TARGET is: a recipe TOML (the base model), a run dir (its newest valid checkpoint, or the one
    ``checkpoint`` names: a step or a directory name under ``checkpoints/``), a checkpoint dir, or an exported
    adapter folder (``tpflow export``; its recipe is stored beside it, or ``recipe`` gives one).

    ``overrides`` (``section.key=value``) apply to the recipe however it was found, e.g. a moved model path;
    ``resolution`` sets ``backbone.resolution`` (only backbones with a variable image size have it)."""
    path = Path(target)
    overrides = list(overrides or [])
    if not path.exists():
        raise UserError(
            f"Unknown target {str(target)!r}: no such file or directory. TARGET is a run dir (runs/NAME), a "
            "checkpoint dir (runs/NAME/checkpoints/STEP), a folder written by `tpflow export`, or a recipe .toml "
            "(the base model)."
        )
    if path.is_file():
        return _recipe_target(path, checkpoint, overrides, resolution)
    if recipe is not None and (path / "checkpoints").is_dir():
        raise UserError(
            f"{path} is a run dir: its checkpoints hold the recipe they were trained with, so --recipe is not "
            "used; change options with --set section.key=value."
        )
    if (path / "checkpoints").is_dir() or (path / "manifest.json").is_file():
        return _checkpoint_target(path, checkpoint, overrides, resolution)
    started = nothing_saved(path)
    if started is not None:
        raise UserError(started)
    if checkpoint is not None:
        raise UserError(f"--checkpoint picks a checkpoint of a run dir; {path} has no checkpoints/ folder.")
    return _export_target(path, recipe, overrides, resolution)


RUN_FILES = ("metrics.jsonl", "traces.jsonl", ".lock", "samples", "tensorboard")  # what a run writes before a save


def nothing_saved(path: Path) -> str | None:
    """What to say of a folder that is a run dir with nothing saved yet (a run stopped before its first checkpoint:
    it has its logs but no ``checkpoints/``), or None when ``path`` is not one."""
    found = [name for name in RUN_FILES if (path / name).exists()]
    if not found or (path / "checkpoints").is_dir() or (path / "manifest.json").is_file():
        return None
    return (
        f"{path} is a run dir with nothing saved yet: it has {', '.join(found)} but no checkpoints/ (a run writes "
        "its first checkpoint every train.save_every epochs and at its end; this one stopped before that). There "
        "are no trained weights to use: start the run again with the same `tpflow train RECIPE --run-dir "
        f"{path}` (it tidies the stopped attempt's logs), or use the base model, `tpflow eval RECIPE`."
        + (" Its evaluations so far are in metrics.jsonl." if "metrics.jsonl" in found else "")
    )


def _recipe_target(path: Path, checkpoint: str | None, overrides: list[str], resolution: int | None) -> Target:
    """A recipe TOML as TARGET: the base model, no adapter; a file that is not a .toml, or a --checkpoint (which
    only a run dir has), is a UserError."""
    if path.suffix != ".toml":
        raise UserError(f"Target {path} is a file but not a recipe (.toml); see `tpflow eval --help`.")
    if checkpoint is not None:
        raise UserError("--checkpoint picks a checkpoint of a run dir; the target here is a recipe.")
    loaded = load_recipe(path, overrides)
    if resolution is not None:
        loaded = validate_recipe(_with_resolution(loaded.data, resolution, path), where=str(path), path=path)
    return Target("recipe", path, loaded)


def _checkpoint_target(path: Path, checkpoint: str | None, overrides: list[str], resolution: int | None) -> Target:
    """A run dir (its newest valid checkpoint, or the one ``checkpoint`` names) or a checkpoint dir as TARGET: the
    recipe the checkpoint stores (it is what trained the adapter), with the overrides, and its adapter and EMA."""
    from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint

    where = path
    if checkpoint is not None:
        where = _named_checkpoint(path, checkpoint)
    found, notes = find_checkpoint(where)
    if found is None:
        why = f" ({'; '.join(notes)})" if notes else ""
        raise UserError(f"No valid checkpoint in {where}{why}. Train it first, or pass a checkpoint dir.")
    ckpt = load_checkpoint(found)
    data = _with_resolution(ckpt.recipe, resolution, path)
    apply_overrides(data, overrides)
    kind = "run" if (path / "checkpoints").is_dir() else "checkpoint"
    run = path if kind == "run" else found.parent.parent
    return Target(
        kind,
        run,
        validate_recipe(data, where=f"the recipe stored in {found}"),
        adapter_dir=ckpt.adapter_dir,
        checkpoint=ckpt,
        ema_state=ckpt.full_ema(),
        step=ckpt.step,
    )


def _export_target(path: Path, recipe: Path | None, overrides: list[str], resolution: int | None) -> Target:
    """A folder from ``tpflow export`` (or any folder of .safetensors) as TARGET. Its recipe is ``recipe`` when
    given, else the one stored beside the adapter; a merged export, or a recipe of another backbone than the one the
    manifest says the adapter was trained on, is a UserError (it could not load, or would load into the wrong
    model)."""
    manifest = _read_json(path / EXPORT_MANIFEST) if (path / EXPORT_MANIFEST).is_file() else None
    if manifest is None and not any(path.glob("*.safetensors")):
        raise UserError(
            f"Unknown target {path}: a folder that is neither a run dir (no checkpoints/), a checkpoint (no "
            f"manifest.json) nor an adapter folder (no {EXPORT_MANIFEST}, no .safetensors file)."
        )
    if manifest is not None and manifest.get("merged"):
        raise UserError(
            f"{path} holds a merged transformer (tpflow export --merge); evaluate the run it came from, or an export "
            "without --merge."
        )
    if recipe is not None:
        loaded = load_recipe(recipe, overrides)
        if resolution is not None:
            loaded = validate_recipe(_with_resolution(loaded.data, resolution, path), where=str(recipe), path=recipe)
    elif (path / EXPORT_RECIPE).is_file():
        data = _with_resolution(_read_json(path / EXPORT_RECIPE), resolution, path)
        apply_overrides(data, overrides)
        loaded = validate_recipe(data, where=f"the recipe stored in {path / EXPORT_RECIPE}")
    else:
        raise UserError(
            f"{path} holds an adapter but no {EXPORT_RECIPE} saying which model it belongs to (exports before "
            "tpflow 0.1 lack it): pass the recipe it was trained with, --recipe RECIPE.toml."
        )
    trained_on = (manifest or {}).get("backbone")
    if trained_on is not None and trained_on != loaded.backbone.name:
        raise UserError(
            f"The adapter in {path} was exported from a {trained_on!r} backbone, but the recipe builds "
            f"{loaded.backbone.name!r}: an adapter only fits the model it was trained on."
        )
    return Target("export", path, loaded, adapter_dir=path, step=(manifest or {}).get("step"))


def load_model(target: Target, ema: bool = True) -> Any:
    """Build the target's backbone and load its adapter (the EMA weights when ``ema`` and the run kept them)."""
    backbone = target.recipe.build("backbone")
    if target.adapter_dir is not None:
        try:
            if target.checkpoint is not None:
                target.checkpoint.load_weights(backbone)
            else:
                backbone.load_adapter(target.adapter_dir)
        except UserError:
            raise
        except Exception as err:
            if not does_not_fit(err):  # a bug in tpflow or a plugin: its own traceback
                err.add_note(
                    f"tpflow: raised while loading the adapter in {target.adapter_dir}; a bug, not an adapter that "
                    "does not fit the backbone: please report it with this traceback."
                )
                raise
            raise UserError(
                f"The adapter in {target.adapter_dir} does not fit the {target.recipe.backbone.name!r} backbone "
                f"({type(err).__name__}: {str(err).splitlines()[0][:300]}). Was it trained on another model?"
            ) from None
    if ema and target.ema_state is not None:
        apply_ema(backbone, target.ema_state, target.adapter_dir or target.path)
    return backbone


def apply_ema(backbone: Any, ema_state: dict[str, torch.Tensor], where: Path) -> None:
    """Copy a checkpoint's EMA shadow (keyed "0", "1", ... in ``trainable_parameters`` order) into the adapter."""
    params = backbone.trainable_parameters()
    if len(params) != len(ema_state):
        raise UserError(f"The EMA in {where} has {len(ema_state)} tensors for {len(params)} parameters.")
    with torch.no_grad():
        for i, param in enumerate(params):
            shadow = ema_state[str(i)]
            if shadow.shape != param.shape:
                raise UserError(
                    f"The EMA in {where}: tensor {i} has shape {list(shadow.shape)}, the adapter's is "
                    f"{list(param.shape)}."
                )
            param.copy_(shadow.to(param.device, param.dtype))


def _with_resolution(data: dict[str, Any], resolution: int | None, target: Path) -> dict[str, Any]:
    """``data`` with ``backbone.resolution`` set; a backbone without that option (a fixed image size) is a UserError.
    An unknown backbone name is left for the recipe's validation to report."""
    if resolution is None:
        return data
    name = (data.get("backbone") or {}).get("name")
    if not isinstance(name, str):
        return data
    try:
        fields = registry.get("backbone", name).options.model_fields
    except UserError:
        return data
    if "resolution" not in fields:
        raise UserError(
            f"--resolution {resolution}: the {name!r} backbone of {target} has a fixed image size; --resolution "
            "applies to the SD3 and FLUX backbones."
        )
    return {**data, "backbone": {**data["backbone"], "resolution": resolution}}


def _named_checkpoint(run: Path, name: str) -> Path:
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    candidates = [root / name]
    if name.isdigit():
        candidates.append(root / f"{int(name):08d}")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    have = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.isdigit()) if root.is_dir() else []
    raise UserError(
        f"No checkpoint {name!r} in {root}; it has: {', '.join(have) or 'none'}. A run keeps only its newest "
        "train.keep_checkpoints checkpoints (3 by default; 0 keeps every one), so older steps are deleted as it "
        "trains."
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"Cannot read {path}: {err}.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} should hold a JSON object, not {type(data).__name__}.")
    return data
