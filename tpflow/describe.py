"""A component's options as ``tpflow components`` shows them: each option's type with its allowed values and limits,
its default and its description (the pydantic ``Field(description=...)`` every option carries).

    score: 'partial' | 'strict' = 'partial'
        Training reward: the partial-credit GenEval score (the reference's reward) or strict correctness (0/1).
"""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel

_LIMITS = {annotated_types.Ge: "≥", annotated_types.Gt: ">", annotated_types.Le: "≤", annotated_types.Lt: "<"}


def describe_options(model: type[BaseModel], indent: str = "") -> str:
    """One entry per option: ``name: type = default`` (``required`` when it has none), its limits, then its
    description indented below; the fields of a nested options model (a list of them, as ``weighted``'s rewards)
    follow indented. ``-`` for a component without options."""
    lines = []
    for name, info in model.model_fields.items():
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        limits = _limits(info.metadata)
        lines.append(f"{indent}{name}: {type_text(info.annotation)} = {default}{limits}")
        if info.description:
            lines.append(f"{indent}    {info.description}")
        nested = _nested_model(info.annotation)
        if nested is not None:
            lines.append(f"{indent}    {'each item' if typing.get_origin(info.annotation) is list else 'fields'}:")
            lines.append(describe_options(nested, indent + "      "))
    return "\n".join(lines) or "-"


def type_text(annotation: Any) -> str:
    """A type as a user writes the value: ``'partial' | 'strict'`` for a Literal, ``float | None``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _limits(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for kind, sign in _LIMITS.items():
            if isinstance(item, kind):
                parts.append(f"{sign} {getattr(item, kind.__name__.lower())}")
        if isinstance(item, annotated_types.MinLen) and item.min_length:
            parts.append(f"at least {item.min_length} item{'s' if item.min_length > 1 else ''}")
        if isinstance(item, annotated_types.MaxLen):
            parts.append(f"at most {item.max_length} items")
    return f" ({', '.join(parts)})" if parts else ""


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The options model inside ``list[Model]`` / ``Model | None`` / ``Model``, if any."""
    candidates = [annotation, *typing.get_args(annotation)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
