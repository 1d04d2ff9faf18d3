"""The five component interfaces of tpflow (docs/architecture.md, "Interfaces"), plus the prompt dataset.

Protocols only: signatures and docstrings, no behaviour. A concrete class names the Protocol it implements in its
docstring and does not inherit from it; code shared between implementations is a plain function, except
``AdapterMethods`` (tpflow/backbones/diffusers_lora.py), the mixin that gives SD3 and FLUX the adapter half of
``Backbone`` by forwarding to their ``LoraAdapter``. Shapes use the letters of ``tpflow.types``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from tpflow.types import BatchLayout, Conditioning, Credit, PromptItem, RewardOutput, Rollout, StepOutput

# What train/, the rollout and the recipe checks may ask of a component beyond its protocol's members, with the
# value a component that does not declare it has (a plugin need declare none). Read through ``capability`` only:
# the protocols below name each in their docstrings. The required ``needs_completions`` and ``consumes`` are here
# too, for the recipe checks that read them off a registered factory before anything is built.
CAPABILITIES: dict[str, Any] = {
    "gaussian_log_prob": False,  # Sampler: log_prob is the density step samples from (GRPO-Guard's RatioNorm)
    "branches": False,  # RolloutPlan: its rollouts' trace columns are branch children (TempFlow-GRPO's plan)
    # RolloutPlan: options -> whether every batch it plans is one window for all rows, every step trained (the window
    # engine's case, a DPM-Solver tail after it or not: what recompute = "retain" / "reweight" can take from)
    "samples_one_window": None,
    # RolloutPlan: recompute = "reweight" (not "retain") can take its trained steps from the rollout: DanceGRPO's
    # trained subset of one window, Flow-GRPO-Fast's per-row windows
    "reweight_only": False,
    # RolloutPlan: (sigmas, the backbone's [K + 1] schedule as floats) -> why the plan's own idea of the schedule is
    # not it (one paragraph), or None; checked once the backbone is built, before anything samples (None: no check)
    "schedule_problem": None,
    # Backbone factory: (options, num_steps) -> its [K + 1] schedule as floats without building it (no weights), for
    # recipe checks such as schedule_problem's before anything loads; None (or a None result: its scheduler config
    # is not on this machine): known once built
    "static_sigmas": None,
    "reads_branches": False,  # CreditAssigner: it reads such a trace (credit 'branch'); only with such a plan
    "needs_completions": False,  # CreditAssigner (required on an instance)
    "marks_turning_points": False,  # CreditAssigner: it can mark turning points (the run logs them per trajectory)
    "same_reward_every_step": False,  # CreditAssigner: every step of a trajectory gets one reward (outcome credit)
    # Backbone: every trainable linear layer sees the velocity call's rows (or its CFG copies of them, in blocks) as
    # its leading dimension, nothing else folded in (frames, tokens): what reweight's per-row gradients need
    # (tpflow.rollout.per_row_grads); a backbone that folds frames into the batch says False
    "per_row_layers": True,
    # Backbone: its guidance is classifier-free guidance, an unconditional branch combined with the conditional one
    # (tpflow.guidance.combine); False for a guidance-distilled model whose scale is an embedding (FLUX.1-dev), which
    # cfg_gradient = "conditional" cannot hold constant
    "cfg_branch": True,
    # Backbone: (fewest, most) source images a prompt may carry (an editing model's; tpflow.sources). A backbone
    # with most > 0 is called ``encode(prompts, sources=...)``, one list of [3, H, W] float32 [0, 1] images per prompt
    "source_images": (0, 0),
    # Backbone: () -> one sample's latent shape; a frame axis, (F, C, H, W) or (C, F, h, w), makes its samples clips,
    # which the eval's progress line counts (None: images)
    "latent_shape": None,
    # Backbone: its trained adapter (tpflow.backbones.lora's, or the full fine-tune's), whose ``drop_reference``
    # frees a full fine-tune's initial copy when the optimizer takes no KL (None: nothing to free)
    "adapter": None,
    "needs_old_means": False,  # Optimizer: the rollout must store each step's transition mean (RatioNorm)
    # Optimizer: a tpflow.rollout.retain.Retain (or .reweight.Reweight) when its update reuses the rollout's forwards
    "retain": None,
    "consumes": "transitions",  # Optimizer (required on an instance)
    # Optimizer: its update reads the final samples' reward details (Rollout.reward_details, [N] per key), which the
    # sampling stage then keeps: GARDO's KL gate ranks the auxiliary rewards
    "reads_reward_details": False,
    # Optimizer: the tpflow.optim.advantage_fusion.RunningReward its advantages read (advantage_fusion), which the
    # ability-matched prompt policy replaces with its own when the run builds it (None: it reads none)
    "running_reward": None,
    # Optimizer: () -> whether its loss runs the frozen reference model (a KL term); None: assume it does, and keep
    # the reference copy
    "uses_reference": None,
    # RewardModel: a group-relative reward (pairwise win rates): each call must hold whole prompt groups, every row
    # at one trace column, so scoring calls it once per column with the batch's rows and the recipe check refuses
    # batching that cuts a group (tpflow.scoring.groups)
    "needs_whole_groups": False,
    # RewardModel: () -> {details key: weight} when its parts' advantages are normalised apart and summed
    # (``combine = "zscore_sum"``: tpflow.train.reward_parts), else None
    "zscored_parts": None,
    # RewardModel: options -> the keys of its ``details`` (a key ending in "/" stands for any key under it), checked
    # against what a recipe names (kl_gate_main/aux) before anything loads; None: known only when it scores
    "detail_keys": None,
    # What a recipe check reads to match the reward with the backbone and the dataset before anything loads
    # (tpflow.rewards.needs): a Backbone's ``decode`` gives clips [N, F, 3, H, W] (a video backbone), not images
    "samples_clips": False,
    "accepts_clips": False,  # RewardModel: it scores clips [N, F, 3, H, W]
    "accepts_images": True,  # RewardModel: it scores images [N, 3, H, W] (False: clip-only, e.g. motion checks)
    "needs_metadata": (),  # RewardModel: the metadata keys every prompt's item must carry (GenEval's tag, include)
    # RewardModel: options -> the rewards it calls, [(where, name, options dict, on_frames)] (weighted's parts,
    # frames' reward, pairwise's judge), whose needs are its own; on_frames: the part gets single frames (images)
    "reward_parts": None,
    # PromptDataset: the metadata keys every item carries, or None when only its files can tell (jsonl: checked item
    # by item when the dataset is built)
    "metadata_keys": None,
}


def capability(component: Any, name: str) -> Any:
    """``name`` as declared on ``component``, else its declared default (``CAPABILITIES``). It reads only what it is
    given: a built object, or a registered factory when a caller asks before building (recipe checks do). So a
    capability is declared on the class the factory builds *and* on the factory when both are asked, as the editing
    backbones declare ``source_images``."""
    if name not in CAPABILITIES:
        raise KeyError(f"{name!r} is not a declared capability; declare it in tpflow.interfaces.CAPABILITIES.")
    return getattr(component, name, CAPABILITIES[name])


@runtime_checkable
class Backbone(Protocol):
    """A text-to-image flow model plus its trainable adapter (LoRA). Optional (``capability``): ``samples_clips``,
    whether ``decode`` gives clips [N, F, 3, H, W] (a text-to-video model; default False); ``latent_shape``, one
    sample's latent shape; ``adapter``, the trained adapter object (default None)."""

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode N prompts (and whatever the unconditional branch needs) once per batch. An editing backbone
        (capability ``source_images``) takes ``sources=`` too: per prompt, its source images [3, H, W] float32 in
        [0, 1], which it encodes into the same conditioning (``tpflow.sources.encode_unique`` calls it so)."""
        ...

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """z_0 ~ N(0, I): [n, ...] in the model's latent dtype and device."""
        ...

    def sigmas(self, num_steps: int) -> Tensor:
        """The inference schedule σ_0 = 1 > ... > σ_K = 0: [K + 1] float32, the model's own shift included."""
        ...

    def velocity(self, z: Tensor, sigma: Tensor, cond: Conditioning, guidance: float) -> Tensor:
        """v_θ(z, σ, c) with guidance applied (CFG batched in one call, or FLUX's guidance embedding).

        Args:
            z: [N, ...] latents, all at noise level ``sigma``.
            sigma: [N] float32 noise levels.
            cond: conditioning of the same N rows.
            guidance: CFG scale (or distilled guidance); 1 means the conditional prediction alone.
        Returns:
            [N, ...] velocity in the latent dtype.
        """
        ...

    def decode(self, z: Tensor) -> Tensor:
        """Latents [N, ...] to images [N, 3, H, W] float32 in [0, 1]."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The adapter parameters the optimizer updates; everything else is frozen."""
        ...

    def reference(self) -> AbstractContextManager[None]:
        """Context in which ``velocity`` is the frozen base model (adapter disabled): the KL reference."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write the adapter in a format diffusers' ``load_lora_weights`` reads (safetensors)."""
        ...

    def load_adapter(self, directory: Path) -> None:
        """Load an adapter written by ``save_adapter``."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """One step rule of the reverse process, written like a diffusers scheduler step (float32 inside).

    ``noise_level`` α = 0 must reproduce the Euler ODE step exactly. Optional (``capability``):
    ``gaussian_log_prob``, whether ``log_prob`` is the Gaussian density ``step`` samples from (default False).
    """

    def step(
        self,
        z: Tensor,
        v: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        noise_level: float,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> StepOutput:
        """Advance z from ``sigma`` to ``sigma_next`` ([] or [N] each); ``noise`` replaces the generator's draw ξ
        (the rollout engine always passes its own ξ: docs/algorithm.md §1.6)."""
        ...

    def log_prob(
        self, z_next: Tensor, z: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float
    ) -> StepOutput:
        """Score a stored transition z -> z_next under velocity v; ``prev`` of the result is ``z_next``."""
        ...


@runtime_checkable
class RolloutPlan(Protocol):
    """Which steps of each trajectory of a rollout batch are SDE (the window; Euler ODE elsewhere) and which of the
    stored window steps the update trains (``tpflow.plans``). Optional (``capability``): ``branches``, whether its
    rollouts' trace columns are each window step's own branch child (default False)."""

    per_row_windows: bool
    """Whether the trajectories of one batch may start their windows at different steps (then no completions)."""

    def plan(self, rollout: Any, n: int, epoch: int, batch_seed: int, run_seed: int) -> Any:
        """The ``tpflow.plans.BatchPlan`` of one rollout batch of n trajectories from the ``[rollout]`` settings;
        every draw comes from ``batch_seed`` or (``run_seed``, ``epoch``), never from a process's RNG."""
        ...


@runtime_checkable
class RewardModel(Protocol):
    """Scores images; safe to call from a worker thread; heavy models load lazily on the first call. Optional
    (``capability``): ``needs_whole_groups``, whether a call must hold whole prompt groups at one trace column
    (default False); ``accepts_clips`` / ``accepts_images``, what it scores (images only by default);
    ``needs_metadata``, the metadata keys it reads (none by default); ``reward_parts``, the rewards it is made of;
    ``zscored_parts``, the parts whose advantages the trainer normalises apart (none by default)."""

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] for their prompts and metadata; ``scores`` [N], higher is better."""
        ...


@runtime_checkable
class CreditAssigner(Protocol):
    """Turns a reward trace into one reward per trained window step. Optional (``capability``): ``reads_branches``,
    whether it reads a branching plan's trace, ``marks_turning_points``, whether it can mark any, and
    ``same_reward_every_step``, whether every step of a trajectory gets the same reward (all default False)."""

    needs_completions: bool
    """Whether the rollout must produce R_0..R_{W-1} (ODE completions); only R_W is needed when false."""

    def __call__(self, trace: Tensor) -> Credit:
        """trace [N, W+1] (column j = reward after j SDE steps completed by ODE) -> Credit with [N, W] fields.

        One call covers one rollout batch: assigners that balance turning points do so across this batch.
        """
        ...


@runtime_checkable
class Optimizer(Protocol):
    """The policy update from the epoch's rollouts and their advantages. Optional (``capability``):
    ``needs_old_means``, whether the rollout must store each step's transition mean (default False);
    ``uses_reference``, whether its loss runs the frozen reference model (default: assumed to)."""

    consumes: Literal["transitions", "final_samples"]
    """What ``update`` reads from a ``Rollout``, so that the rollout engine produces only that: ``"transitions"``
    (the SDE window's stored steps and old log-probs, plus the ODE completions the credit assigner asks for: GRPO)
    or ``"final_samples"`` (the final latents and their conditioning only; no transitions, log-probs or
    completions are stored: DiffusionNFT). The trainer reads this attribute, never the optimizer's name."""

    global_step: int
    """Optimizer steps taken so far (drives EMA and checkpoint names)."""

    def sampling_policy(self) -> AbstractContextManager[None]:
        """Context in which ``Backbone.velocity`` is the policy that collects the rollouts: the live adapter for GRPO
        (a no-op), the old policy for DiffusionNFT. The trainer samples inside it; the live values return on exit."""
        ...

    def bind(self, backbone: Backbone, accelerator: Any = None, precision: Any = None) -> None:
        """Create the parameter optimizer over ``backbone.trainable_parameters()``; called once before training.
        ``accelerator`` gives the processes' collectives (None: one process); ``precision`` (a
        ``tpflow.precision.Precision``; None: float32) gives the autocast region of each loss's forward passes and
        the fp16 scaler. ``update`` must not change a weight inside an autocast region and runs backward outside
        one; a held ``tpflow.optim.loop.AdamWLoop`` does all of this for an optimizer that supplies only its loss."""
        ...

    def batch_layout(self) -> BatchLayout | None:
        """How ``update`` batches rows (rows per micro-batch, micro-batches per step, the options that set them),
        for the run's layout line and its out-of-memory advice; None when it has no micro-batches."""
        ...

    def advantages(self, step_rewards: Tensor, groups: Sequence[Hashable]) -> Tensor:
        """Advantages [N, W'] of the epoch's step rewards [N, W], one prompt key per row; the optimizer owns every
        option of this normalisation (std scope, clipping) and applies it here, once. W' = W for an optimizer that
        consumes transitions; one that consumes final samples may return [N, 1] (the final reward's)."""
        ...

    def update(
        self,
        backbone: Backbone,
        sampler: Sampler,
        batch: Rollout,
        advantages: Tensor,
        on_step: Callable[[int], object] | None = None,
    ) -> dict[str, float]:
        """One pass over ``batch`` (advantages from ``advantages``); returns scalar metrics (loss, ratio, clip
        fraction, KL...), named so that the trainer can combine them over processes: counts of rows end in
        ``_trained`` (added), maxima have ``max`` as a word of their name (the largest), the rest are means.
        ``on_step(n)`` runs right after each optimizer step taken (n: its 0-based index; the trainer's EMA); a step
        the fp16 gradient scaler skips is neither counted in ``global_step`` nor reported."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (optimizer moments, step count)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (after ``bind``)."""
        ...


@runtime_checkable
class PromptDataset(Protocol):
    """Prompts with their task metadata (GenEval-style tags, OCR targets...), in named splits. Optional
    (``capability``): ``metadata_keys``, the keys every item's metadata carries (None, the default: unknown until
    built)."""

    splits: tuple[str, ...]
    """The split names this dataset has, e.g. ("train", "test")."""

    def split(self, name: str) -> Sequence[PromptItem]:
        """The items of one split, in a fixed order (the trainer draws from it with its own seeded RNG)."""
        ...
