"""What to do when training runs out of GPU memory: one paragraph naming the phase and the setting that sizes it.

Out-of-memory is the most common first failure of a flow-GRPO run on a new GPU (docs/results.md §5 estimates the
paper recipes' memory). A CUDA traceback says where the allocation failed, not which recipe value to lower; the
phase the trainer was in does. Each phase holds a different batch on the GPU:

* sampling: a rollout batch's rows (trajectories, their ODE baselines and completions) through the transformer,
  in calls of at most ``rollout.max_batch`` rows, after the text encoders;
* scoring: ``train.score_batch`` latents through the VAE decoder and the reward model;
* updating: a micro-batch of rows through the transformer with gradients (the optimizer names the option that
  sizes it: ``Optimizer.batch_layout``);
* evaluation: ``eval.batch_size`` images sampled by ODE.

The run stops there without writing a checkpoint (an update may be half applied); ``--resume`` continues from the
newest one, which holds whatever was written before.
"""

from __future__ import annotations

from tpflow.types import BatchLayout

KNOBS = {  # phase -> what to lower, and what that costs
    "sampling": "set rollout.max_batch (rows per velocity call, e.g. 8: the rollout is chunked, its samples the "
    'same), or put the text encoders on the CPU (backbone.text_encoders_device = "cpu", where the backbone has '
    "it)",
    "scoring": "lower train.score_batch (images decoded and scored at once; it changes no result)",
    "updating": "lower {micro} and raise {accumulation} by the same factor (the same rows per optimizer step, "
    "each weighing the same: the gradient does not change), or set backbone.gradient_checkpointing = true where "
    "the backbone has it",
    "eval": "lower eval.batch_size (images sampled at once; it changes no result)",
}


def phase_of(description: str) -> str | None:
    """The phase of a progress description ("epoch 3: updating", "eval at epoch 8: sampling 780 images")."""
    if description.startswith("eval"):
        return "eval"
    return next((phase for phase in KNOBS if description.endswith(phase)), None)


def out_of_memory_message(
    description: str, error: BaseException, resume: str, layout: BatchLayout | None = None, saved: bool = True
) -> str:
    """One paragraph for an out-of-memory error raised while the trainer was at ``description``; ``resume`` is the
    command that continues the run; ``layout`` is the optimizer's ``batch_layout()`` (None: it has none)."""
    phase = phase_of(description)
    micro = layout.micro_batch_option if layout is not None else "the optimizer's micro-batch size"
    accumulation = layout.accumulation_option if layout is not None else "its gradient accumulation"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = f"while {description}" if description else "before the first epoch"
    advice = (
        f"To fit, {KNOBS[phase].format(micro=micro, accumulation=accumulation)}."
        if phase
        else f"Lower rollout.max_batch, train.score_batch, {micro} or eval.batch_size."
    )
    return (
        f"Out of GPU memory {where} ({first_line}). {advice} Other processes on the GPU count too (nvidia-smi); "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps when the memory is free but fragmented. No "
        + (
            f"checkpoint was written now; `{resume}` continues from the newest one."
            if saved
            else f"checkpoint has been written yet; `{resume}` starts the run again."
        )
    )
