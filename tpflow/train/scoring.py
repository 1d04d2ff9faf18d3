"""Decoding and scoring in a background worker, so the reward of batch b runs while batch b+1 is sampled.

One job turns a rollout batch's final latents [n, ...] and completion latents [n, W, ...] into its reward trace
[n, W+1]: decode in chunks, call the reward model through ``tpflow.scoring.call.call_reward`` (output checked, a
time limit, one retry if it raises or returns non-finite scores, then a clear message: the trainer stops; the last
checkpoint stays intact). A reward that needs whole groups (a win rate among siblings) is called once per trace column
instead of in chunks: every trajectory of the batch at that column in one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from tpflow.devices import current_cuda_device
from tpflow.interfaces import RewardModel, capability
from tpflow.scoring.call import DEFAULT_POLICY, RewardPolicy, call_reward


@dataclass
class ScoredBatch:
    """What one scoring job returns."""

    trace: Tensor  # [n, W+1] float32; columns 0..W-1 are NaN when no completions were scored
    details: dict[str, Tensor] = field(default_factory=dict)  # name -> [n] of the final images
    decode_s: float = 0.0
    reward_s: float = 0.0
    images: Tensor | None = None  # [n, W+1, 3, H, W] float32 on the CPU (completions j, then the final), if kept
    part_traces: dict[str, Tensor] = field(default_factory=dict)  # detail name -> [n, W+1], as ``trace``


def _use_cuda_device(index: int | None) -> None:
    if index is not None:
        torch.cuda.set_device(index)


class ScoringWorker:
    """A single background thread that decodes and scores rollout batches in submission order."""

    def __init__(
        self,
        decode: Callable[[Tensor], Tensor],
        reward: RewardModel,
        chunk: int = 256,
        policy: RewardPolicy = DEFAULT_POLICY,
    ):
        self.decode = decode
        self.reward = reward
        self.chunk = chunk
        self.policy = policy
        self._failed: str | None = None  # the first failed batch's error type: later batches are not scored
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
        """Score one batch; after a batch has failed, the later ones are not scored (the epoch stops at the first
        failure, and a reward that failed, e.g. a server that is down, is not called again for batches queued
        meanwhile)."""
        if self._failed is not None:
            raise RuntimeError(f"not scored: an earlier rollout batch's scoring failed ({self._failed})")
        try:
            return score_rollout(
                self.decode, self.reward, final, completions, prompts, metadata, window, self.chunk, policy=self.policy
            )
        except BaseException as error:
            self._failed = type(error).__name__
            raise


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
    policy: RewardPolicy = DEFAULT_POLICY,
) -> ScoredBatch:
    """Decode and score one rollout batch: the reward trace [n, W+1] of final [n, ...] and completions [n, W, ...].

    The one scoring path of tpflow: training (through ``ScoringWorker``) and ``inspect-trajectory`` both call it,
    so both decode in chunks of ``chunk`` rows and call the reward under the same ``policy`` (its time limit and
    retries; non-finite scores always stop here: a NaN cannot be trained on). ``keep_images`` returns the decoded
    images too (``ScoredBatch.images``), which inspect plots.
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
    if capability(reward, "needs_whole_groups"):  # a group-relative reward: one call per column, groups whole
        scores, details = _reward_by_column(reward, images, rows_prompts, rows_meta, n, width, policy)
    else:
        scores, details = _reward(reward, images, rows_prompts, rows_meta, chunk, policy)
    reward_s = time.perf_counter() - start
    trace = _as_trace(scores, n, width, window)
    final_details = {k: v[n * width :] for k, v in details.items()}
    part_traces = {k: _as_trace(v, n, width, window) for k, v in details.items()}  # each detail traced alike
    kept = None
    if keep_images:
        host = images.detach().float().cpu()
        kept = torch.cat([host[: n * width].view(n, width, *host.shape[1:]), host[n * width :, None]], dim=1)
    return ScoredBatch(trace, final_details, decode_s, reward_s, kept, part_traces)  # kept: [n, W+1, 3, H, W]


def _as_trace(scores: Tensor, n: int, width: int, window: int) -> Tensor:
    """Scores [n·W' + n] (completions trajectory-major, then the finals) as a trace [n, W+1]: columns 0..W'-1 the
    completions, column W the final, NaN where nothing was scored (host bookkeeping, tpflow.devices)."""
    trace = torch.full((n, window + 1), float("nan"), device="cpu")
    if width:
        trace[:, :width] = scores[: n * width].view(n, width)
    trace[:, window] = scores[n * width :]
    return trace


def _reward_by_column(
    reward: RewardModel,
    images: Tensor,
    prompts: list[str],
    metadata: list[dict],
    n: int,
    width: int,
    policy: RewardPolicy,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores [n·W' + n] and details of a reward that needs whole groups (``tpflow.scoring.groups``): one call per
    trace column j holding the n trajectories' images at j, so a group-relative reward compares each image with its
    siblings at the same column and no chunk cuts a group. The rows come back in ``images``' order (completions
    trajectory-major b·W' + j, then the finals)."""
    grid = torch.arange(n * width, device="cpu").view(n, width)  # [n, W'] row of trajectory b's completion j
    columns = [grid[:, j] for j in range(width)] + [torch.arange(n * width, n * width + n, device="cpu")]
    calls = []
    for rows in columns:  # [n] rows of one column
        picked = rows.tolist()
        texts, meta = [prompts[k] for k in picked], [metadata[k] for k in picked]
        calls.append(_reward(reward, images[rows.to(images.device)], texts, meta, n, policy))
    order = torch.cat(columns)  # [n·W' + n] column-major: the rows of each call, call after call
    scores = torch.cat([c[0] for c in calls])  # [n·W' + n] in call order
    details = {k: torch.cat([c[1][k] for c in calls]) for k in calls[0][1]}
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device="cpu")  # call position of each row
    return scores[back], {k: v[back] for k, v in details.items()}


def _reward(
    reward: RewardModel, images: Tensor, prompts: list[str], metadata: list[dict], chunk: int, policy: RewardPolicy
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores [M] and details of M images, in chunks, each checked and retried by ``call_reward``."""
    policy = replace(policy, nonfinite="stop")  # the trace feeds the advantages: a NaN would poison the update
    parts = [
        call_reward(reward, images[lo : lo + chunk], prompts[lo : lo + chunk], metadata[lo : lo + chunk], policy)
        for lo in range(0, images.shape[0], chunk)
    ]
    scores = torch.cat([p.scores for p in parts]) if parts else torch.zeros(0, device="cpu")  # [M] float32, host
    details = {k: torch.cat([p.details[k] for p in parts]) for k in parts[0].details} if parts else {}
    return scores, details
