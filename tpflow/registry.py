"""Name registries for the components, with plugin discovery by entry point.

Every component is registered under a short name with a pydantic options model::

    class CpsOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")

    @register("sampler", "cps", options=CpsOptions)
    class CpsSampler:
        def __init__(self, options: CpsOptions): ...

``tpflow.build("sampler", "cps", **options)`` validates the options against that model and calls the factory with
the validated model instance. Third-party packages add components through the entry-point group ``tpflow.<kind>``
(``tpflow.rewards`` is accepted as an alias of ``tpflow.reward``): the entry point's name is the component name and
its value the object, e.g. ``my-reward = "my_pkg.reward:MyReward"``. The object may register itself with
``@register`` when its module is imported; otherwise it is registered under the entry point's name with its
``Options`` attribute as options model (no options when absent). Plugins are discovered lazily, on the first lookup.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tpflow.errors import DuplicateComponentError, UnknownComponentError, UserError

KINDS: tuple[str, ...] = ("backbone", "sampler", "plan", "reward", "credit", "optimizer", "dataset")

# Modules whose import registers the built-in components of each kind.
_BUILTIN_MODULES: dict[str, tuple[str, ...]] = {
    "backbone": ("tpflow.backbones",),
    "sampler": ("tpflow.samplers",),
    "plan": ("tpflow.plans",),
    "reward": ("tpflow.rewards", "tpflow.serving.client"),
    "credit": ("tpflow.credit",),
    "optimizer": ("tpflow.optim",),
    "dataset": ("tpflow.data", "tpflow.shapes.prompts", "tpflow.shapes.video_world", "tpflow.shapes.edit_world"),
}

_KIND_WORDS = {
    "backbone": "backbone",
    "sampler": "sampler",
    "plan": "rollout plan",
    "reward": "reward model",
    "credit": "credit assigner",
    "optimizer": "optimizer",
    "dataset": "prompt dataset",
}


class NoOptions(BaseModel):
    """Options model of a component that takes none."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Entry:
    """One registered component."""

    kind: str
    name: str
    factory: Callable[[BaseModel], Any]  # called with the validated options model
    options: type[BaseModel]
    origin: str  # "file.py:line" of the definition
    source: str  # "tpflow" for built-ins, "plugin <distribution> <version>" for entry points
    qualname: str  # module:qualname, to recognise a re-registration of the same object


T = TypeVar("T")

_lock = threading.RLock()
_entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
_builtins_loaded: set[str] = set()
_builtins_loading: set[str] = set()  # kinds whose built-in modules are being imported (by the thread holding _lock)
_plugins_loaded: set[str] = set()
_plugin_errors: dict[str, list[str]] = {kind: [] for kind in KINDS}
_current_source: str = "tpflow"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"Unknown component kind {kind!r}. Kinds are: {', '.join(KINDS)}.")


def _origin(obj: Any) -> str:
    try:
        file = inspect.getsourcefile(obj) or "?"
        line = inspect.getsourcelines(obj)[1]
        return f"{file}:{line}"
    except (OSError, TypeError):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _add(kind: str, name: str, obj: Any, options: type[BaseModel] | None) -> None:
    qualname = _qualname(obj)
    if options is not None and options.model_config.get("extra") != "forbid":
        raise TypeError(
            f"Options model {options.__name__} of {kind} {name!r} must set model_config = ConfigDict(extra='forbid') "
            "so that misspelt options fail."
        )
    entry = Entry(kind, name, obj, options or NoOptions, _origin(obj), _current_source, qualname)
    with _lock:
        first = _entries[kind].get(name)
        if first is not None and first.qualname != qualname:
            raise DuplicateComponentError(
                f"The {_KIND_WORDS[kind]} name {name!r} is registered twice: first by {first.qualname} "
                f"({first.origin}, {first.source}), again by {qualname} ({entry.origin}, {entry.source}). "
                "Rename one of them."
            )
        _entries[kind][name] = entry  # a re-import of the same definition replaces it


def register(kind: str, name: str, options: type[BaseModel] | None = None) -> Callable[[T], T]:
    """Class or function decorator that registers a component factory under ``(kind, name)``.

    Args:
        kind: one of ``KINDS``.
        name: the short name recipes use, e.g. ``"cps"``.
        options: pydantic model of the component's options (``extra="forbid"``); the factory receives an instance.
    """
    _check_kind(kind)

    def decorator(obj: T) -> T:
        _add(kind, name, obj, options)
        return obj

    return decorator


def _load_builtins(kind: str) -> None:
    """Import the modules of the kind's built-in components. One that fails to import (a broken install, a bug) is
    not a user's mistake: its error propagates with its traceback, at this and every later lookup of the kind (the
    import is retried), never an 'unknown component' for what it would have registered."""
    if kind in _builtins_loaded:
        return
    with _lock:
        if kind in _builtins_loaded or kind in _builtins_loading:  # another thread did; or a lookup during the import
            return
        _builtins_loading.add(kind)
        try:
            for module in _BUILTIN_MODULES[kind]:
                try:
                    importlib.import_module(module)
                except Exception as exc:
                    exc.add_note(f"tpflow: importing {module}, the module of built-in {kind} components, failed.")
                    raise
        finally:
            _builtins_loading.discard(kind)
        _builtins_loaded.add(kind)


def _entry_points(kind: str) -> list[metadata.EntryPoint]:
    return [ep for group in (f"tpflow.{kind}", f"tpflow.{kind}s") for ep in metadata.entry_points(group=group)]


def _load_plugins(kind: str) -> None:
    global _current_source
    if kind in _plugins_loaded:
        return
    with _lock:
        _plugins_loaded.add(kind)
        for ep in _entry_points(kind):
            dist = getattr(ep, "dist", None)
            source = f"plugin {dist.name} {dist.version}" if dist is not None else f"plugin {ep.value}"
            previous, _current_source = _current_source, source
            try:
                obj = ep.load()  # a module that uses @register has registered its components by now
                existing = _entries[kind].get(ep.name)
                if existing is None or existing.qualname != _qualname(obj):
                    _add(kind, ep.name, obj, getattr(obj, "Options", None))
            except DuplicateComponentError:
                _plugins_loaded.discard(kind)  # keep failing on every lookup until the clash is resolved
                raise
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # a broken plugin (even one calling sys.exit) must not take tpflow down
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if isinstance(exc, SystemExit):
                    reason = f"called sys.exit({exc.code!r}) on import"
                _plugin_errors[kind].append(f"{ep.name} = {ep.value!r} ({source}): {reason}")
            finally:
                _current_source = previous


def _ensure(kind: str) -> None:
    _check_kind(kind)
    _load_builtins(kind)
    _load_plugins(kind)


def refresh_plugins() -> None:
    """Forget discovered plugins and look for entry points again (after installing a package at run time)."""
    with _lock:
        for kind in KINDS:
            for name in [n for n, e in _entries[kind].items() if e.source != "tpflow"]:
                del _entries[kind][name]
            _plugin_errors[kind].clear()
        _plugins_loaded.clear()


def entries(kind: str) -> list[Entry]:
    """All registered components of a kind, sorted by name (built-ins and plugins)."""
    _ensure(kind)
    return [_entries[kind][n] for n in sorted(_entries[kind])]


def names(kind: str) -> list[str]:
    """Sorted names of the registered components of a kind."""
    return [e.name for e in entries(kind)]


def plugin_errors(kind: str) -> list[str]:
    """Entry points of this kind that failed to load, with the reason."""
    _ensure(kind)
    return list(_plugin_errors[kind])


def get(kind: str, name: str) -> Entry:
    """The entry for ``(kind, name)``; raises UnknownComponentError listing the available names."""
    _ensure(kind)
    entry = _entries[kind].get(name)
    if entry is not None:
        return entry
    available = sorted(_entries[kind])
    close = difflib.get_close_matches(name, available, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    broken = f" Plugins that failed to load: {'; '.join(_plugin_errors[kind])}." if _plugin_errors[kind] else ""
    raise UnknownComponentError(
        f"{name!r} is not a registered {_KIND_WORDS[kind]}.{hint} Available: {', '.join(available) or '(none)'}."
        f"{broken}"
    )


def validate_options(kind: str, name: str, options: dict[str, Any]) -> BaseModel:
    """Validate options against the component's model; pydantic's ValidationError propagates."""
    return get(kind, name).options.model_validate(options)


def build(kind: str, name: str, /, **options: Any) -> Any:
    """Build a component by kind and name: ``tpflow.build("credit", "turning_point", balanced=False)``.

    Raises:
        UnknownComponentError: no such name (the message lists the available ones).
        UserError: the options do not validate (the message names each bad field and the allowed ones).
    """
    return get(kind, name).factory(checked_options(kind, name, options))


def checked_options(kind: str, name: str, options: dict[str, Any]) -> BaseModel:
    """The component's options, validated; a UserError naming each bad field and the allowed ones otherwise."""
    entry = get(kind, name)
    try:
        return entry.options.model_validate(options)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, f"{_KIND_WORDS[kind]} {name!r}", entry.options)) from None


def preflight(kind: str, name: str, options: BaseModel) -> None:
    """Run the component's optional ``preflight(options)`` hook: a check of the outside services it needs (the
    remote reward's server), raising UserError. Unlike ``check_recipe`` it may touch the network, so it runs only
    when a run is about to start (``Recipe.preflight``), never when a recipe is merely parsed."""
    check = getattr(get(kind, name).factory, "preflight", None)
    if callable(check):
        check(options)


def describe_validation_error(exc: ValidationError, where: str, model: type[BaseModel]) -> str:
    """One paragraph for a pydantic error: every bad field, why, and the fields the model allows."""
    allowed = ", ".join(model.model_fields) or "(none)"
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(model.model_fields), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown option {field!r}{hint}")
        elif not err["loc"]:  # a check across options (a model validator): its message names the values
            problems.append(err["msg"].removeprefix("Value error, ").rstrip("."))
        else:
            hint = _list_hint(field, err.get("input"), where) if err["type"] in _SEQUENCE_ERRORS else ""
            problems.append(f"option {field!r}: {err['msg']} (got {err.get('input')!r}){hint}")
    if not any(err["type"] == "extra_forbidden" for err in exc.errors()):  # a bad value: the names are right
        return f"{where}: {'; '.join(problems)}."
    return f"{where}: {'; '.join(problems)}. Allowed options: {allowed}."


_SEQUENCE_ERRORS = ("list_type", "tuple_type", "set_type", "frozen_set_type")


def _list_hint(field: str, value: Any, where: str) -> str:
    """For a list given as a bare string (``--set log.trackers=wandb``, ``--set rollout.window_range=0,9``): the
    same value written as a TOML array, in the recipe and on the command line."""
    import json
    import re

    if not isinstance(value, str):
        return ""
    items = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        try:
            items.append(json.loads(part))  # numbers, true / false
        except ValueError:
            items.append(part)
    array = "[" + ", ".join(json.dumps(i) for i in items) + "]"
    section = re.search(r"\[(\w+)\]", where)
    where_set = f", on the command line --set '{section.group(1)}.{field}={array}'" if section else ""
    return f"; write a list in TOML's brackets: {field} = {array} in the recipe{where_set} (quoted for the shell)"
