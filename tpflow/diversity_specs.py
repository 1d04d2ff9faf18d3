"""The spec strings that name an image embedding for diversity: ``[eval] diversity`` and the ``diversity-shaped``
reward's ``features`` (what each names: ``tpflow.rewards.diversity_features``), checked before anything loads."""

from __future__ import annotations

DIVERSITY_SPECS = (
    '"shapes-clip", "shapes-clip:<weights>", "clip:<arch>", "clip:<arch>:<pretrained>", "timm:<model>", '
    '"timm:<model>:<file>" or "pixels"'
)


def diversity_problem(spec: str) -> str | None:
    """Why ``spec`` names no embedding of ``eval.diversity`` (tpflow.train.diversity), or None; read here, before
    anything loads."""
    kind, _, rest = spec.partition(":")
    named = kind in ("clip", "timm") and rest.split(":", 1)[0]  # an architecture or model name
    if (kind == "pixels" and not rest) or kind == "shapes-clip" or named:
        return None
    return f"eval.diversity = {spec!r} names no embedding: use {DIVERSITY_SPECS}."
