"""Where each weight a component loads comes from, found on disk without loading it and without the network.

A component that loads weights (a backbone, a reward) may have a ``weight_sources(options, settings)`` hook, next to
``check_machine``: it returns one ``WeightSource`` per weight, saying where it will be read from (a local path, an
entry of the Hugging Face cache, a file shipped with tpflow) or, in ``problem``, why it cannot be (with the download
command). ``tpflow.preflight.check_machine`` runs the hooks: ``tpflow validate`` prints the sources, train, eval,
sample and inspect-trajectory print them when they start, and a missing weight is part of the one exit-2 paragraph,
before any weight loads.

Hub ids are looked up in the cache only (``huggingface_hub.try_to_load_from_cache``), never on the network, with or
without ``HF_HUB_OFFLINE``, and the loaders load the folder found here (``WeightSource.path``, a cache snapshot for a
hub id), not the hub id: huggingface_hub 1.x contacts the Hub from ``hf_hub_download`` even with
``local_files_only=True`` (its user-agent detection fetches a registry), a loader given a folder never calls it.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Files a transformers model folder needs besides config.json: one of these holds its weights.
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class WeightSource:
    """One weight of a component: where it comes from, or why it cannot be found."""

    what: str  # what it is and which option names it, e.g. "PickScore model (option model)"
    name: str  # as the recipe gives it: a hub id, a path, an open_clip tag
    where: str | None  # e.g. "Hugging Face cache /root/.cache/huggingface/hub/models--x--y/snapshots/abc"
    problem: str | None = None  # why it is missing and how to get it (sentences); None when found
    path: str | None = None  # the local folder or file to load from (a cache snapshot for a hub id), when found


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the loaders will read it: HF_HUB_CACHE, else HF_HOME/hub, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def download_command(repo_id: str) -> str:
    """The shell command that fetches ``repo_id`` into the cache, with the CLI the installed huggingface_hub has
    (``hf`` since 0.34; ``huggingface-cli`` before, removed in 1.0)."""
    cli = "hf" if "hf" in hub_console_scripts() else "huggingface-cli"
    return f"`{cli} download {repo_id}`"


def login_command() -> str:
    """The shell command that logs in to the Hub (gated models), with the installed huggingface_hub's CLI."""
    return "`hf auth login`" if "hf" in hub_console_scripts() else "`huggingface-cli login`"


def hub_console_scripts() -> set[str]:
    """The commands the installed huggingface_hub provides, read from its metadata: importing huggingface_hub.cli
    would contact the Hub (its agent detection fetches a registry)."""
    try:
        scripts = importlib.metadata.distribution("huggingface_hub").entry_points
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {ep.name for ep in scripts if ep.group == "console_scripts"}


def is_local_name(name: str) -> bool:
    """Whether ``name`` means a path on disk rather than a hub id ("org/name")."""
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") != 1


def cached_file(repo_id: str, filename: str) -> str | None:
    """The path of ``filename`` of ``repo_id`` in the hub cache (its newest cached revision of main), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir())
    except ValueError:  # not a valid repo id (HFValidationError)
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def hub_checkpoint(given: str | None, repo_id: str, filename: str, where: str, what: str) -> Path:
    """A reward's single checkpoint file: ``given`` (a local path) when set, else ``filename`` of ``repo_id`` in the
    Hugging Face cache; a ``UserError`` saying how to get it otherwise (nothing is downloaded). ``where`` names the
    reward and its options for the message, ``what`` the checkpoint ("the HPS checkpoint")."""
    from tpflow.errors import UserError

    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise UserError(
                f"{where}: {what} {path} does not exist. Download {filename} from the Hugging Face repo {repo_id} "
                f"({download_command(repo_id)}) and set checkpoint to it."
            )
        return path
    found = cached_file(repo_id, filename)
    if found is None:
        raise UserError(
            f"{where}: {filename} of {repo_id} is not in the Hugging Face cache, and tpflow never downloads weights. "
            f"Fetch it with {download_command(repo_id)} (on a machine with network, then copy the cache), or set "
            "checkpoint to the file."
        )
    return Path(found)


def model_folder(
    what: str, name: str, needs: Sequence[Sequence[str]], how: str, kind: str = "model folder"
) -> WeightSource:
    """A transformers folder: a local folder, or a hub id in the cache, holding one file of each group of ``needs``.

    Args:
        what: names the weight and its option, e.g. "reward 'pickscore' model (option model)".
        name: the option's value.
        needs: groups of alternatives, e.g. ``[("config.json",), MODEL_FILES]``.
        how: the sentence's ending that says what else the option may be, e.g. "set the option to a local folder
            written by save_pretrained".
        kind: what a local folder is, in the message.
    """
    local = Path(name).expanduser()
    if is_local_name(name):
        if not local.is_dir():
            return WeightSource(what, name, None, f"{what}: the {kind} {local} does not exist; {how}.")
        missing = [" or ".join(group) for group in needs if not any((local / f).is_file() for f in group)]
        if missing:
            return WeightSource(what, name, None, f"{what}: the {kind} {local} lacks {', '.join(missing)}; {how}.")
        return WeightSource(what, name, f"local folder {local}", path=str(local))
    found: list[str] = []
    missing = []
    for group in needs:
        path = next((p for p in (cached_file(name, f) for f in group) if p), None)
        if path is None:
            missing.append(" or ".join(group))
        else:
            found.append(path)
    if missing:
        held = "is not in" if not found else f"lacks {', '.join(missing)} in"
        return WeightSource(
            what,
            name,
            None,
            f"{what}: {name!r} {held} the Hugging Face cache ({hub_cache_dir()}), and tpflow never downloads "
            f"weights. Fetch it with {download_command(name)} (on a machine with network, then copy the cache), or "
            f"{how}.",
        )
    snapshot = Path(found[0]).parent
    return WeightSource(what, name, f"Hugging Face cache {snapshot}", path=str(snapshot))


def file_source(what: str, path: str | None, how: str) -> WeightSource:
    """A weight read from one local file; ``how`` says where to get it when it is not there."""
    if path is None:
        return WeightSource(what, "(unset)", None, f"{what} is not set; {how}.")
    file = Path(path).expanduser()
    if not file.is_file():
        state = "is not a file" if file.exists() else "does not exist"
        return WeightSource(what, path, None, f"{what}: {file} {state}; {how}.")
    return WeightSource(what, path, f"local file {file}", path=str(file))


def component_weights(factory: object, options: object, settings: dict) -> list[WeightSource]:
    """The component's ``weight_sources(options, settings)``, or [] when it has no hook: what the composite rewards
    (``weighted``, ``frames``, ``pairwise``) ask of their parts, and ``tpflow.preflight`` of every component."""
    hook = getattr(factory, "weight_sources", None)
    if not callable(hook):
        return []
    from tpflow.errors import UserError

    try:
        return list(hook(options, settings))
    except UserError as exc:  # an option that names no weight at all (an unknown open_clip architecture)
        return [WeightSource("weights", "", None, str(exc))]
