"""Sharded checkpoints: each process writes its own shards, nothing is gathered (``checkpoint_layout = "sharded"``).

A sharded run (``[train] shard = "fsdp"`` on more than one process) holds 1/P of the trained weights, of their AdamW
moments, of the EMA and of NFT's old policy. Gathered into one host to be written, the whole state (16 bytes a
parameter for a full fine-tune: about 180 GiB for FLUX.1-dev) would have to fit one machine's memory. Here every
process writes its shards with ``torch.distributed.checkpoint`` (DCP) through its Hugging Face storage, which keeps
tensors in safetensors files (one per process, with each shard's offsets in the file's JSON header) and reads them
back by slicing: no pickle is written or read (DCP's default file storage pickles its metadata, and a checkpoint is
a file a user may hand tpflow).

What a checkpoint holds, then: ``shards/*.safetensors`` (the sharded tensors, keyed by where they sit in the state),
``layout.json`` (which parameter and which EMA entry is which key) and, as in every checkpoint, ``optimizer.pt``
(``weights_only``; each sharded tensor replaced by a ``{"sharded_tensor": key}`` marker), ``rng.pt``, ``state.json``
and ``recipe.json``, all sealed by one manifest (``tpflow.train.checkpoints.format``).

Reading reshards: DCP loads each key into a tensor of the reader's layout, so a checkpoint written by 8 processes
resumes on 2 (each process reads the slices its shards cover), on 1 process unsharded (full tensors, no process
group needed), and loads into ``tpflow export`` / ``tpflow eval``, which run on one process.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.shards import is_sharded

SHARDS = "shards"  # the folder of a checkpoint holding DCP's safetensors files
LAYOUT = "layout.json"
MARK = "sharded_tensor"  # {MARK: key}: where a sharded tensor sat in a state that was split


def split(state: Any, prefix: str) -> tuple[Any, dict[str, Tensor]]:
    """``state`` (nested dicts, lists, tuples) with each sharded tensor replaced by a ``{MARK: key}`` marker, and
    the tensors by key (their path in the state, dot-separated: the same on every process)."""
    if is_sharded(state):
        return {MARK: prefix}, {prefix: state.detach()}
    tensors: dict[str, Tensor] = {}
    if isinstance(state, dict):
        skeleton = {}
        for key, value in state.items():
            skeleton[key], found = split(value, f"{prefix}.{key}")
            tensors.update(found)
        return skeleton, tensors
    if isinstance(state, (list, tuple)):
        items = []
        for index, value in enumerate(state):
            item, found = split(value, f"{prefix}.{index}")
            items.append(item)
            tensors.update(found)
        return type(state)(items), tensors
    return state, tensors


def markers(skeleton: Any) -> list[str]:
    """The keys of every marker in ``skeleton``, in order."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {MARK}:
            return [skeleton[MARK]]
        return [key for value in skeleton.values() for key in markers(value)]
    if isinstance(skeleton, (list, tuple)):
        return [key for value in skeleton for key in markers(value)]
    return []


def fill(skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of :func:`split`: each marker replaced by ``tensors[key]``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {MARK}:
            return tensors[skeleton[MARK]]
        return {key: fill(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(fill(value, tensors) for value in skeleton)
    return skeleton


def trained_named(backbone: Any) -> dict[str, Tensor]:
    """The backbone's trained parameters by their name in its transformer (LoRA: the adapter's; full fine-tuning:
    every weight), as the transformer holds them now (sharded or not)."""
    from tpflow.train.sharding import transformer_of

    trained = {id(p) for p in backbone.trainable_parameters()}
    named = {name: p for name, p in transformer_of(backbone).named_parameters() if id(p) in trained}
    if len(named) != len(trained):
        raise UserError(
            f"{type(backbone).__name__} trains {len(trained) - len(named)} parameters outside its transformer, which "
            'a sharded checkpoint cannot name; set [train] checkpoint_layout = "gathered".'
        )
    return named


def write(directory: Path, tensors: dict[str, Tensor]) -> None:
    """Every process writes its shards of ``tensors`` into ``directory`` (a collective: same keys everywhere), one
    safetensors file per process, fsynced."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


def stored(directory: Path) -> Stored:
    """Every key of a shards folder with its full shape and dtype (read from the safetensors headers)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    return {key: (m.size, m.properties.dtype) for key, m in meta.items()}


Stored = dict[str, tuple[torch.Size, torch.dtype]]  # what ``stored`` returns: read once per checkpoint read


def read(directory: Path, targets: dict[str, Tensor], meta: Stored) -> None:
    """Load ``targets``' keys from ``directory`` (whose ``stored`` keys are ``meta``) into them, in place, resharded
    to their layout: DTensors (a sharded run: a collective) read the slices their shards cover; plain tensors read
    whole, without a process group."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    missing = sorted(set(targets) - set(meta))
    if missing:
        raise UserError(f"its shards lack {missing[:4]} (written by another model or optimizer)")
    sharded = any(is_sharded(t) for t in targets.values())
    with torch.no_grad(), warnings.catch_warnings():
        # DCP warns that it loads "in a single process" whenever no process group runs: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not sharded)


def empty(meta: Stored, keys: list[str], mesh: Any | None) -> dict[str, Tensor]:
    """Tensors to read ``keys`` (of ``meta``, a shards folder's ``stored``) into: on the host, whole (``mesh``
    None), or sharded on dim 0 over ``mesh`` as FSDP2 shards every parameter-shaped state (moments, EMA, old
    policy)."""
    if mesh is None:
        return {k: torch.zeros(meta[k][0], dtype=meta[k][1], device="cpu") for k in keys}
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import zeros as sharded_zeros

    return {k: sharded_zeros(meta[k][0], dtype=meta[k][1], device_mesh=mesh, placements=[Shard(0)]) for k in keys}


def write_layout(model: dict[str, str], ema: dict[str, str] | None, processes: int) -> bytes:
    """``layout.json``'s bytes: which key holds each trained parameter (by name) and each EMA entry."""
    return json.dumps({"layout": "sharded", "processes": processes, "model": model, "ema": ema}, indent=2).encode()


def read_layout(path: Path) -> dict | None:
    """A checkpoint's ``layout.json`` (None for an unsharded checkpoint), checked for the keys tpflow writes."""
    file = Path(path) / LAYOUT
    if not file.is_file():
        return None
    layout = json.loads(file.read_text())
    if not isinstance(layout, dict) or not isinstance(layout.get("model"), dict):
        raise UserError(f"its {LAYOUT} is not one tpflow wrote (no 'model' mapping)")
    return layout


def load_weights(backbone: Any, path: Path, layout: dict) -> None:
    """A sharded checkpoint's trained weights into ``backbone``, in place (its layout: sharded or whole)."""
    meta = stored(Path(path) / SHARDS)
    named = matching(backbone, layout, meta)
    read(Path(path) / SHARDS, {layout["model"][name]: p for name, p in named.items()}, meta)


def matching(backbone: Any, layout: dict, meta: Stored) -> dict[str, Tensor]:
    """``trained_named(backbone)``, refused unless its names and shapes are the checkpoint's (``meta``: its shards'
    ``stored``)."""
    named = trained_named(backbone)
    unknown = sorted(set(layout["model"]) ^ set(named))
    unknown = unknown or [
        f"{name}: {list(meta[key][0])} there, {list(named[name].shape)} here"
        for name, key in layout["model"].items()
        if key in meta and tuple(meta[key][0]) != tuple(named[name].shape)
    ]
    if unknown:
        raise UserError(
            f"its trained parameters do not match this backbone's (e.g. {unknown[:3]}): was it trained on another "
            "model, or with another LoRA rank or targets?"
        )
    return named


def full_ema(path: Path, layout: dict) -> dict[str, Tensor] | None:
    """A sharded checkpoint's EMA as whole CPU tensors keyed as ``EMA.state_dict`` keys them (None: no EMA kept)."""
    ema = layout.get("ema")
    if not ema:
        return None
    meta = stored(Path(path) / SHARDS)
    tensors = empty(meta, list(ema.values()), None)
    read(Path(path) / SHARDS, tensors, meta)
    return {name: tensors[key] for name, key in ema.items()}
