"""Rows replayed from earlier epochs in the GRPO update: their sequence-level importance weight and their late steps
dropped (OP-GRPO, arXiv 2604.04142; docs/algorithm.md §10.12).

A replayed row (``Rollout.replayed``, put there by ``tpflow.train.replay``) was sampled by an older policy μ and
stores μ's log-probabilities ℓ_μ. The clipped ratio of its loss is taken against the policy the update starts from,
θ_old, as it is for the epoch's fresh rows: a ratio θ/μ would sit far outside GRPO's trust region 1 ± ε (ε = 1e-5
in the published runs) and every replayed row would be clipped flat. The shift μ → θ_old is corrected by one
detached weight per trajectory instead, over the steps K the row keeps (those it trains: stored as trained, with
σ_i ≥ ``replay_min_sigma`` and σ_{i+1} > 0):

    Δ_i = ℓ_θold,i − ℓ_μ,i                                          (i ∈ K)
    w = min(exp(mean_K Δ_i), w_max)   'geometric'      w = min(exp(Σ_K Δ_i), w_max)   'product'
    Â'_i = w · Â_i,     ℓ_old,i := ℓ_θold,i

so the row's loss at step i is w · max(−Â_i κ_i, −Â_i clip(κ_i, 1 − ε, 1 + ε)) with κ_i = exp(ℓ_θ,i − ℓ_θold,i)
(w ≥ 0 passes through the max). ℓ_θold is recomputed once per update, without gradient, at each kept step of each
replayed row (one velocity call per step and ``micro_batch_size`` rows). A row that keeps no step weighs 0 and is
not trained. Each ℓ is tpflow's mean over the latent's elements (``StepOutput.log_prob``), so 'product' sums per-step
means; 'geometric' (the default) is their mean, a weight whose size does not grow with the window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Backbone, Sampler
from tpflow.types import Rollout


def sequence_weights(old: Tensor, behaviour: Tensor, kept: Tensor, kind: str, ceiling: float) -> Tensor:
    """[k] the weight w of each replayed row (module docstring) from ℓ_θold [k, W], ℓ_μ [k, W] and the kept steps
    [k, W] bool, in the dtype of ``old`` (float64 in the tests); 0 for a row that keeps no step."""
    delta = torch.where(kept, old - behaviour, torch.zeros_like(old))  # [k, W] Δ_i on the kept steps, else 0
    count = kept.sum(1)  # [k]
    log_weight = delta.sum(1) if kind == "product" else delta.sum(1) / count.clamp(min=1).to(old.dtype)
    weight = torch.exp(log_weight).clamp(max=ceiling)  # an overflow to inf is clipped to the ceiling too
    return torch.where(count > 0, weight, torch.zeros_like(weight))


def kept_steps(sigmas: Tensor, trained: Tensor, min_sigma: float) -> Tensor:
    """[k, W] bool host: the steps a replayed row keeps, from its σ [k, W + 1] and stored trained steps [k, W]."""
    return trained & (sigmas[:, :-1] >= min_sigma) & (sigmas[:, 1:] > 0)


def corrected(
    options: Any, precision: Any, backbone: Backbone, sampler: Sampler, batch: Rollout, advantages: Tensor
) -> tuple[Rollout, Tensor, dict[str, float]]:
    """The batch and advantages [N, W] the update trains on, its replayed rows corrected (module docstring), and the
    correction's metrics; a batch without replayed rows comes back as it is (the same objects). Advantages of another
    shape than the batch's [N, W] are a ValueError. ``options``: the
    ``grpo`` optimizer's (``replay_weight``, ``replay_weight_max``, ``replay_min_sigma``, ``micro_batch_size``)."""
    n, width = batch.log_probs.shape
    if advantages.shape != (n, width):
        raise ValueError(f"advantages must be [N, W] = [{n}, {width}], got {tuple(advantages.shape)}.")
    if batch.replayed is None or not bool(batch.replayed.any()):
        return batch, advantages, {}
    o = options
    rows = batch.replayed.cpu().nonzero().squeeze(1)  # [k] host
    device_rows = to_device(rows, batch.device)
    sigmas = batch.sigmas.cpu()  # [N, W + 1] host
    everything = torch.ones(batch.log_probs.shape, dtype=torch.bool, device="cpu")  # a batch without a mask
    stored = batch.trained.cpu() if batch.trained is not None else everything  # [N, W] host
    kept = kept_steps(sigmas[rows], stored[rows], o.replay_min_sigma)  # [k, W] host
    behaviour = batch.log_probs[device_rows]  # [k, W] ℓ_μ
    old = _start_log_probs(o.micro_batch_size, precision, backbone, sampler, batch, rows, kept, behaviour)
    weight = sequence_weights(old.double(), behaviour.double(), to_device(kept, batch.device), o.replay_weight,
                              o.replay_weight_max).cpu()  # fmt: skip
    log_probs = batch.log_probs.clone()
    log_probs[device_rows] = old
    trained = batch.trained
    if trained is not None or not bool(kept.all()):  # the late steps dropped: a mask over every row
        mask = stored.clone()
        mask[rows] = kept
        trained = to_device(mask, batch.log_probs.device)
    scale = torch.ones(len(batch), dtype=torch.float64, device="cpu")  # [N] host: each row's w, 1 if fresh
    scale[rows] = weight
    adv = advantages * scale.to(advantages.device, advantages.dtype)[:, None]
    metrics = {
        "replay_rows_trained": float((weight > 0).sum()),
        "replay_weight_mean": float(weight.mean()),
        "replay_weight_max": float(weight.max()),
        "replay_steps_kept": float(kept.sum(1).double().mean()),
    }
    return dataclasses.replace(batch, log_probs=log_probs, trained=trained), adv, metrics


def _start_log_probs(
    size: int, precision: Any, backbone: Backbone, sampler: Sampler, batch: Rollout, rows: Tensor, kept: Tensor,
    behaviour: Tensor,
) -> Tensor:  # fmt: skip
    """[k, W] ℓ_θold of the replayed ``rows`` ([k] host) at their kept steps (``behaviour`` elsewhere): the current
    weights' log-probability of each stored transition, without gradient, ``size`` rows per velocity call."""
    out = behaviour.clone()
    sigmas = batch.sigmas.cpu()
    with torch.no_grad():
        for i in range(kept.shape[1]):
            at = kept[:, i].nonzero().squeeze(1)  # [m] host positions among the rows
            for local in at.split(size) if at.numel() else ():
                host = rows[local]
                steps = torch.full_like(host, i)
                part = batch.transitions(to_device(host, batch.device), to_device(steps, batch.device))
                sigma, sigma_next = sigmas[host, i], sigmas[host, i + 1]
                z, z_next = part.latents[:, 0], part.next_latents[:, 0]
                with precision.autocast():
                    v = backbone.velocity(z, to_device(sigma, z.device), part.cond, part.guidance)
                    step = sampler.log_prob(z_next, z, v, sigma, sigma_next, part.noise_level)
                out[to_device(local, out.device), i] = step.log_prob.to(out.dtype)
    return out
