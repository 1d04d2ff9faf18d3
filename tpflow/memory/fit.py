"""Whether a recipe fits a stated GPU memory: ``tpflow validate RECIPE --num-processes N --gpu-memory GIB``.

The recipe's model is measured once (``tpflow.memory.measure``) and its per-process figures on N processes are
computed (``tpflow.memory.accounting``). When the peak is above the stated memory, each change that could lower it is
applied to the recipe as ``--set`` would (and validated as a recipe: a change the recipe cannot take is not offered),
and the figures are computed again, re-measuring the call whose size the change alters on the same built model: a
smaller ``optimizer.micro_batch_size`` re-runs the training step, a smaller ``train.score_batch`` the decode, a
smaller ``rollout.max_batch`` the velocity call. Nothing is guessed: a suggestion says the estimated peak it gives.
Everything is an estimate of live tensor bytes on fake tensors, not a measurement.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tpflow.memory.accounting import GIB, PerProcess, component_rows, per_process, reward_bytes, sharded
from tpflow.memory.measure import Probe, Setup, measure_with, setup_of
from tpflow.memory.timing import DEFAULT_GPU, EpochTime, epoch_time

MAX_PROCESSES = 256  # the largest process count a suggestion considers
CUDA_CONTEXT = GIB // 2  # what CUDA itself takes on each GPU before the first tensor (see ``CAUTION``)
MARGIN, MARGIN_MIN = 0.05, GIB  # the safety margin kept free: 5 % of the estimated peak, at least 1 GiB
CAUTION = (
    "estimated, not measured on a GPU: live tensor bytes, the reward models' weights (published sizes) and the CUDA "
    f"context ({CUDA_CONTEXT / GIB:.1f} GiB) counted, a safety margin of {MARGIN:.0%} (at least "
    f"{MARGIN_MIN / GIB:.0f} GiB) kept free for the CUDA allocator, which typically adds 5-20 %"
)


def size(nbytes: float) -> str:
    """Bytes as GiB (MiB below a tenth of one: the tiny test backbones)."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def on_gpu(live: int) -> int:
    """What a process takes on its GPU at a peak of ``live`` estimated bytes (tensors, reward weights included): the
    CUDA context added (about 0.5 GiB with CUDA 12's lazy module loading: PyTorch's "CUDA semantics" notes put it at
    a few hundred MiB up to about 1 GiB, depending on the CUDA version and the GPU)."""
    return live + CUDA_CONTEXT


def margin(live: int) -> int:
    """The safety margin kept free at a peak of ``live`` bytes: ``MARGIN`` of what the GPU holds, at least
    ``MARGIN_MIN`` (the caching allocator rounds blocks up and fragments; the estimate counts live bytes)."""
    return max(MARGIN_MIN, int(MARGIN * on_gpu(live)))


def reliable(live: int, gpu: int) -> bool:
    """Whether a peak of ``live`` bytes fits ``gpu`` bytes with the CUDA context and the margin."""
    return on_gpu(live) + margin(live) <= gpu


def fit_word(live: int, gpu: int) -> str:
    """ "fits", "does not fit reliably" (inside the margin) or "does not fit" (over the memory)."""
    return "fits" if reliable(live, gpu) else "does not fit reliably" if on_gpu(live) <= gpu else "does not fit"


@dataclass(frozen=True)
class Suggestion:
    """One change to the recipe and the estimated figures with it."""

    overrides: tuple[str, ...]  # as ``--set`` takes them; empty for a process count alone
    processes: int
    figures: PerProcess

    def label(self) -> str:
        return " ".join(f"--set {o}" for o in self.overrides) or f"on {self.processes} processes"


@dataclass
class Fit:
    """The estimate for one recipe on ``figures.world`` processes against ``gpu_gib`` GiB per GPU."""

    name: str
    setup: Setup
    gpu_gib: float  # the stated memory of one GPU
    figures: PerProcess
    rows: list = field(default_factory=list)  # tpflow.memory.accounting.component_rows of the recipe
    suggestions: list[Suggestion] = field(default_factory=list)
    together: Suggestion | None = None  # every single-process-count suggestion at once, when none fits alone
    time: EpochTime | None = None  # the time estimate (tpflow.memory.timing)

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gib * GIB)

    @property
    def fits(self) -> bool:
        """Fits with the CUDA context and the safety margin (``reliable``)."""
        return reliable(self.figures.peak, self.gpu_bytes)

    @property
    def headroom(self) -> int:
        """GPU bytes left at the peak, the CUDA context counted (negative: over)."""
        return self.gpu_bytes - on_gpu(self.figures.peak)

    def lines(self) -> list[str]:
        """What ``tpflow validate`` prints: the figures, the verdict, and what would help when it does not fit."""
        f, s = self.figures, self.setup
        ckpt = "gradient checkpointing" if s.backbone.gradient_checkpointing else "no gradient checkpointing"
        rewards = reward_bytes(s)
        state = f"{size(f.static - rewards)}"
        if sharded(s, f.world):
            share = sum(v for _, v, _, sh in self.rows if sh)
            where = f"on the host ({size(f.host)} per process, offload)" if f.host else f"1/{f.world} of {size(share)}"
            state += f" (the sharded state {where}, plus two gathered blocks)"
        models = "; ".join(f"{r.what.split(': ', 1)[-1]} in {r.note.split(';')[0]}" for r in s.rewards if r.nbytes)
        held = f"{size(rewards)} ({models}; published sizes)" if models else "none on the GPU"
        out = [
            f"memory per GPU on {f.world} process{'es' if f.world > 1 else ''} ({s.title}; {CAUTION}):",
            f"  weights and optimizer state: {state}",
            f"  reward models: {held}",
            f"  activations: rollout velocity call {size(f.rollout_act)}, decode chunk {size(f.decode_act)}, "
            f"training micro-batch {size(f.train_act)} ({ckpt})",
            f"  epoch buffers: {size(f.epoch)} ({f.trajectories} trajectories"
            + (f"; the update adds up to {f.replayed} replayed)" if f.replayed else ")"),
            f"  CUDA context: {size(CUDA_CONTEXT)} (stated, not estimated)",
            f"  sampling peak: {size(on_gpu(f.sampling))}",
            f"  update peak: {size(on_gpu(f.update))}",
            f"  safety margin: {size(margin(f.peak))} ({MARGIN:.0%} of the peak, at least {size(MARGIN_MIN)})",
            f"  verdict (estimate): {self.verdict()}",
        ]
        out += [f"  note: {note}" for note in s.notes]
        if not self.fits:
            out.append("  what would help (each re-estimated):" if self.suggestions else "  nothing tried fits")
            for suggestion in [*self.suggestions, *([self.together] if self.together else [])]:
                g = suggestion.figures
                verdict = fit_word(g.peak, self.gpu_bytes) + (self._tight(g) if self._fits(g) else "")
                label = suggestion.label() + (" (together)" if suggestion is self.together else "")
                out.append(f"    {label}: peak {size(on_gpu(g.peak))} (sampling {size(on_gpu(g.sampling))}, "
                           f"update {size(on_gpu(g.update))}), {verdict}")  # fmt: skip
        return out + (self.time.lines() if self.time is not None else [])

    def _fits(self, f: PerProcess) -> bool:
        return reliable(f.peak, self.gpu_bytes)

    def verdict(self) -> str:
        """One line: fits or not in the stated memory, by how much, at which phase's peak."""
        f, gpu = self.figures, f"{self.gpu_gib:g} GiB"
        phase, peak = "sampling" if f.sampling >= f.update else "update", size(on_gpu(f.peak))
        left, kept = size(self.headroom), size(margin(f.peak))
        if self.fits:
            tight = self._tight(f)
            return f"fits in {gpu} per GPU: {left} left at the {phase} peak of {peak}, the {kept} margin kept{tight}"
        if self.headroom >= 0:
            where = f"the {phase} peak of {peak} leaves {left}, inside the {kept} safety margin"
            return f"does not fit reliably in {gpu} per GPU: {where}"
        return f"does not fit in {gpu} per GPU: the {phase} peak is {peak}, {size(-self.headroom)} over"

    def _tight(self, f: PerProcess) -> str:
        """A warning for a fit whose headroom is below the allocator's usual 5-20 % over the live bytes."""
        left = self.gpu_bytes - on_gpu(f.peak)
        return " (tight: under the allocator's usual 5-20 %)" if left < 0.2 * on_gpu(f.peak) else ""

    def paragraph(self) -> str:
        """The one-paragraph error of ``tpflow validate`` when the recipe does not fit (reliably)."""
        f = self.figures
        fitting = [s for s in self.suggestions if self._fits(s.figures)]
        if self.together is not None and self._fits(self.together.figures):
            fitting.append(self.together)
        if fitting:
            helps = "Estimated to fit: " + "; ".join(f"{s.label()} ({size(on_gpu(s.figures.peak))})" for s in fitting)
            helps += "."
        else:
            helps = "Nothing tried fits (each change is listed above with its estimate)."
        processes = f"{f.world} process{'es' if f.world > 1 else ''}"
        phase = "sampling" if f.sampling >= f.update else "update"
        peak = f"its estimated {phase} peak is {size(on_gpu(f.peak))}"
        if self.headroom >= 0:
            what = (f"does not fit reliably in {self.gpu_gib:g} GiB per GPU on {processes}: {peak}, leaving "
                    f"{size(self.headroom)}, inside the {size(margin(f.peak))} safety margin")  # fmt: skip
        else:
            what = f"does not fit in {self.gpu_gib:g} GiB per GPU on {processes}: {peak}, {size(-self.headroom)} over"
        return f"{self.name} {what}. {helps} These figures are {CAUTION} (docs/distributed.md, 'Will it fit?')."


def estimate_fit(recipe: Any, processes: int, gpu_gib: float, name: str | None = None, fake: bool = True,
                 gpu: str = DEFAULT_GPU) -> Fit:  # fmt: skip
    """The recipe's estimated figures on ``processes`` processes against ``gpu_gib`` GiB per GPU, with computed
    suggestions when it does not fit, and the time of its epochs on ``processes`` GPUs of kind ``gpu``
    (``tpflow.memory.timing.GPUS``). Raises ``NotModelled`` for a recipe the estimate cannot build or run."""
    name = name or (str(recipe.path) if recipe.path else "the recipe")
    setup = setup_of(recipe, name)
    with warnings.catch_warnings(), _quiet_diffusers():
        warnings.simplefilter("ignore")  # FakeTensor's deprecation notices from inside diffusers
        with Probe(setup, fake) as probe:
            m = measure_with(probe)
            fit = Fit(name, setup, gpu_gib, per_process(setup, m, processes), component_rows(setup, m),
                      time=epoch_time(setup, m, processes, gpu))  # fmt: skip
            if not fit.fits:
                _suggest(fit, recipe, m, probe)
    return fit


@contextlib.contextmanager
def _quiet_diffusers() -> Iterator[None]:
    """diffusers' logged advice while the models are built (a cast of fake modules it would warn about): not the
    user's concern here."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _variant(recipe: Any, overrides: tuple[str, ...]) -> Any | None:
    """The recipe with ``overrides`` applied and validated, or None when the recipe cannot take them. Validated
    outside the probe's fake-tensor and live-bytes modes: a recipe check that computes with tensors (Wan2.2's
    schedule against its expert boundary) would read 0 from fake ones and refuse the variant."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tpflow.errors import UserError
    from tpflow.recipe import apply_overrides, validate_recipe

    data = copy.deepcopy(recipe.data)
    try:
        apply_overrides(data, overrides)
        with _disable_current_modes():
            return validate_recipe(data, where="variant", path=recipe.path)
    except UserError:
        return None


def _halvings(value: int) -> list[int]:
    """value // 2, value // 4, ... down to 1 (what a smaller batch size suggestion tries, largest first)."""
    out = []
    while value > 1:
        value //= 2
        out.append(value)
    return out


@dataclass
class _Size:
    """A batch size whose smaller values lower one phase's activation: its values (largest first), the override of
    each, and the re-measurement of the call it sizes (cached: the probe runs each value once)."""

    phase: str  # "sampling" or "update": the peak it can lower
    values: list[int]
    override: Callable[[int], str]
    remeasure: Callable[[int], dict[str, Any]]
    cache: dict[int, dict[str, Any]] = field(default_factory=dict)

    def updates(self, value: int) -> dict[str, Any]:
        if value not in self.cache:
            self.cache[value] = self.remeasure(value)
        return self.cache[value]


def _suggest(fit: Fit, recipe: Any, m: dict[str, Any], probe: Probe) -> None:
    """Fill ``fit.suggestions`` with each change that could lower the peak, applied alone and re-estimated (a batch
    size: the largest value that fits, else the smallest), and, when none of them fits alone, ``fit.together``:
    the switches together, then each batch size in turn lowered until the whole fits. Then the fewest processes that
    fit with the recipe as it is."""
    setup, world, gpu = fit.setup, fit.figures.world, fit.gpu_bytes
    train, backbone, ckpt = setup.train, setup.backbone, setup.backbone.gradient_checkpointing

    def figures(overrides: tuple[str, ...], updates: Callable[[], dict[str, Any]]) -> PerProcess | None:
        variant = _variant(recipe, overrides)  # None: the recipe cannot take the change (validate would refuse it)
        return None if variant is None else per_process(setup_of(variant, fit.name), {**m, **updates()}, world)

    switches: list[tuple[str, ...]] = []
    if not ckpt:
        switches.append(("backbone.gradient_checkpointing=true",))
    if world > 1 and train.shard != "fsdp":
        switches.append(('train.shard="fsdp"',))
    if setup.published and backbone.text_encoders_device == "model":
        switches.append(('backbone.text_encoders_device="cpu"',))
    sizes = [
        _Size("update", _halvings(setup.optimizer.micro_batch_size), lambda b: f"optimizer.micro_batch_size={b}",
              lambda b: {f"train_act_ckpt_{ckpt}": probe.train(b, ckpt)}),
        _Size("sampling", _halvings(m["decode_rows"]), lambda c: f"train.score_batch={c}",
              lambda c: {"decode_act": probe.decode(c)}),
        _Size("sampling", _halvings(m["rollout_rows"]), lambda n: f"rollout.max_batch={n}",
              lambda n: {"rollout_act": probe.rollout(n)}),
    ]  # fmt: skip
    for overrides in switches:  # offered where they lower the peak
        if (alone := figures(overrides, dict)) is not None and alone.peak < fit.figures.peak:
            fit.suggestions.append(Suggestion(overrides, world, alone))
    for knob in sizes:
        if not reliable(getattr(fit.figures, knob.phase), gpu) and (found := _lower(knob, (), {}, figures, gpu)):
            fit.suggestions.append(Suggestion(found[1], world, found[2]))
    if fit.suggestions and not any(reliable(s.figures.peak, gpu) for s in fit.suggestions):
        overrides = tuple(o for switch in switches for o in switch)
        together, updates = figures(overrides, dict), {}
        for knob in sizes:
            if together is None or reliable(getattr(together, knob.phase), gpu):
                continue
            found = _lower(knob, overrides, updates, figures, gpu)
            if found is not None:
                value, overrides, together = found
                updates = {**updates, **knob.updates(value)}
        if together is not None and overrides:
            fit.together = Suggestion(overrides, world, together)
    more = _more_processes(setup, m, world, gpu)
    if more is not None:
        fit.suggestions.append(more)


def _lower(knob: _Size, overrides: tuple[str, ...], updates: dict[str, Any], figures: Callable, gpu: int
           ) -> tuple[int, tuple[str, ...], PerProcess] | None:  # fmt: skip
    """``knob`` lowered on top of ``overrides`` (re-measured with ``updates``): its largest value that fits, else its
    smallest the recipe takes, as (value, overrides with it, figures); None when the recipe takes none of them."""
    last = None
    for value in knob.values:
        with_it = (*overrides, knob.override(value))
        result = figures(with_it, lambda value=value: {**updates, **knob.updates(value)})
        if result is not None:
            last = (value, with_it, result)
            if reliable(result.peak, gpu):
                break
    return last


def _more_processes(setup: Setup, m: dict[str, Any], world: int, gpu: int) -> Suggestion | None:
    """The fewest processes above ``world`` that share the epoch (``check_layout``) and fit, or None."""
    from tpflow.errors import UserError
    from tpflow.train.prompt_sampler import check_layout

    for processes in range(world + 1, MAX_PROCESSES + 1):
        try:
            check_layout(setup.train, processes)
        except UserError:
            continue
        figures = per_process(setup, m, processes)
        if reliable(figures.peak, gpu):
            return Suggestion((), processes, figures)
    return None
