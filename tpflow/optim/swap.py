"""Swap other values into parameters for the length of a block, and put the live values back exactly.

Used by the EMA (its shadow for evaluation and export) and by DiffusionNFT (its old policy for sampling and for the
v_old pass). A swap writes the parameters in place: it must not happen inside an autocast region that caches casts
(``tpflow.precision``: tpflow's regions never cache), nor while a graph that saved the parameters is still to be
back-propagated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


@contextmanager
def swapped(params: Sequence[torch.nn.Parameter], values: Sequence[Tensor]) -> Iterator[None]:
    """Inside the block each of ``params`` holds the matching tensor of ``values`` (cast to its dtype); on exit,
    normal or not, the parameters hold their own values again, bit for bit."""
    if len(params) != len(values):
        raise ValueError(f"{len(values)} values for {len(params)} parameters.")
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for param, value in zip(params, values, strict=True):
            param.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for param, saved in zip(params, backup, strict=True):
                param.copy_(saved)
