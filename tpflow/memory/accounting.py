"""The accounting: what a process holds on its GPU, from the measured activations and the model's sizes.

Why apart from the measurement: the per-process figures for another number of processes, with sharding, with
offload or with the other checkpointing setting are arithmetic on one measurement (the activations of one call do
not depend on them), so ``tpflow validate --gpu-memory`` and the report compute them without re-running anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tpflow.interfaces import capability

GIB = 2**30
Row = tuple[str, int, str, bool]  # (component, bytes, note, sharded under shard = "fsdp")


def epoch_buffers(setup: Any, m: dict[str, Any], trajectories: int) -> dict[str, int]:
    """Bytes the trainer keeps on the GPU across an epoch (tpflow/train/trainer.py ``train_epoch``, types.Rollout).

    Per trajectory (``rollout``): latents and next_latents [W, *latent] fp32, final [*latent] fp32 (the completions
    are dropped once scored), the prompt's conditioning tensors as the backbone makes them (embeddings [L, D] +
    pooled [P] in the transformer's dtype, fp32 under full fine-tuning; Qwen-Image's mask [L] int64), sigmas and
    log-probs. The update concatenates the batches (``Rollout.cat``) and then releases them: two copies only at that
    moment (``rollout_copy``). Decoded images are not kept. An optimizer that consumes final samples (NFT, AWM,
    DGPO) has the rollout store no window (W = 0): the final latent, the conditioning and one sigma per trajectory.
    """
    from tpflow.memory.measure import on_final_samples, optimizer_of

    w = 0 if on_final_samples(optimizer_of(setup)) else setup.rollout.window_size
    latent = m["latent_numel"] * 4  # fp32; SD3.5 / FLUX: 16 channels at 1/8 of the resolution (FLUX packed)
    per_traj = (2 * w + 1) * latent + m["embeds_bytes"] + (w + 1) * 4 + w * 4  # + sigmas [W+1], log_probs [W] fp32
    return {"rollout": trajectories * per_traj, "rollout_copy": trajectories * per_traj}


def state_rows(setup: Any, m: dict[str, Any]) -> list[Row]:
    """The trained model's weights and optimizer state: (name, bytes, note, sharded under ``shard = "fsdp"``).

    LoRA: the frozen base in the recipe's dtype, the adapter, its gradient, AdamW moments and EMA in fp32. Full
    fine-tuning: fp32 master weights, gradients, moments, EMA, and the KL reference's frozen copy when the optimizer
    runs a reference pass (``uses_reference``; in fp32, on the device once used; tpflow/backbones/full_finetune.py).
    Both: each copy of the trained parameters the optimizer keeps (``kept_copies``: NFT's old policy, AWM's and
    DGPO's lagged copies), in fp32. Sharded, each process holds 1/P of each."""
    from tpflow.memory.measure import optimizer_of

    b, t = setup.backbone, setup.train
    optimizer = optimizer_of(setup)
    n = m["lora_params"]
    kept: list[Row] = [(f"{name} ({setup.optimizer_name})", n * 4, f"fp32; {note}", True)
                       for name, note in getattr(optimizer, "kept_copies", list)()]  # fmt: skip
    if getattr(b, "finetune", "lora") == "full":
        uses_reference = capability(optimizer, "uses_reference")  # None: an optimizer that does not say runs one
        reference = uses_reference() if callable(uses_reference) else True
        return [
            (f"transformer weights, fp32 masters ({n / 1e9:.2f} B params)", n * 4, "fp32, trained", True),
            ("transformer buffers", m["transformer_bytes"], "", False),
            ("gradients", n * 4, "fp32", True),
            ("AdamW states (exp_avg, exp_avg_sq)", n * 8, "fp32", True),
            ("EMA copy of the model", n * 4 if t.ema else 0, "fp32" if t.ema else "ema off", True),
            ("KL reference: frozen initial copy", n * 4 if reference else 0,
             "fp32" if reference else "no reference pass: none", True),
            *kept,
        ]  # fmt: skip
    return [
        (
            "transformer weights and buffers",
            m["transformer_bytes"],
            f"{b.dtype}; SD3's pos_embed buffer included" if setup.kind == "sd3" else b.dtype,
            True,
        ),
        (f"LoRA r={b.lora_rank} ({n / 1e6:.1f} M params)", n * 4, "fp32", True),
        ("LoRA grads", n * 4, "fp32", True),
        ("AdamW states (exp_avg, exp_avg_sq)", n * 8, "fp32", True),
        ("EMA copy of the LoRA", n * 4 if t.ema else 0, "fp32" if t.ema else "ema off", True),
        *kept,
    ]


@functools.cache
def _published_encoders(kind: str, dtype: str) -> dict[str, tuple[int, int]]:
    from tpflow.memory.models import text_encoder_sizes

    return text_encoder_sizes(kind, dtype)


def component_rows(setup: Any, m: dict[str, Any], unit: int = GIB) -> list[Row]:
    """Everything a process holds outside the activations and the epoch's tensors: the trained model's rows
    (``state_rows``), Wan2.2's frozen expert, the VAE, the text encoders (on the GPU unless
    ``text_encoders_device = "cpu"``; their float32 islands counted in float32) and the reward models
    (``tpflow.memory.rewards``: published sizes)."""
    b = setup.backbone
    on_gpu = b.text_encoders_device == "model"
    encoders = _published_encoders(setup.kind, b.dtype) if setup.published else m.get("text_encoders", {})
    u = {GIB: "GiB", 2**20: "MiB", 2**10: "KiB"}[unit]
    trained = state_rows(setup, m)
    rows: list[Row] = [trained[0], ("VAE weights", m["vae_bytes"], "fp32", False)]
    if m.get("frozen_bytes"):  # Wan2.2: the expert that does not train, whole on every process (no sharding yet)
        rows.insert(1, ("frozen expert's weights and buffers", m["frozen_bytes"], f"{b.dtype}, not trained", False))
    for name, (count, nbytes) in encoders.items():
        where = b.dtype if nbytes == count * {"fp16": 2, "bf16": 2, "fp32": 4}[b.dtype] else f"{b.dtype}, fp32 islands"
        if not on_gpu:
            where = f"on the CPU (text_encoders_device), {nbytes / unit:.2f} {u} there"
        rows.append((f"{name} weights ({count / 1e9:.2f} B params)", nbytes if on_gpu else 0, where, False))
    rewards = [(f"{r.what} ({r.params / 1e9:.2f} B params)", r.nbytes, r.note, False) for r in setup.rewards]
    return rows + trained[1:] + rewards


def reward_bytes(setup: Any) -> int:
    """Bytes of the reward models on one process's GPU (``tpflow.memory.rewards``)."""
    return sum(r.nbytes for r in setup.rewards)


def sharded(setup: Any, world: int) -> bool:
    """Whether the trainer shards on ``world`` processes: ``shard = "fsdp"`` on more than one (one process holds
    everything, tpflow/train/trainer.py)."""
    return setup.train.shard == "fsdp" and world > 1


def offloaded(setup: Any, world: int) -> bool:
    """Whether the sharded rows live in host memory: ``offload = true`` where the trainer shards."""
    return sharded(setup, world) and bool(getattr(setup.train, "offload", False))


def static_bytes(setup: Any, m: dict[str, Any], rows: list[Row], world: int) -> int:
    """What a process holds on its GPU outside the activations on ``world`` processes. With ``shard = "fsdp"`` (and
    more than one process): the sharded rows over ``world`` plus two gathered blocks (the one computing and the one
    prefetched); with ``offload = true`` too, the sharded rows live on the host and only the two blocks come over."""
    if not sharded(setup, world):
        return sum(v for _, v, _, _ in rows)
    share = 0 if offloaded(setup, world) else -(-sum(v for _, v, _, s in rows if s) // world)
    return sum(v for _, v, _, s in rows if not s) + share + 2 * m["largest_block_bytes"]


def host_bytes(setup: Any, rows: list[Row], world: int) -> int:
    """Host memory per process that ``offload = true`` takes for the GPU: its 1/P of the sharded rows (pinned)."""
    return -(-sum(v for _, v, _, s in rows if s) // world) if offloaded(setup, world) else 0


def peaks(setup: Any, m: dict[str, Any], static: int, trajectories: int, checkpointing: bool | None = None
          ) -> tuple[int, int]:  # fmt: skip
    """(sampling phase, update phase) peaks: static + what the epoch keeps + the phase's largest activation.

    Sampling: the rollout tensors, a rollout call and a decode running at once (the scoring thread decodes batch b
    while batch b+1 is sampled). Update: the larger of the concatenation (two rollout copies) and one copy plus the
    training step with ``checkpointing`` (default: the recipe's ``gradient_checkpointing``).
    """
    buf = epoch_buffers(setup, m, trajectories)
    sampling = static + buf["rollout"] + m["rollout_act"] + m["decode_act"]
    ckpt = setup.backbone.gradient_checkpointing if checkpointing is None else checkpointing
    update = static + buf["rollout"] + max(buf["rollout_copy"], m[f"train_act_ckpt_{ckpt}"])
    return sampling, update


@dataclass(frozen=True)
class PerProcess:
    """One process's estimated GPU bytes on ``world`` processes (and the host bytes offload moves off it)."""

    world: int
    trajectories: int  # of the epoch, held by this process
    static: int  # weights and optimizer state on the GPU (this process's share when sharded)
    host: int  # what offload keeps in host memory instead
    epoch: int  # the epoch's rollout tensors
    rollout_act: int
    decode_act: int
    train_act: int  # the training micro-batch with the recipe's checkpointing
    sampling: int
    update: int
    replayed: int = 0  # trajectories the update appends from the replay buffer on this process

    @property
    def peak(self) -> int:
        return max(self.sampling, self.update)


def per_process(setup: Any, m: dict[str, Any], world: int) -> PerProcess:
    """The recipe's figures on ``world`` processes: the epoch's trajectories split evenly, the state per
    ``static_bytes``."""
    rows = component_rows(setup, m)
    each = -(-setup.train.prompts_per_epoch * setup.train.group_size // world)
    replayed = -(-getattr(setup, "replayed", 0) // world)  # the replayed rows are dealt over the processes
    static = static_bytes(setup, m, rows, world)
    sampling, _ = peaks(setup, m, static, each)
    _, update = peaks(setup, m, static, each + replayed)  # the update holds the fresh and the replayed rows
    train = m[f"train_act_ckpt_{setup.backbone.gradient_checkpointing}"]
    return PerProcess(world, each, static, host_bytes(setup, rows, world), epoch_buffers(setup, m, each)["rollout"],
                      m["rollout_act"], m["decode_act"], train, sampling, update, replayed)  # fmt: skip
