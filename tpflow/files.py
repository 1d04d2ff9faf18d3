"""Whether a file a recipe names is what it claims, read without loading it: a regular file, a safetensors file.

The components' ``check_machine`` hooks (shapes-dit's weights, the prompt files, shapes-clip's weights) and
``tpflow.preflight`` ask these questions before any weights load; each answer is one sentence for the recipe's error
paragraph, or None.
"""

from __future__ import annotations

import stat
from pathlib import Path


def regular_file_problem(path: Path, what: str) -> str | None:
    """Why ``path`` is not an existing regular file (a directory, a FIFO, a device such as /dev/zero), or None."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return f"{what} {path} was not found."
    except OSError as exc:
        return f"{what} {path} cannot be read ({exc.strerror or exc})."
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        return f"{what} {path} is {kind}; it must be a regular file."
    return None


def safetensors_problem(path: Path, what: str) -> str | None:
    """Why ``path`` is not a readable safetensors file (reads its header only), or None."""
    problem = regular_file_problem(path, what)
    if problem:
        return problem
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError for a bad header; OSError for an unreadable file
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{what} {path} is not a safetensors file ({reason})."
    return None
