"""The markdown report of ``benchmarks/memory_estimate.py`` (docs/results/memory_estimate.md): per recipe, the
component table and the estimated peaks per number of processes, with and without gradient checkpointing and, for a
sharded recipe, with the shards offloaded to the host."""

from __future__ import annotations

import dataclasses
from typing import Any

from tpflow.memory.accounting import GIB, component_rows, epoch_buffers, host_bytes, peaks, static_bytes
from tpflow.memory.timing import DEFAULT_GPU, epoch_time

CAVEATS = """\
**Estimated, not measured on a GPU; validate with `benchmarks/gpu_smoke.py` on a GPU** (it prints
`torch.cuda.max_memory_allocated`). `tpflow validate RECIPE --num-processes N --gpu-memory GIB` runs the same
estimate for one recipe and says whether it fits (docs/distributed.md, "Will it fit?").

Method. The real diffusers transformer and VAE classes with the published configurations (in
`tpflow/memory/configs.py`, each beside the `config.json` it copies) are built under
`torch._subclasses.fake_tensor.FakeTensorMode`: every tensor has its real shape, dtype and storage size but no data,
so nothing is allocated and nothing is computed. tpflow's own `SD3Backbone` / `FluxBackbone` / `QwenImageBackbone` /
`WanBackbone` (with tpflow's peft LoRA on the recipe's targets and rank, or every weight trained) run their real
code on them: `velocity` for the largest rollout call, `GRPO._step_loss` + `backward()` for one training micro-batch
(for an optimizer on final samples, NFT's, AWM's or DGPO's `loss` of one micro-batch at one time + `backward()`: its
frozen forwards, then v_θ with grad; the frozen velocities of its other training times, a few latents per row, are
not counted), `decode` for one scoring chunk (Wan: the `AutoencoderKLWan` decode of whole clips, frame by frame as
diffusers runs it, in fp32). A `TorchDispatchMode` (`LiveBytes`) adds the bytes of each new tensor storage and
subtracts them when the storage is freed, so its peak is the peak of live tensor bytes; an activation figure is that
peak minus what was alive before the call. Weights, LoRA state and epoch buffers are numel × element size (the text
encoders' parameters counted on the meta device; Wan's UMT5-XXL encoder from a transformers `UMT5Config` of the
sizes stated in `tpflow/memory/configs.py`, not from a copied file). Wan2.2's frozen expert counts whole, in the
model dtype, and every copy of the trained parameters an optimizer keeps (NFT's old policy, AWM's and DGPO's lagged
copies) in fp32. An optimizer on final samples has its rollouts store the final latents only. The rollout call
counts the ODE completions only where the recipe's credit reads them (the trainer makes none for `outcome`, and then
decodes only the finals); a completion of `completion_steps` c takes a row only at its c − 1 steps after the first,
which reuses the main trajectory's velocity.

Caveats.
- Attention kernel: the fake tensors live on the CPU device (autograd cannot run backward on fake CUDA tensors
  without a CUDA driver), where `scaled_dot_product_attention` dispatches to the flash kernel
  (`_scaled_dot_product_flash_attention_for_cpu`): it keeps the output and a float32 log-sum-exp [B, H, L], never
  the L×L matrix — the same footprint as the flash / memory-efficient kernels PyTorch picks on an A100/H100 for
  these fp16/bf16, head-dim 64/128 shapes. The math kernel would add B·H·L² elements per attention (about 13 GiB
  per attention for the SD3.5-M rollout call) and is not what a GPU runs. The kernels' backward workspaces (flash
  v2 keeps a float32 dq accumulator of the size of q) are not modelled.
- Autocast: the trainer runs rollouts and updates in `tpflow.precision`'s regions (CUDA autocast with the recipe's
  `mixed_precision` and `cache_enabled=False`). CUDA autocast cannot be switched on without a CUDA device, so
  `CudaAutocast` (a `TorchFunctionMode`) applies its policy at the Python call: matmul-type ops (linear, matmul, conv,
  scaled_dot_product_attention, ...) cast their floating inputs to the low-precision dtype, afresh at each call (no
  weight cache, as the trainer's regions); `layer_norm`, `group_norm`, `softmax`, `exp`, `pow`, `sum`, ... cast to
  float32. Ops reached only through a C++ decomposition are not cast, unlike CUDA autocast.
- The CUDA caching allocator rounds blocks up (512 B, 2 MiB segments) and fragments; `max_memory_reserved` is
  typically 5-20 % above the live-bytes peak estimated here. The tables below are live bytes and weights only;
  `tpflow validate --gpu-memory` adds the CUDA context (0.5 GiB, stated) and keeps a safety margin of 5 % of the
  peak (at least 1 GiB) free before it says "fits". cuBLAS/cuDNN workspaces are not counted.
- Sharding (`[train] shard = "fsdp"`, P > 1 processes): each process holds 1/P of the rows marked sharded plus two
  gathered blocks (the one computing and the one prefetched); the gradients of a block before their
  reduce-scatter are taken to fit in that allowance. Offload (FSDP2's `CPUOffloadPolicy`, not yet an option of
  tpflow: estimated to say what it would save): the sharded rows live in the host's pinned memory instead, the GPU
  keeps the two gathered blocks. On one process nothing is sharded, so nothing is offloaded.
- Data-dependent Python reads of fake tensors (validity checks such as `bool((std == 0).all())`, logged floats)
  read 0, so checks pass and logged diagnostics are 0; no memory depends on them.
- Text encoders: counted in the recipe's dtype as tpflow places them (`tpflow/backbones/placement.py`), with their
  float32 islands: T5's and UMT5's feed-forward output `wo` stays float32 under fp16 (transformers'
  `_keep_in_fp32_modules`), 1.0 B of T5-XXL's 4.8 B parameters.
- Reward models: the weights of the trained reward, the watched ones (`[eval] rewards`) and the diversity embedding
  on every process's GPU, from a table of published checkpoint sizes in `tpflow/memory/rewards.py` (GenEval's
  Mask2Former Swin-S + CLIP ViT-L/14 1.9 GiB in float32, PickScore's CLIP-H 3.7 GiB in its default float32, ...);
  not their activations while scoring. A reward the table does not know is named in a note, not counted.
- Time per epoch (the last paragraph of each recipe): the FLOPs of the calls above, counted on the fake tensors by
  `torch.utils.flop_counter`'s formulas (`tpflow/memory/timing.py`), times the rollouts' velocity rows, the decoded
  latents and the training steps of an epoch, at 40 % of one H100 SXM's 989 TFLOP/s bf16 dense peak: estimated, not
  measured; rewards, evaluation, communication not counted (docs/distributed.md, "Will it fit?").
- Not counted: evaluation sampling (`eval.batch_size` rows, ODE, no completions: smaller than the rollout call), and
  the prompt-encoding forward of the text encoders (short, before the rollout).

What the code does about it (tpflow/train/trainer.py, tpflow/train/scoring.py), after the first version of this
estimate showed three problems:
- The scoring worker decodes and scores `train.score_batch` latents per call (default 16; it used to decode a
  whole rollout batch, n·(W+1) latents, in one fp32 VAE call, the largest activation of every recipe at 512 px).
- The decoded images are dropped once scored (they used to stay referenced until the update ended).
- The rollouts keep no completion latents once scored, and the per-batch list is released right after
  `Rollout.cat`: the update holds one copy of the epoch's rollout tensors (two only during the concatenation).
- Epoch buffers scale with the trajectories a process holds, so they shrink with more processes; weights and the
  activations do not.
"""


def training_step(setup: Any) -> str:
    """What the measured training micro-batch runs, in the report's words."""
    from tpflow.memory.measure import on_final_samples, optimizer_of

    optimizer = optimizer_of(setup)
    if on_final_samples(optimizer):
        return "frozen fwds (no grad) + trained fwd + bwd, one training time"
    return "policy fwd + reference fwd + bwd" if optimizer.uses_reference() else "policy fwd + bwd (no reference)"


def report(setup: Any, m: dict[str, Any], world_sizes: tuple[int, ...] = (1, 8, 32), unit: int = GIB) -> str:
    """One recipe's markdown section: the component table and the estimated peaks per number of processes."""
    b, t = setup.backbone, setup.train
    u = {GIB: "GiB", 2**20: "MiB", 2**10: "KiB"}[unit]
    rows = component_rows(setup, m, unit)
    static = static_bytes(setup, m, rows, 1)
    ckpt = b.gradient_checkpointing
    cfg = (
        " (×2 with CFG)"
        if setup.kind in ("sd3", "qwen", "qwen-edit", "z-image", "wan") and setup.rollout.guidance != 1
        else ""
    )
    rows_t = m["train_rows"]
    step = training_step(setup)
    act = [
        (f"largest rollout velocity call, {plural(m['rollout_rows'], 'row')}{cfg}", m["rollout_act"], "no_grad"),
        (
            f"VAE decode of one scoring chunk, {plural(m['decode_rows'], 'latent')}",
            m["decode_act"],
            "no_grad, fp32, scoring thread",
        ),
        (
            f"training micro-batch, {rows_t} transformer rows, no checkpointing",
            m["train_act_ckpt_False"],
            step + ("" if ckpt else "; **recipe**"),
        ),
        (
            f"training micro-batch, {rows_t} transformer rows, gradient checkpointing",
            m["train_act_ckpt_True"],
            step + ("; **recipe**" if ckpt else ""),
        ),
    ]
    total = t.prompts_per_epoch * t.group_size
    buf = epoch_buffers(setup, m, total)
    kept = [
        ("rollout tensors of the epoch", buf["rollout"], f"{total} trajectories"),
        ("`Rollout.cat` copy during the update", buf["rollout_copy"], "while concatenating only"),
    ]
    size = f"{b.resolution} px"
    if setup.kind == "wan":  # clips: frames of height × width
        size = f"{b.num_frames} frames of {b.resolution}×{b.width or b.resolution} px"
    lines = [f"## {setup.name} ({setup.title}, {b.dtype}, {size}, mixed_precision = {t.mixed_precision})"]
    lines += ["", f"| component | {u} | note |", "|---|---:|---|"]
    sharded = t.shard == "fsdp"
    lines += [f"| {n} | {v / unit:.2f} | {note}{'; sharded' if s and sharded else ''} |" for n, v, note, s in rows]
    lines += [f"| **weights and optimizer state** | **{static / unit:.2f}** | |"]
    lines += [f"| activations: {n} | {v / unit:.2f} | {note} |" for n, v, note in act]
    lines += [f"| epoch, one process: {n} | {v / unit:.2f} | {note} |" for n, v, note in kept]
    sampling, update = peaks(setup, m, static, total)
    phases = f"sampling {sampling / unit:.1f}, update {update / unit:.1f}"
    lines += [f"| **estimated peak, one process** ({phases}) | **{max(sampling, update) / unit:.1f}** | |", ""]
    lines += processes_table(setup, m, rows, world_sizes, unit)
    if sharded:
        block = m["largest_block_bytes"] / unit
        lines += ["", f"Sharded (FSDP2): on P > 1 processes each holds 1/P of the rows marked sharded, plus two "
                  f"gathered blocks ({block:.2f} {u} each: the one computing and the one prefetched). With "
                  f"offload (FSDP2's CPUOffloadPolicy, not yet a tpflow option) the sharded rows would live in host "
                  f"memory (the last column), the blocks still coming over."]  # fmt: skip
    lines += time_paragraph(setup, m)
    lines += ["", f"Attention ops that ran: {', '.join(f'`{a}`' for a in m['attention_ops'])}.", ""]
    return "\n".join(lines)


def time_paragraph(setup: Any, m: dict[str, Any]) -> list[str]:
    """The time estimate on one GPU of the default kind (``tpflow.memory.timing``), as a paragraph."""
    if "rollout_flops" not in m:
        return []
    head, flops, seconds = epoch_time(setup, m, 1, DEFAULT_GPU).lines()
    what = head.removeprefix("time per epoch ").strip("():")
    return ["", f"Time per epoch ({what}): {flops.strip()}; {seconds.strip()}."]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def processes_table(setup: Any, m: dict[str, Any], rows: list, world_sizes: tuple[int, ...], unit: int) -> list[str]:
    """The estimated per-process peaks on each number of processes: sampling, the update with gradient checkpointing
    off and on (the recipe's marked), the recipe's peak, and for a sharded recipe the peak with ``offload = true``
    (and the host memory per process it takes)."""
    u = {GIB: "GiB", 2**20: "MiB", 2**10: "KiB"}[unit]
    ckpt, sharded = setup.backbone.gradient_checkpointing, setup.train.shard == "fsdp"
    mark = {c: " (recipe)" if c == ckpt else "" for c in (False, True)}
    head = (f"| processes | trajectories each | sampling peak ({u}) "
            f"| update peak, no checkpointing{mark[False]} ({u}) | update peak, checkpointing{mark[True]} ({u}) "
            f"| peak ({u}) |")  # fmt: skip
    if sharded:
        head += f" peak with offload ({u}) | host memory with offload ({u}) |"
    lines = [head, "|---:" * (8 if sharded else 6) + "|"]
    offload = dataclasses.replace(setup, train=setup.train.model_copy(update={"offload": True})) if sharded else None
    total = setup.train.prompts_per_epoch * setup.train.group_size
    for world in world_sizes:
        each = -(-total // world)
        static = static_bytes(setup, m, rows, world)
        sampling, update = peaks(setup, m, static, each)
        updates = [peaks(setup, m, static, each, c)[1] for c in (False, True)]
        cells = [world, each, *(f"{v / unit:.1f}" for v in (sampling, *updates, max(sampling, update)))]
        if offload is not None:
            light = peaks(offload, m, static_bytes(offload, m, rows, world), each)
            cells += [f"{max(light) / unit:.1f}", f"{host_bytes(offload, rows, world) / unit:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines
