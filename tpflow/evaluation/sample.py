"""``tpflow sample``: a few images of a trained run or adapter for a quick look, each with its prompt under it.

One row per prompt, ``n`` images per row, ODE-sampled like ``tpflow eval`` with the recipe's ``[eval] solver``
(image j of prompt i starts from row i·n + j of one seeded noise draw). The grid is ``tpflow.grids.captioned_grid``,
as every grid tpflow writes. A prompt is an item: an editing prompt carries its source images in its metadata
(``--image``), which ``tpflow.sources.encode_rows`` hands to an editing backbone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from tpflow.devices import cpu_generator
from tpflow.evaluation.targets import Target, load_model
from tpflow.rollout import eval_solver, sample_ode
from tpflow.sources import encode_rows
from tpflow.types import PromptItem


@torch.no_grad()
def sample_images(
    target: Target,
    prompts: Sequence[str | PromptItem],
    n: int,
    steps: int,
    guidance: float,
    seed: int,
    autocast: Callable[[], AbstractContextManager],
    ema: bool = True,
    batch_size: int = 16,
) -> torch.Tensor:
    """[len(prompts)·n, 3, H, W] images in [0, 1], prompt-major (a video backbone's clips [.., F, 3, H, W]); a
    prompt is its text or an item (an editing prompt's sources in its metadata)."""
    torch.manual_seed(target.recipe.train.seed)
    backbone = load_model(target, ema=ema)
    items = [p if isinstance(p, PromptItem) else PromptItem(p, {}) for p in prompts]
    rows = [item for item in items for _ in range(n)]
    z0 = backbone.initial_noise(len(rows), cpu_generator(seed))
    images = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        cond = encode_rows(backbone, part)  # an editing prompt's sources too
        with autocast():
            latents = sample_ode(backbone, cond, z0[start : start + len(part)], backbone.sigmas(steps), guidance,
                                 batch_size, eval_solver(target.recipe.eval))  # fmt: skip
        images.append(backbone.decode(latents).float().cpu())
    return torch.cat(images)
