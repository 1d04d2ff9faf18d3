"""Decoding and scoring in a background worker, so the reward of batch b runs while batch b+1 is sampled.

One job turns a rollout batch's final latents [n, ...] and completion latents [n, W, ...] into its reward trace
[n, W+1]: decode in chunks, call the reward model, retry once if it raises or returns non-finite scores, then give
up with a clear message (the trainer stops; the last checkpoint stays intact).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tpflow.devices import current_cuda_device
from tpflow.errors import RewardError, UserError
from tpflow.interfaces import RewardModel


@dataclass
class ScoredBatch:
    """What one scoring job returns."""

    trace: Tensor  # [n, W+1] float32; columns 0..W-1 are NaN when no completions were scored
    details: dict[str, Tensor] = field(default_factory=dict)  # name -> [n] of the final images
    decode_s: float = 0.0
    reward_s: float = 0.0
    images: Tensor | None = None  # [n, W+1, 3, H, W] float32 on the CPU (completions j, then the final), if kept


def _use_cuda_device(index: int | None) -> None:
    if index is not None:
        torch.cuda.set_device(index)


class ScoringWorker:
    """A single background thread that decodes and scores rollout batches in submission order."""

    def __init__(self, decode: Callable[[Tensor], Tensor], reward: RewardModel, chunk: int = 256):
        self.decode = decode
        self.reward = reward
        self.chunk = chunk
        # A new thread's current CUDA device is 0: on process r of a multi-GPU run the worker would load a lazily
        # built reward model (device "auto") onto GPU 0. It inherits its creator's device instead.
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tpflow-scoring",
            initializer=_use_cuda_device,
            initargs=(current_cuda_device(),),
        )

    def submit(
        self,
        final: Tensor,
        completions: Tensor | None,
        prompts: Sequence[str],
        metadata: Sequence[dict[str, Any]],
        window: int,
    ) -> Future[ScoredBatch]:
        """Queue one rollout batch: final [n, ...], completions [n, W, ...] or None, W = ``window``."""
        return self._pool.submit(self._score, final, completions, list(prompts), list(metadata), window)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _score(self, final, completions, prompts, metadata, window) -> ScoredBatch:
        return score_rollout(self.decode, self.reward, final, completions, prompts, metadata, window, self.chunk)


def score_rollout(
    decode: Callable[[Tensor], Tensor],
    reward: RewardModel,
    final: Tensor,
    completions: Tensor | None,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    window: int,
    chunk: int = 256,
    keep_images: bool = False,
) -> ScoredBatch:
    """Decode and score one rollout batch: the reward trace [n, W+1] of final [n, ...] and completions [n, W, ...].

    The one scoring path of tpflow: training (through ``ScoringWorker``) and ``inspect-trajectory`` both call it,
    so both decode in chunks of ``chunk`` rows, retry a failing reward once and refuse non-finite scores alike.
    ``keep_images`` returns the decoded images too (``ScoredBatch.images``), which inspect plots.
    """
    n = final.shape[0]
    latents = final if completions is None else torch.cat([completions.flatten(0, 1), final])  # [n·W + n, ...]
    width = 0 if completions is None else completions.shape[1]
    # Completion rows are trajectory-major (b·W + j); the final images come last.
    rows_prompts = [p for p in prompts for _ in range(width)] + list(prompts)
    rows_meta = [m for m in metadata for _ in range(width)] + list(metadata)
    start = time.perf_counter()
    with torch.no_grad():
        images = torch.cat([decode(part) for part in latents.split(chunk)])  # [n·W + n, 3, H, W]
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    scores, details = _reward(reward, images, rows_prompts, rows_meta, chunk)
    reward_s = time.perf_counter() - start
    trace = torch.full((n, window + 1), float("nan"), device="cpu")  # host bookkeeping (tpflow.devices)
    if width:
        trace[:, :width] = scores[: n * width].view(n, width)
    trace[:, window] = scores[n * width :]
    final_details = {k: v[n * width :] for k, v in details.items()}
    kept = None
    if keep_images:
        host = images.detach().float().cpu()
        kept = torch.cat([host[: n * width].view(n, width, *host.shape[1:]), host[n * width :, None]], dim=1)
    return ScoredBatch(trace, final_details, decode_s, reward_s, kept)  # [n, W+1, 3, H, W] or None


def _reward(
    reward: RewardModel, images: Tensor, prompts: list[str], metadata: list[dict], chunk: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores [M] and details of M images, in chunks; one retry when the reward raises or returns non-finite."""
    name = type(reward).__name__
    problem = ""
    for _attempt in range(2):
        try:
            parts = [
                reward(images[lo : lo + chunk], prompts[lo : lo + chunk], metadata[lo : lo + chunk])
                for lo in range(0, images.shape[0], chunk)
            ]
        except UserError:
            raise
        except Exception as exc:  # a flaky reward server or model: retry once
            problem = f"it raised {type(exc).__name__}: {exc}"
            continue
        scores = torch.cat([p.scores.detach().float().cpu() for p in parts])
        if scores.shape != (images.shape[0],):
            raise RewardError(f"Reward {name!r} returned {tuple(scores.shape)} scores for {images.shape[0]} images.")
        if torch.isfinite(scores).all():
            details = {k: torch.cat([p.details[k].detach().float().cpu() for p in parts]) for k in parts[0].details}
            return scores, details
        problem = f"it returned {int((~torch.isfinite(scores)).sum())} non-finite scores"
    raise RewardError(
        f"Reward {name!r} failed twice on the same {images.shape[0]} images ({problem}). The run stops here; "
        "the last checkpoint is intact: fix the reward and resume with --resume."
    )
