"""The reward a composite reward wraps (``weighted``'s parts, ``frames``', ``pairwise``'s judge,
``diversity-shaped``'s), checked when the composite's options are: a registered name and options valid for it.

One rule for all four, so that an error names where the part sits (``reward 'weighted', rewards[1] ('ocr')``), also
from inside a nested composite, in one paragraph before anything loads.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tpflow import registry
from tpflow.errors import UnknownComponentError, UserError


def checked_inner(name: str, options: dict[str, Any], where: str) -> registry.Entry:
    """The registry entry of reward ``name`` once ``options`` validate for it; an ``UnknownComponentError`` or a
    ``UserError`` prefixed with ``where`` otherwise."""
    try:
        entry = registry.get("reward", name)
    except UnknownComponentError as exc:
        raise UnknownComponentError(f"{where}: {exc}") from None
    try:
        entry.options.model_validate(options)
    except ValidationError as exc:
        raise UserError(registry.describe_validation_error(exc, where, entry.options)) from None
    except UserError as exc:  # from a nested composite reward: say where it sits
        raise type(exc)(f"{where}: {exc}") from None
    return entry
