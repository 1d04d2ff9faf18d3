"""Booleans where a recipe means a number: refused before pydantic, which would read them as 1 and 0.

pydantic's lax mode turns ``true`` into 1 (an int field) or 1.0 (a float field), so ``epochs = true`` or
``--set rollout.noise_level=true`` validated and trained something nobody asked for. Strict mode would refuse
them, but also the TOML arrays given for tuple fields (``window_range = [0, 9]``), so tpflow keeps lax mode and
refuses a boolean wherever the field's type does not admit one: a plain ``bool`` field, ``Any``, or a ``Literal``
with a boolean in it. It walks nested option models, lists and tuples, so it covers every component's options,
plugins' included, without each model declaring strict types.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel


def boolean_problems(data: dict[str, Any], model: type[BaseModel], where: str) -> list[str]:
    """One sentence per boolean in ``data`` (a recipe table) whose field in ``model`` expects no boolean."""
    problems = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:  # unknown options are the options model's own error (extra="forbid")
            continue
        found = _misplaced_boolean(value, field.annotation, key)
        if found is not None:
            path, flag, annotation = found
            problems.append(
                f"{where}: {path} = {str(flag).lower()} is a boolean, but the option takes {_expected(annotation)} "
                f"(pydantic would silently have read it as {int(flag)}); write the value itself."
            )
    return problems


Found = tuple[str, bool, Any]  # (path, the boolean, the type it stands where)


def _misplaced_boolean(value: Any, annotation: Any, path: str) -> Found | None:
    """The first boolean inside ``value`` that ``annotation`` does not admit, or None."""
    annotation = _strip(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        found = [_misplaced_boolean(value, arm, path) for arm in typing.get_args(annotation)]
        return None if None in found else found[0]  # some arm takes the value as it is
    if isinstance(value, bool):
        return None if _admits_bool(annotation) else (path, value, annotation)
    if isinstance(value, list):
        return _in_sequence(value, annotation, origin, path)
    if isinstance(value, dict):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return _in_model(value, annotation, path)
        if origin is dict and len(typing.get_args(annotation)) == 2:
            item = typing.get_args(annotation)[1]
            return next((p for k, v in value.items() if (p := _misplaced_boolean(v, item, f"{path}.{k}"))), None)
    return None


def _in_sequence(value: list, annotation: Any, origin: Any, path: str) -> Found | None:
    args = typing.get_args(annotation)
    if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[int, int]: one type per position
        items = list(zip(value, args, strict=False))
    elif origin in (list, tuple, set, frozenset) or str(origin) in ("collections.abc.Sequence",):
        items = [(v, args[0] if args else Any) for v in value]
    else:
        return None
    return next((p for i, (v, a) in enumerate(items) if (p := _misplaced_boolean(v, a, f"{path}[{i}]"))), None)


def _in_model(value: dict, model: type[BaseModel], path: str) -> Found | None:
    for key, item in value.items():
        field = model.model_fields.get(key)
        if field is not None and (found := _misplaced_boolean(item, field.annotation, f"{path}.{key}")):
            return found
    return None


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _admits_bool(annotation: Any) -> bool:
    annotation = _strip(annotation)
    if annotation in (bool, Any, object):
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return False


def _expected(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string"}
    annotation = _strip(annotation)
    if annotation in names:
        return names[annotation]
    return f"a value of type {getattr(annotation, '__name__', None) or str(annotation).replace('typing.', '')}"
