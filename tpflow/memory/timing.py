"""The time of a recipe's epochs, ESTIMATED: the FLOPs the memory probe counts on its calls, at a stated fraction of
a GPU's peak. ``tpflow validate RECIPE --gpu-memory GIB --gpu NAME`` prints it beside the memory verdict.

Why from FLOPs: a user books GPU-hours before the first run, and the machines that validate have no GPU. The probe
already runs the recipe's real calls at full size on fake tensors (``tpflow.memory.measure``); ``Flops`` counts
them by ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention; forward, backward and the
recomputation of gradient checkpointing). An epoch (all processes together) is

    rollouts   trajectories × velocity rows per trajectory × FLOPs per velocity row (CFG's doubling inside)
    decodes    trajectories × latents decoded per trajectory (W + 1 with completions, else 1) × FLOPs per latent
    training   trajectories × training times per trajectory × inner epochs × FLOPs per trajectory-time (forwards,
               the reference's, backward)

and takes total / (processes × UTILIZATION × the GPU's peak dense bf16 FLOP/s) seconds. Not counted: the reward
models' scoring, the prompt encoding, evaluations, checkpoints, communication between processes, and a sharded
model's gathers; the fp32 VAE decode is counted at the bf16 rate. Filtered trajectories (zero advantage) are
counted as trained. An estimate to size a booking, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UTILIZATION = 0.40  # the stated fraction of the peak a diffusion transformer's training sustains (model FLOPs)
GPUS = {  # name -> (label, peak dense bf16 tensor FLOP/s: the datasheet's "with sparsity" figure halved)
    "h100": ("H100 SXM", 989e12),  # NVIDIA H100 Tensor Core GPU datasheet (SXM: 1,979 TFLOPS with sparsity)
    "h100-pcie": ("H100 PCIe", 756e12),  # the same datasheet (PCIe: 1,513 TFLOPS with sparsity)
    "h200": ("H200 SXM", 989e12),  # NVIDIA H200 datasheet: the H100 SXM's tensor cores (1,979 with sparsity)
    "a100": ("A100", 312e12),  # NVIDIA A100 datasheet: 312 TFLOPS bf16 dense (624 with sparsity)
}
DEFAULT_GPU = "h100"


def velocity_rows_per_trajectory(setup: Any) -> float:
    """Transformer rows of velocity calls (before CFG's doubling) per trajectory of a rollout, averaged over the
    window starts the recipe samples: the main trajectory's K steps plus the completions' and baselines' rows
    (``tpflow.memory.measure.rollout_rows``)."""
    from tpflow.memory.measure import rollout_rows

    r, n = setup.rollout, setup.train.rollout_batch
    lo, hi = r.window_range
    starts = range(lo, hi - r.window_size + 1)
    totals = [sum(rollout_rows(r.num_steps, r.window_size, s, n, None, setup.completions, r.baseline_noise,
                               r.completion_steps)) for s in starts]  # fmt: skip
    return sum(totals) / len(totals) / n


def training_times(setup: Any) -> int:
    """Training steps per trajectory per inner epoch: GRPO's window steps, or the times an optimizer on final
    samples trains each sample at (NFT's ``timesteps_per_sample``, AWM's and DGPO's ``train_timesteps``)."""
    from tpflow.memory.measure import on_final_samples, optimizer_of

    o = setup.optimizer
    if on_final_samples(optimizer_of(setup)):
        return int(getattr(o, "timesteps_per_sample", None) or getattr(o, "train_timesteps", 1))
    return setup.rollout.window_size


@dataclass(frozen=True)
class EpochTime:
    """FLOPs of one epoch (all processes) by part, and the time they take on ``processes`` GPUs of kind ``gpu``."""

    gpu: str  # a key of GPUS
    processes: int
    epochs: int
    rollout: float
    decode: float
    train: float

    @property
    def flops(self) -> float:
        return self.rollout + self.decode + self.train

    @property
    def rate(self) -> float:
        """FLOP/s one GPU is taken to sustain: UTILIZATION × its peak."""
        return UTILIZATION * GPUS[self.gpu][1]

    @property
    def seconds(self) -> float:
        """Seconds per epoch on ``processes`` GPUs (the work split evenly)."""
        return self.flops / (self.processes * self.rate)

    @property
    def gpu_hours(self) -> float:
        """GPU-hours for the recipe's epochs (the same on any number of GPUs: communication is not counted)."""
        return self.flops * self.epochs / self.rate / 3600

    def lines(self) -> list[str]:
        label, peak = GPUS[self.gpu]
        parts = (("rollouts", self.rollout), ("decodes", self.decode), ("training", self.train))
        share = ", ".join(f"{name} {part / self.flops:.0%}" for name, part in parts)
        gpus = f"{self.processes} GPU{'s' if self.processes > 1 else ''}"
        return [
            f"time per epoch (estimated, not measured: FLOPs counted on these calls, at {UTILIZATION:.0%} of the "
            f"{label}'s {peak / 1e12:.0f} TFLOP/s bf16 dense peak; rewards, evaluation and communication not "
            "counted):",
            f"  {figure(self.flops / 1e15)} PFLOP per epoch ({share})",
            f"  {figure(self.seconds)} s per epoch on {gpus}; {figure(self.gpu_hours)} GPU-hours for {self.epochs} "
            "epochs",
        ]


def figure(value: float) -> str:
    """Three significant digits below 100, whole numbers from 100 up: 0.0123, 4.56, 789, 12,345."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def epoch_time(setup: Any, m: dict[str, Any], processes: int, gpu: str) -> EpochTime:
    """The epoch's FLOPs from the probe's counts ``m`` (``rollout_flops`` of ``rollout_rows`` rows, ``decode_flops``
    of ``decode_rows`` latents, ``train_flops`` of one micro-batch) and the recipe's sizes (module docstring)."""
    t, r = setup.train, setup.rollout
    trajectories = t.prompts_per_epoch * t.group_size
    per_row = m["rollout_flops"] / m["rollout_rows"]
    decodes = r.window_size + 1 if setup.completions else 1
    per_time = m["train_flops"] / setup.optimizer.micro_batch_size
    inner = getattr(setup.optimizer, "num_inner_epochs", 1)
    return EpochTime(
        gpu,
        processes,
        t.epochs,
        rollout=trajectories * velocity_rows_per_trajectory(setup) * per_row,
        decode=trajectories * decodes * m["decode_flops"] / m["decode_rows"],
        train=trajectories * training_times(setup) * inner * per_time,
    )
