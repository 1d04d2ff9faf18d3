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

from tpflow.memory.accounting import GIB, PerProcess, component_rows, per_process, sharded
from tpflow.memory.measure import Probe, Setup, measure_with, setup_of

MAX_PROCESSES = 256  # the largest process count a suggestion considers
CAUTION = (
    "estimated, not measured on a GPU: live tensor bytes, to which the CUDA allocator typically adds 5-20 % and the "
    "CUDA context about 0.5 GiB; reward models are not counted"
)


def size(nbytes: float) -> str:
    """Bytes as GiB (MiB below a tenth of one: the tiny test backbones)."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


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

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.figures.peak <= self.gpu_bytes

    @property
    def headroom(self) -> int:
        """GPU bytes left at the peak (negative: over)."""
        return self.gpu_bytes - self.figures.peak

    def lines(self) -> list[str]:
        """What ``tpflow validate`` prints: the figures, the verdict, and what would help when it does not fit."""
        f, s = self.figures, self.setup
        ckpt = "gradient checkpointing" if s.backbone.gradient_checkpointing else "no gradient checkpointing"
        state = f"{size(f.static)}"
        if sharded(s, f.world):
            share = sum(v for _, v, _, sh in self.rows if sh)
            where = f"on the host ({size(f.host)} per process, offload)" if f.host else f"1/{f.world} of {size(share)}"
            state += f" (the sharded state {where}, plus two gathered blocks)"
        out = [
            f"memory per GPU on {f.world} process{'es' if f.world > 1 else ''} ({s.title}; {CAUTION}):",
            f"  weights and optimizer state: {state}",
            f"  activations: rollout velocity call {size(f.rollout_act)}, decode chunk {size(f.decode_act)}, "
            f"training micro-batch {size(f.train_act)} ({ckpt})",
            f"  epoch buffers: {size(f.epoch)} ({f.trajectories} trajectories)",
            f"  sampling peak: {size(f.sampling)}",
            f"  update peak: {size(f.update)}",
            f"  verdict (estimate): {self.verdict()}",
        ]
        out += [f"  note: {note}" for note in s.notes]
        if not self.fits:
            out.append("  what would help (each re-estimated):" if self.suggestions else "  nothing tried fits")
            for suggestion in [*self.suggestions, *([self.together] if self.together else [])]:
                g = suggestion.figures
                verdict = "does not fit" if g.peak > self.gpu_bytes else "fits" + self._tight(g)
                label = suggestion.label() + (" (together)" if suggestion is self.together else "")
                out.append(f"    {label}: peak {size(g.peak)} (sampling {size(g.sampling)}, update "
                           f"{size(g.update)}), {verdict}")  # fmt: skip
        return out

    def verdict(self) -> str:
        """One line: fits or not in the stated memory, by how much, at which phase's peak."""
        f, gpu = self.figures, f"{self.gpu_gib:g} GiB"
        phase = "sampling" if f.sampling >= f.update else "update"
        if self.fits:
            headroom = f"{size(self.headroom)} headroom at the {phase} peak of {size(f.peak)}"
            return f"fits in {gpu} per GPU: {headroom}{self._tight(f)}"
        return f"does not fit in {gpu} per GPU: the {phase} peak is {size(f.peak)}, {size(-self.headroom)} over"

    def _tight(self, f: PerProcess) -> str:
        """A warning for a fit whose headroom is below the allocator's usual 5-20 % over the live bytes."""
        return " (tight: under the allocator's usual 5-20 %)" if self.gpu_bytes - f.peak < 0.2 * f.peak else ""

    def paragraph(self) -> str:
        """The one-paragraph error of ``tpflow validate`` when the recipe does not fit."""
        f = self.figures
        fitting = [s for s in self.suggestions if s.figures.peak <= self.gpu_bytes]
        if self.together is not None and self.together.figures.peak <= self.gpu_bytes:
            fitting.append(self.together)
        if fitting:
            helps = "Estimated to fit: " + "; ".join(f"{s.label()} ({size(s.figures.peak)})" for s in fitting) + "."
        else:
            helps = "Nothing tried fits (each change is listed above with its estimate)."
        processes = f"{f.world} process{'es' if f.world > 1 else ''}"
        phase = "sampling" if f.sampling >= f.update else "update"
        return (
            f"{self.name} does not fit in {self.gpu_gib:g} GiB per GPU on {processes}: its estimated {phase} peak is "
            f"{size(f.peak)}, {size(-self.headroom)} over. {helps} These figures are {CAUTION} (docs/distributed.md, "
            "'Will it fit?')."
        )


def estimate_fit(recipe: Any, processes: int, gpu_gib: float, name: str | None = None, fake: bool = True) -> Fit:
    """The recipe's estimated figures on ``processes`` processes against ``gpu_gib`` GiB per GPU, with computed
    suggestions when it does not fit. Raises ``NotModelled`` for a recipe the estimate cannot build or run."""
    name = name or (str(recipe.path) if recipe.path else "the recipe")
    setup = setup_of(recipe, name)
    with warnings.catch_warnings(), _quiet_diffusers():
        warnings.simplefilter("ignore")  # FakeTensor's deprecation notices from inside diffusers
        with Probe(setup, fake) as probe:
            m = measure_with(probe)
            fit = Fit(name, setup, gpu_gib, per_process(setup, m, processes), component_rows(setup, m))
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
        if getattr(fit.figures, knob.phase) > gpu and (found := _lower(knob, (), {}, figures, gpu)) is not None:
            fit.suggestions.append(Suggestion(found[1], world, found[2]))
    if fit.suggestions and not any(s.figures.peak <= gpu for s in fit.suggestions):
        overrides = tuple(o for switch in switches for o in switch)
        together, updates = figures(overrides, dict), {}
        for knob in sizes:
            if together is None or getattr(together, knob.phase) <= gpu:
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
            if result.peak <= gpu:
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
        if figures.peak <= gpu:
            return Suggestion((), processes, figures)
    return None
