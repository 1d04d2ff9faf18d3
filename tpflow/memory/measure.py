"""The measurement: tpflow's real code paths run on a recipe's model, their live tensor bytes counted.

A ``Probe`` builds the recipe's backbone (full size on fake tensors for a published model, the tiny backbones for
real: they are small) and measures, each as the peak of live bytes minus what was alive before the call: the
rollout's largest velocity call (no grad), one training micro-batch with and without gradient checkpointing (GRPO's
``_step_loss`` + backward; for an optimizer on final samples, NFT's, AWM's or DGPO's, its ``loss`` of one
micro-batch at one time + backward) and one VAE decode chunk of the scoring worker. ``measure`` takes the recipe's own
sizes; a ``Probe`` kept open re-measures other sizes (``tpflow.memory.fit``'s suggestions) without rebuilding.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tpflow.memory.autocast import CudaAutocast
from tpflow.memory.configs import PUBLISHED, TINY_FLUX, TINY_SD3, TINY_VAE, TINY_WAN, TINY_WAN_VAE
from tpflow.memory.flops import Flops
from tpflow.memory.live_bytes import LiveBytes
from tpflow.memory.models import (
    build_backbone,
    conditioning,
    count_bytes,
    largest_block_bytes,
    latents,
    recipe_sources,
)
from tpflow.memory.rewards import reward_models
from tpflow.memory.wan import frozen_expert, step_sigmas

# the tiny backbones (tpflow/backbones/tiny.py): built by their own factories, at their own (test) size
TINY_BACKBONES = {
    "tiny-sd3": "sd3", "tiny-sd3-large": "sd3", "tiny-flux": "flux", "tiny-qwen-image": "qwen", "tiny-wan": "wan",
    "tiny-wan2.2": "wan", "tiny-wan2.2-ti2v": "wan",
}  # fmt: skip


class NotModelled(Exception):
    """The recipe names something the estimate cannot build or run; the message says what and why."""


@dataclass
class Setup:
    """What one estimate needs from a recipe (all validated recipe values)."""

    name: str
    kind: str  # "sd3", "flux", "qwen", "wan"... (tpflow.memory.configs.Model.kind)
    backbone: Any  # the backbone options
    rollout: Any
    train: Any
    optimizer: Any  # the optimizer's options (GRPOOptions, NFTOptions, ...)
    transformer_cfg: dict | None  # None: ``builder`` builds the model
    vae_cfg: dict | None
    text_len: int  # tokens of the transformer's text sequence
    figures: dict[str, float] = field(default_factory=dict)
    sampler: str = "cps"  # the recipe's [sampler] (the training step's log-probability)
    completions: str | None = "ode"  # what the rollout completes ([rollout] completions); None: the credit reads none
    title: str = ""  # the model, as the report names it
    published: bool = True  # count the published model's text encoders (built on the meta device)
    builder: Callable[[Any], Any] | None = None  # options -> backbone, for a model built for real (tiny)
    notes: list[str] = field(default_factory=list)  # what the estimate leaves out for this recipe
    optimizer_name: str = "grpo"  # the registered optimizer whose options ``optimizer`` holds
    rewards: list = field(default_factory=list)  # tpflow.memory.rewards.Resident: the reward models on the GPU
    sources: int = 0  # source images per prompt an editing recipe's calls carry (tpflow.memory.models.recipe_sources)
    replayed: int = 0  # trajectories an epoch's update appends from the replay buffer ([replay]; over every process)


def optimizer_of(setup: Setup) -> Any:
    """The recipe's optimizer, built from its options (not bound): what it consumes, its kept copies, whether it
    runs a KL reference, and its training step."""
    return _optimizer(setup.optimizer_name, setup.optimizer)


def _optimizer(name: str, options: Any) -> Any:
    from tpflow import registry

    return registry.get("optimizer", name).factory(options)


def setup_of(recipe: Any, name: str) -> Setup:
    """The estimate's view of a validated recipe, or ``NotModelled`` saying why there is none."""
    from tpflow import registry

    backbone, options = recipe.backbone.name, recipe.backbone.options
    if backbone == "shapes-dit":
        raise NotModelled(
            "shapes-dit is the embedded CPU-sized model (a few million parameters): its memory is negligible next to "
            "any GPU's, so it is not estimated"
        )
    if backbone not in PUBLISHED and backbone not in TINY_BACKBONES:
        raise NotModelled(
            f"the estimate builds {', '.join(PUBLISHED)} at their published sizes and the tiny test backbones; "
            f"backbone {backbone!r} is none of them"
        )
    if not modelled_step(_optimizer(recipe.optimizer.name, recipe.optimizer.options)):
        raise NotModelled(
            f"the estimate runs GRPO's training step, or the one-micro-batch ``loss`` of an optimizer on final "
            f"samples (NFT, AWM, DGPO); optimizer {recipe.optimizer.name!r} has neither"
        )
    kind = PUBLISHED[backbone].kind if backbone in PUBLISHED else TINY_BACKBONES[backbone]
    text_len = options.max_sequence_length + (77 if kind == "sd3" else 0)  # SD3: CLIP 77 tokens + T5, concatenated
    sources, source_note = recipe_sources(recipe, kind)
    notes = [source_note] if source_note else []
    recompute = getattr(recipe.optimizer.options, "recompute", "native")
    if recompute != "native":
        notes.append(
            f'[optimizer] recompute = "{recompute}" keeps the first window steps\' graphs from the rollout to the '
            "update; they are not counted, so the figures are a lower bound"
        )
    resident = reward_models(recipe)
    common = dict(
        sampler=recipe.sampler.name,
        notes=notes + resident.notes,
        completions=made_completions(recipe),
        optimizer_name=recipe.optimizer.name,
        rewards=resident.models,
        sources=sources,
        replayed=recipe.replay.drawn,  # trajectories the update appends from the replay buffer
    )
    if backbone in PUBLISHED:
        model = PUBLISHED[backbone]
        return Setup(name, kind, options, recipe.rollout, recipe.train, recipe.optimizer.options, model.transformer,
                     model.vae, text_len, title=model.title, **common)  # fmt: skip
    factory = registry.get("backbone", backbone).factory
    return Setup(name, kind, options, recipe.rollout, recipe.train, recipe.optimizer.options, None, None, text_len,
                 title=backbone, published=False, builder=factory, **common)  # fmt: skip


def modelled_step(optimizer: Any) -> bool:
    """Whether the estimate can run the optimizer's training step: GRPO's (a subclass too), or ``loss(backbone,
    batch, rows, weights, t, noise)`` of an optimizer that consumes final samples."""
    from tpflow.optim.grpo import GRPO

    if isinstance(optimizer, GRPO):
        return True
    return on_final_samples(optimizer) and callable(getattr(optimizer, "loss", None))


def on_final_samples(optimizer: Any) -> bool:
    """Whether the optimizer trains on final samples (``Optimizer.consumes``): its rollouts store no window."""
    from tpflow.interfaces import capability

    return capability(optimizer, "consumes") == "final_samples"


def made_completions(recipe: Any) -> str | None:
    """The completions the trainer's rollouts make (tpflow/train/sampling.py): the recipe's ``[rollout]
    completions`` when its credit assigner reads them (TP-GRPO's), none for one that does not (``outcome``)."""
    from tpflow import registry
    from tpflow.interfaces import capability

    credit = registry.get("credit", recipe.credit.name).factory
    return recipe.rollout.completions if capability(credit, "needs_completions") else None


def load_setup(path: Path) -> Setup:
    """``setup_of`` the recipe file at ``path``, named by its stem."""
    from tpflow.recipe import load_recipe

    return setup_of(load_recipe(path), path.stem)


def tiny_setup(kind: str) -> Setup:
    """A recipe-shaped setup at the test sizes of docs/architecture.md (fp32, no autocast): what --tiny and the tests
    run. ``kind`` "wan": tiny-wan's sizes (5 frames of 32 px)."""
    if kind == "wan":
        return _tiny_wan_setup()
    from tpflow.backbones.flux import FluxOptions
    from tpflow.backbones.sd3 import SD3Options
    from tpflow.optim.grpo import GRPOOptions
    from tpflow.settings import RolloutSettings, TrainSettings

    sd3 = kind == "sd3"
    options = (SD3Options if sd3 else FluxOptions)(
        dtype="fp32", resolution=16 if sd3 else 32, lora_rank=4, max_sequence_length=8
    )
    rollout = RolloutSettings(num_steps=4, window_size=3, window_range=(0, 3), guidance=4.5 if sd3 else 3.5)
    return Setup(
        f"tiny-{kind}", kind, options, rollout, TrainSettings(rollout_batch=2, prompts_per_epoch=2, group_size=2),
        GRPOOptions(micro_batch_size=2), TINY_SD3 if sd3 else TINY_FLUX, TINY_VAE, 8 + (77 if sd3 else 0),
        title=f"tiny {kind}", published=False,
    )  # fmt: skip


def _tiny_wan_setup() -> Setup:
    """``tiny_setup("wan")``: tiny-wan's transformer and VAE, 5 frames of 32 px, CFG 4.5."""
    from tpflow.backbones.wan import WanOptions
    from tpflow.optim.grpo import GRPOOptions
    from tpflow.settings import RolloutSettings, TrainSettings

    options = WanOptions(dtype="fp32", resolution=32, num_frames=5, lora_rank=4, max_sequence_length=8)
    rollout = RolloutSettings(num_steps=4, window_size=3, window_range=(0, 3), guidance=4.5)
    return Setup(
        "tiny-wan", "wan", options, rollout, TrainSettings(rollout_batch=2, prompts_per_epoch=2, group_size=2),
        GRPOOptions(micro_batch_size=2), TINY_WAN, TINY_WAN_VAE, 8, title="tiny wan", published=False,
    )  # fmt: skip


def rollout_rows(num_steps: int, width: int, start: int, n: int, noise_rows: int | None = None,
                 completions: str | None = "ode", baseline_noise: str = "shared",
                 completion_steps: int | str | None = None) -> list[int]:  # fmt: skip
    """Rows of the one velocity call of each step k of ``tpflow.rollout.rollout`` (max_batch unset), [K] ints.

    At step k: the main trajectory (n rows; the P noise rows before the window), an independent baseline (n rows,
    from step 0), and every ODE branch started before k that takes a step at k: the shared baseline j = 0 (P rows)
    and completions j = 1..W-1 (n rows each). An exact completion steps at every k after its start; one of
    ``completion_steps`` c steps at its nodes (``tpflow.rollout.parts.completion_nodes``) between its start, whose
    step reuses the main trajectory's velocity, and K. ``noise_rows`` P defaults to n (``same_noise`` off).
    """
    from tpflow.rollout.parts import completion_nodes

    p = n if noise_rows is None else noise_rows
    steps = None if completion_steps in (None, "all") else int(completion_steps)
    nodes = [completion_nodes(start + j, num_steps, steps) for j in range(width)]  # None: every step
    rows = []
    for k in range(num_steps):
        count = n if k >= start else p
        if completions is not None and baseline_noise == "independent":
            count += n
        if completions == "ode":
            live = [j for j in range(width) if start + j < k and (nodes[j] is None or k in nodes[j][1:-1])]
            count += sum((p if baseline_noise == "shared" else 0) if j == 0 else n for j in live)
        rows.append(count)
    return rows


def largest_rollout_rows(setup: Setup, max_batch: int | None = None) -> int:
    """Rows of the largest velocity call over the window starts the recipe samples, capped by ``max_batch``."""
    r, n = setup.rollout, setup.train.rollout_batch
    lo, hi = r.window_range
    starts = range(lo, hi - r.window_size + 1)
    rows = max(max(rollout_rows(r.num_steps, r.window_size, s, n, None, setup.completions, r.baseline_noise,
                                r.completion_steps)) for s in starts)  # fmt: skip
    return min(rows, max_batch or rows)


class Probe:
    """The setup's backbone built under ``LiveBytes`` (on fake tensors unless ``fake=False``); each method runs one
    of tpflow's calls and returns its activation peak in bytes. Use as a context manager."""

    def __init__(self, setup: Setup, fake: bool = True) -> None:
        self.setup, self.fake = setup, fake and setup.builder is None  # the tiny factories build real tensors
        self._stack = ExitStack()

    def __enter__(self) -> Probe:
        from tpflow.backbones.diffusers_common import DTYPES

        s = self.setup
        if self.fake:
            self._stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        self.tracker = self._stack.enter_context(LiveBytes())
        if s.builder is not None:
            self.backbone = s.builder(s.backbone.model_copy(update={"device": "cpu", "prompt_cache": 0}))
        else:
            self.backbone = build_backbone(s.kind, s.transformer_cfg, s.vae_cfg, s.backbone)
        self.trainable = self.backbone.trainable_parameters()  # a full fine-tune's: every weight (fp32 masters)
        precision = s.train.mixed_precision
        self.autocast = CudaAutocast(DTYPES[precision]) if precision != "no" else None
        self._grads = False
        self.optimizer, self._bound = optimizer_of(s), None  # bound at its first training step
        self.train_rows = 0
        self.flops = 0  # of the last call measured
        return self

    def __exit__(self, *exc: object) -> None:
        self.backbone = self.trainable = self.optimizer = self._bound = None
        self._stack.close()

    def statics(self) -> dict[str, Any]:
        """Sizes read off the built model: latent, transformer, largest block, VAE, trained parameters."""
        s, backbone, live = self.setup, self.backbone, self.tracker.live  # live: before the probes below
        frozen = frozen_expert(backbone)  # Wan2.2's expert that does not train; None for the others
        cond = conditioning(backbone, s.kind, 1, s.text_len, sources=s.sources).tensors  # one prompt's, as kept
        return {
            "latent_numel": latents(backbone, 1).numel(),
            "embeds_bytes": sum(t.numel() * t.element_size() for t in cond.values()),  # [L, D] + pooled [P] / mask
            "weights_tracked": live,
            "transformer_bytes": count_bytes(backbone.transformer) - sum(p.numel() * 4 for p in self.trainable),
            "largest_block_bytes": largest_block_bytes(backbone.transformer),
            "vae_bytes": count_bytes(backbone.vae),
            "frozen_bytes": count_bytes(frozen) if frozen is not None else 0,
            "lora_params": sum(p.numel() for p in self.trainable),
        }

    def _peak(self, fn: Callable[[], Any], autocast: bool = True) -> int:
        """The live-bytes peak of ``fn`` above what was alive before it; its FLOPs are left in ``self.flops``."""
        with ExitStack() as inner:
            if autocast and self.autocast is not None:
                inner.enter_context(self.autocast)
            flops = inner.enter_context(Flops())
            before = self.tracker.reset_peak()
            fn()
        self.flops = flops.total
        return self.tracker.peak - before

    def rollout(self, rows: int) -> int:
        """The rollout's velocity call of ``rows`` rows, no grad (CFG doubles the transformer's rows inside)."""
        s, backbone = self.setup, self.backbone
        cond, z = conditioning(backbone, s.kind, rows, s.text_len, sources=s.sources), latents(backbone, rows)
        sigma = torch.full((rows,), 0.5, device="cpu")
        with torch.no_grad():
            return self._peak(lambda: backbone.velocity(z, sigma, cond, s.rollout.guidance))

    def train(self, rows: int, checkpointing: bool) -> int:
        """One training micro-batch of ``rows`` trajectories and its backward, with gradient checkpointing on or
        off: GRPO's own step loss (policy forward, the reference forward when beta > 0, the KL), or, for an
        optimizer on final samples, its ``loss`` of ``rows`` samples at one time (its frozen forwards without grad,
        v_θ with grad). The largest number of rows the transformer saw (CFG doubles them) is ``train_rows``."""
        backbone, b = self.backbone, rows
        if not self._grads:  # steady state: grads exist from the previous micro-batch and are accumulated in place
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            self._grads = True
        if checkpointing:
            backbone.transformer.enable_gradient_checkpointing()
        else:
            backbone.transformer.disable_gradient_checkpointing()
        step = self._final_sample_step(b) if on_final_samples(self.optimizer) else self._grpo_step(b)
        seen: list[int] = []

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen.append(len(hidden) if isinstance(hidden, list) else int(hidden.shape[0]))  # Z-Image: a list

        hook = backbone.transformer.register_forward_pre_hook(count, with_kwargs=True)
        try:
            peak = self._peak(step)
        finally:
            hook.remove()
        self.train_rows = max(seen, default=0)
        return peak

    def _grpo_step(self, b: int) -> Callable[[], None]:
        """GRPO's ``_step_loss`` + backward on one stored step of ``b`` trajectories."""
        from tpflow.optim.grpo import GRPO
        from tpflow.registry import build
        from tpflow.types import Rollout, RolloutCost

        s, backbone = self.setup, self.backbone
        shape = latents(backbone, b).shape
        step = (b, 1, *shape[1:])
        part = Rollout(
            latents=torch.randn(step, device="cpu"), next_latents=torch.randn(step, device="cpu"),
            log_probs=torch.zeros(b, 1, device="cpu"),
            sigmas=torch.tensor([step_sigmas(backbone)], device="cpu").expand(b, 2).clone(),
            noise_level=s.rollout.noise_level, guidance=s.rollout.guidance,
            cond=conditioning(backbone, s.kind, b, s.text_len, sources=s.sources),
            final=torch.randn(shape, device="cpu"), completions=None, cost=RolloutCost(nfe=0.0),
        )  # fmt: skip
        grpo, sampler = GRPO(s.optimizer), build("sampler", s.sampler)

        def step() -> None:  # the advantages [b] made inside the step, as the update loop makes them
            grpo._step_loss(backbone, sampler, part, torch.ones(b, device="cpu"), 0).total.backward()

        return step

    def _final_sample_step(self, b: int) -> Callable[[], None]:
        """The optimizer's ``loss`` of ``b`` final samples at one time t = ½ (unit weights) + backward. The
        optimizer is bound once, outside the measured call: its kept copies are state (``kept_copies``), not
        activations. Its other training times' frozen velocities (a few latents per row) are not counted."""
        from tpflow.types import Rollout, RolloutCost

        s, backbone = self.setup, self.backbone
        if self._bound is None:
            self._bound = self.optimizer
            self._bound.bind(backbone)
        shape = latents(backbone, b).shape
        empty = (b, 0, *shape[1:])  # no stored window (``Optimizer.consumes`` = "final_samples")
        part = Rollout(
            latents=torch.zeros(empty, device="cpu"), next_latents=torch.zeros(empty, device="cpu"),
            log_probs=torch.zeros(b, 0, device="cpu"), sigmas=torch.zeros(b, 1, device="cpu"),
            noise_level=0.0, guidance=s.rollout.guidance,
            cond=conditioning(backbone, s.kind, b, s.text_len, sources=s.sources),
            final=torch.randn(shape, device="cpu"), completions=None, cost=RolloutCost(nfe=0.0),
        )  # fmt: skip
        rows, t = torch.arange(b, device="cpu"), torch.full((b,), 0.5, device="cpu")
        noise, weights = torch.randn(shape, device="cpu"), torch.ones(b, device="cpu")

        def step() -> None:
            self._bound.loss(backbone, part, rows, weights, t, noise).rows.sum().backward()

        return step

    def decode(self, chunk: int) -> int:
        """One decode call of the scoring worker, ``chunk`` latents, fp32 VAE, in the worker's thread, where the
        trainer's autocast (thread-local) is off."""
        zc = latents(self.backbone, chunk)
        with torch.no_grad():
            return self._peak(lambda: self.backbone.decode(zc), autocast=False)

    def attention_ops(self) -> list[str]:
        return sorted(op for op in self.tracker.ops if "attention" in op)


def measure(setup: Setup, fake: bool = True) -> dict[str, Any]:
    """Activation peaks (bytes) of the rollout call, the training step (checkpointing on and off) and a decode, at
    the recipe's sizes, with the static sizes of the model (``Probe.statics``)."""
    with Probe(setup, fake) as probe:
        return measure_with(probe)


def measure_with(probe: Probe) -> dict[str, Any]:
    """``measure`` on an open probe (kept open by the caller to re-measure other sizes)."""
    setup = probe.setup
    r, t, o = setup.rollout, setup.train, setup.optimizer
    rows = largest_rollout_rows(setup, r.max_batch)
    out: dict[str, Any] = {"rollout_rows": rows, **probe.statics()}
    out["rollout_act"] = probe.rollout(rows)
    out["rollout_flops"] = probe.flops  # FLOPs of that call (tpflow.memory.timing: the time estimate)
    for ckpt in (False, True):
        out[f"train_act_ckpt_{ckpt}"] = probe.train(o.micro_batch_size, ckpt)
        if ckpt == setup.backbone.gradient_checkpointing:  # the recipe's: checkpointing recomputes the forward
            out["train_flops"] = probe.flops
    out["train_rows"] = probe.train_rows  # the transformer's rows in the step (CFG doubles them)
    # one decode chunk of the scoring worker: train.score_batch of the n·W completions + n finals of a rollout batch
    # (the n finals alone when the rollout makes no completions)
    chunk = min(t.score_batch, t.rollout_batch * (r.window_size + 1 if setup.completions else 1))
    out["decode_act"] = probe.decode(chunk)
    out["decode_flops"] = probe.flops
    out["decode_rows"] = chunk
    out["attention_ops"] = probe.attention_ops()
    if not setup.published and setup.builder is not None:
        from tpflow.memory.models import pipe_text_encoder_sizes

        out["text_encoders"] = pipe_text_encoder_sizes(probe.backbone, setup.backbone.dtype)
    return out
