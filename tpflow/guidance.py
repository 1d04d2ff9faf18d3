"""Classifier-free guidance: the one combination every CFG backbone applies, and which branch the update trains.

A backbone with a CFG branch (SD3, Qwen-Image, shapes-dit) computes v_u and v_c in one batched call and returns
v = v_u + w·(v_c − v_u) (:func:`combine`). The policy's log-probability is that of the guided velocity, so the exact
gradient flows through both branches: ∂v/∂v_c = w, ∂v/∂v_u = 1 − w (``cfg_gradient = "both"``, what Flow-GRPO's,
TempFlow-GRPO's, GRPO-Guard's, DanceGRPO's, Flow-Factory's and TP-GRPO's public code do today). flow_grpo's SD3
trainers detached v_u from July to August 2025 (commits 2d76907 to a482878, "fix cfg gradient detach"), training the
conditional branch alone (∂v/∂v_u = 0): ``cfg_gradient = "conditional"`` reproduces that estimator
(docs/algorithm.md §6.2). Inside :func:`conditional_only` the combination treats v_u as a constant; the forward
values are bit for bit those of "both", so the on-policy ratio stays exactly 1.

A context, not an argument of ``Backbone.velocity``, so that the protocol's signature (and every plugin backbone)
stays as it is; a backbone that does not call :func:`combine` has no CFG branch to detach (:func:`was_combined`
lets the update check that it was asked for something that happened).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from torch import Tensor

_CONDITIONAL_ONLY: ContextVar[bool] = ContextVar("tpflow_cfg_conditional_only", default=False)
_COMBINED: ContextVar[list[int] | None] = ContextVar("tpflow_cfg_combined", default=None)


@contextlib.contextmanager
def conditional_only(enabled: bool = True) -> Iterator[list[int]]:
    """Within the block, :func:`combine` passes no gradient to the unconditional branch (``enabled``; False: a
    no-op). Yields a one-element list counting the combinations made inside, for :func:`was_combined`."""
    count = [0]
    flag, seen = _CONDITIONAL_ONLY.set(enabled), _COMBINED.set(count)
    try:
        yield count
    finally:
        _CONDITIONAL_ONLY.reset(flag)
        _COMBINED.reset(seen)


def unconditional(v_uncond: Tensor) -> Tensor:
    """v_u as the guided velocity should see it: detached inside :func:`conditional_only`, else itself. For a
    backbone whose guidance is more than :func:`combine` (Qwen-Image's norm rescale): use it for every v_u."""
    counter = _COMBINED.get()
    if counter is not None:
        counter[0] += 1
    return v_uncond.detach() if _CONDITIONAL_ONLY.get() else v_uncond


def combine(v_uncond: Tensor, v_cond: Tensor, guidance: float) -> Tensor:
    """v = v_u + w·(v_c − v_u) ([N, ...] each), with v_u a constant inside :func:`conditional_only`."""
    v_uncond = unconditional(v_uncond)
    return v_uncond + guidance * (v_cond - v_uncond)
