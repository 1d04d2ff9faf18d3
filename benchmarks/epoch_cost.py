"""What one training epoch costs, phase by phase: Flow-GRPO and TP-GRPO through the real trainer, in one run.

    .venv/bin/python benchmarks/epoch_cost.py [--backbone shapes-dit tiny-sd3] [--repeats 3] [--threads 1]
        [--variants flow tp tp-same-noise tp-x0] [--set section.key=value ...] [--json OUT]
    .venv/bin/python benchmarks/epoch_cost.py --backbone sd3.5-medium-random --device cuda --json OUT   # GPU
    .venv/bin/python benchmarks/epoch_cost.py --tiny --json OUT    # seconds: checks the script, measures nothing
    .venv/bin/python benchmarks/epoch_cost.py --variants flow flow-retain flow-1step flow-1step-retain \
        tp tp-retain tp-1step tp-1step-retain      # [optimizer] recompute = "retain" against native
    .venv/bin/python benchmarks/epoch_cost.py --set optimizer.beta=0 --variants flow flow-retain flow-reweight \
        tp tp-retain tp-reweight                   # and "reweight" (which needs beta = 0)

For every backbone, one ``Trainer`` per variant is built on the same recipe (the same backbone weights, prompts,
noise seeds and window draws): Flow-GRPO (``outcome`` credit, no completions), TP-GRPO (``turning_point`` credit,
ODE completions), TP-GRPO with ``rollout.same_noise``, TP-GRPO with x0 completions, plus any speed variant named in
``--variants`` (``VARIANTS``). Each trainer runs one untimed warm-up epoch, then ``--repeats`` epochs round-robin
(the order rotated every round, so drift in the machine's load hits every variant alike). An epoch is what
``Trainer.fit`` does per epoch without evaluation: ``train_epoch`` (sampling and scoring, credit, advantages, the
GRPO update, the trace log), the metrics record, and a checkpoint.

The epoch's wall time is split into phases that do not overlap and sum to it (``PHASES``): the rollout's velocity
calls (``model_s``), the text encoding of the prompts, the rest of sampling, the wait for the scoring worker after
the last rollout batch (decode + reward that sampling did not hide), credit, advantages, the update's forward
(policy and KL reference velocity) and backward, the rest of the update (log-probs, loss, optimizer step, metrics),
the trace log, the checkpoint, and what is left (``other``). Decode and reward run in the scoring thread: their own
seconds are reported too, and the part of them hidden behind sampling is ``overlapped_s``. The trainer's overhead is
everything outside the velocity calls, the update's forward and backward, and the scoring wait: ``overhead = 1 −
(model + update forward/backward + scoring wait) / epoch``; text encoding counts as overhead there (it is shown
apart, as ``encode``). Velocity calls, text encoding and backward passes are timed by wrapping them (CUDA
synchronised around each, which costs a little GPU time on CUDA, none on CPU).

FLOPs are counted with ``torch.utils.flop_counter.FlopCounterMode`` on a separate, untimed epoch of each variant
(counting slows every op, so it would distort the timed epochs): rollout velocity calls, update forward, update
backward and the rest of the main thread; decode FLOPs are counted on one decode chunk and scaled by the rows
decoded (the scoring thread is outside the counter). Achieved FLOP/s = FLOPs of a phase / its median seconds, and its
share of a square-matmul peak measured in the same run (``--dtype`` of the run: fp32 on CPU). Peak memory: CUDA
``max_memory_allocated`` during an epoch; on CPU the peak resident set (VmHWM, reset at the start of each epoch;
``resource.getrusage`` where /proc is missing), which includes every trainer of the run; so, apart, what a
recompute-free mode keeps for the update (``kept_mib``: the retained graphs' saved tensors, or reweight's gradient
buffers) and the seconds of reweight's backward inside the rollout (``sample_backward``).

Prints a markdown table per backbone and writes every figure to ``--json``. Not run in CI
(tests/test_benchmarks_smoke.py runs ``--tiny``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing and gpu_smoke sit beside this file

import _timing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BACKBONES = ("shapes-dit", "tiny-sd3", "sd3.5-medium-random")
ONE_STEP = {"gradient_accumulation_steps": 4}  # the recipes' 4 micro-batches per epoch in one optimizer step
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # key -> (label, recipe overrides)
    "flow": ("Flow-GRPO (outcome)", {"credit": {"name": "outcome"}}),
    "tp": ("TP-GRPO, ODE completions", {"credit": {"name": "turning_point"}}),
    "tp-same-noise": (
        "TP-GRPO, ODE + same_noise",
        {"credit": {"name": "turning_point"}, "rollout": {"same_noise": True}},
    ),
    "tp-x0": ("TP-GRPO, x0 completions", {"credit": {"name": "turning_point"}, "rollout": {"completions": "x0"}}),
    # Speed options, off by default: measured against the variants above in the same run.
    # DanceGRPO's trained subset (recipes/shapes_dancegrpo.toml's plan): every step SDE, 60% of the first K − 1 trained
    "dance": (
        "DanceGRPO (trained-fraction 0.6)",
        {
            "credit": {"name": "outcome"},
            "sampler": {"name": "dance-sde"},
            "plan": {"name": "trained-fraction", "fraction": 0.6, "exclude_last": True},
            "rollout": {"window_size": "K", "same_noise": True},  # "K": the window covers every step
        },
    ),
    "flow-compile": (
        "Flow-GRPO, compiled blocks",
        {"credit": {"name": "outcome"}, "backbone": {"compile_blocks": True}},
    ),
    "tp-compile": (
        "TP-GRPO, ODE, compiled blocks",
        {"credit": {"name": "turning_point"}, "backbone": {"compile_blocks": True}},
    ),
    # Recompute-free updates ([optimizer] recompute = "retain"): the update's first optimizer step back-propagates the
    # rollout's own graphs. The recipes take 4 (shapes-dit) or 2 (SD3) optimizer steps per epoch, of which the first
    # is retained; "1step" makes the epoch one optimizer step (gradient_accumulation_steps = 4: every micro-batch of
    # the epoch), native and retained, to show the whole recompute removed.
    "flow-retain": ("Flow-GRPO, retain", {"credit": {"name": "outcome"}, "optimizer": {"recompute": "retain"}}),
    "flow-1step": ("Flow-GRPO, 1 step/epoch", {"credit": {"name": "outcome"}, "optimizer": ONE_STEP}),
    "flow-1step-retain": (
        "Flow-GRPO, 1 step/epoch, retain",
        {"credit": {"name": "outcome"}, "optimizer": {**ONE_STEP, "recompute": "retain"}},
    ),
    "tp-retain": ("TP-GRPO, ODE, retain", {"credit": {"name": "turning_point"}, "optimizer": {"recompute": "retain"}}),
    "tp-1step": ("TP-GRPO, ODE, 1 step/epoch", {"credit": {"name": "turning_point"}, "optimizer": ONE_STEP}),
    "tp-1step-retain": (
        "TP-GRPO, ODE, 1 step/epoch, retain",
        {"credit": {"name": "turning_point"}, "optimizer": {**ONE_STEP, "recompute": "retain"}},
    ),
    # recompute = "reweight" (beta = 0 only: run it with --set optimizer.beta=0 so that every variant trains alike)
    "dance-reweight": ("DanceGRPO (trained-fraction 0.6), reweight", {}),  # filled in below from "dance"
    "mixgrpo": (
        "MixGRPO (window-schedule, Euler after)",
        {
            "credit": {"name": "outcome"},
            "sampler": {"name": "flow-sde"},
            "plan": {"name": "window-schedule", "strategy": "progressive", "iters_per_group": 2, "stride": 1},
            "rollout": {"same_noise": True},
        },
    ),
    "mixgrpo-reweight": ("MixGRPO, reweight", {}),  # filled in below from "mixgrpo"
    "fast": (
        "Flow-GRPO-Fast (window-per-image, W = 3 in [0, 5))",
        {
            "credit": {"name": "outcome"},
            "plan": {"name": "window-per-image"},
            "rollout": {"window_size": 3, "window_range": [0, 5]},
        },
    ),  # fmt: skip
    "fast-reweight": ("Flow-GRPO-Fast, reweight", {}),  # filled in below from "fast"
    "tempflow": (
        "TempFlow-GRPO (branch, noise-aware weights)",
        {
            "credit": {"name": "branch"},
            "sampler": {"name": "flow-sde"},
            "plan": {"name": "branch"},
            "optimizer": {"step_weight": "noise-aware"},
            "rollout": {"same_noise": True},
        },
    ),  # fmt: skip
    "tempflow-reweight": ("TempFlow-GRPO, reweight", {}),  # filled in below from "tempflow"
    "flow-reweight": ("Flow-GRPO, reweight", {"credit": {"name": "outcome"}, "optimizer": {"recompute": "reweight"}}),
    "flow-1step-reweight": (
        "Flow-GRPO, 1 step/epoch, reweight",
        {"credit": {"name": "outcome"}, "optimizer": {**ONE_STEP, "recompute": "reweight"}},
    ),
    "tp-reweight": (
        "TP-GRPO, ODE, reweight",
        {"credit": {"name": "turning_point"}, "optimizer": {"recompute": "reweight"}},
    ),
    "tp-1step-reweight": (
        "TP-GRPO, ODE, 1 step/epoch, reweight",
        {"credit": {"name": "turning_point"}, "optimizer": {**ONE_STEP, "recompute": "reweight"}},
    ),
}
for _key in ("dance", "mixgrpo", "fast", "tempflow"):
    _label, _overrides = VARIANTS[_key]
    VARIANTS[f"{_key}-reweight"] = (
        VARIANTS[f"{_key}-reweight"][0],
        {**_overrides, "optimizer": {**_overrides.get("optimizer", {}), "recompute": "reweight"}},
    )
DEFAULT_VARIANTS = ("flow", "tp", "tp-same-noise", "tp-x0")
PHASES = (  # the epoch's wall time, split without overlap (seconds)
    "sample_model",  # velocity calls of the rollouts
    "encode",  # the prompts' text encoding (Backbone.encode), once per rollout batch
    "sample_backward",  # recompute = "reweight": the rollout's per-step backward into per-row gradients
    "sample_other",  # the rest of sampling: noise, sampler steps, completions bookkeeping, submitting
    "score_wait",  # waiting for decode + reward after the last rollout batch
    "credit",
    "advantages",
    "update_forward",  # velocity calls of the update: policy (with grad) and KL reference
    "update_backward",
    "update_other",  # log-probs, loss, optimizer step, EMA, the update's metrics
    "log",  # traces.jsonl and metrics.jsonl
    "checkpoint",
    "other",  # what is left: planning, gathers, Rollout.cat, metrics
)
MODEL_PHASES = ("sample_model", "sample_backward", "update_forward", "update_backward")
ACTIVE: list[Any] = [None]  # the EpochProbe of the epoch running: the rollout's per-batch records report to it


def watch_recompute() -> None:
    """Time reweight's rollout backward and size what the recompute-free modes keep for the update: the retained
    graphs' saved tensors (each storage once) and reweight's gradient buffers, summed over an epoch's rollout batches
    (``kept_mib``: what they hold at the update's start, on top of the stored transitions)."""
    from tpflow.rollout.per_row_grads import PerRowGradients
    from tpflow.rollout.retain import RetainedLog
    from tpflow.rollout.reweight import ReweightLog

    gradients, velocity, stacked = PerRowGradients.gradients, RetainedLog.velocity, ReweightLog.stacked

    def timed_gradients(self, loss, n):
        probe = ACTIVE[0]
        return gradients(self, loss, n) if probe is None else probe._timed("sample_backward", gradients)(self, loss, n)

    def counted_velocity(self, call, rows):
        seen: set[int] = set()

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if ACTIVE[0] is not None and key not in seen:
                seen.add(key)
                ACTIVE[0].kept_bytes += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return velocity(self, call, rows)

    def counted_stacked(self):
        out = stacked(self)
        if out is not None and ACTIVE[0] is not None:
            ACTIVE[0].kept_bytes += sum(g.nbytes for g in out.grads)
        return out

    PerRowGradients.gradients = timed_gradients
    RetainedLog.velocity = counted_velocity
    ReweightLog.stacked = counted_stacked


# ---- the recipes --------------------------------------------------------------------------------------------


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the variant's options; a component section that names another component is replaced."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in overrides.items():
        if "name" in values and values["name"] != out.get(section, {}).get("name"):
            out[section] = dict(values)
        else:
            out.setdefault(section, {}).update(values)
    return out


def base_recipe(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The epoch each variant runs: shapes-dit as recipes/shapes_tp.toml; the SD3 backbones as gpu_smoke.py (the
    paper's SD3.5-M settings: 36 trajectories in rollout batches of 9, K = 10, W = 9, β = 1e-4, 2 accumulation
    steps); ``--tiny`` shrinks either to seconds."""
    import gpu_smoke
    import tomllib

    if name == "shapes-dit":
        data = tomllib.loads((ROOT / "recipes" / "shapes_tp.toml").read_text())
        data["backbone"]["device"] = args.device
    else:
        smoke = argparse.Namespace(
            tiny=name == "tiny-sd3", resolution=args.resolution, dtype=args.dtype, gradient_checkpointing=False,
            prompts=3, group=12,
        )  # fmt: skip
        data = gpu_smoke.recipe_data(smoke, Path("unused"))
        data["backbone"]["device"] = args.device
    data["eval"] = {"every": 0}
    data["train"].update(epochs=10_000, save_every=0, ema=False)
    if args.tiny:
        data["rollout"].update(num_steps=4, window_size=2, window_range=[0, 2])
        data["train"].update(prompts_per_epoch=2, group_size=2, rollout_batch=4)
        data["optimizer"].update(micro_batch_size=4, gradient_accumulation_steps=1)
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        data.setdefault(section, {})[field] = json.loads(value) if value[:1] in '[{tf0123456789-"' else value
    return data


# ---- the phase clock ----------------------------------------------------------------------------------------


class EpochProbe:
    """Wraps the trainer's stages (instance attributes shadow the methods) to time the phases of one epoch, and,
    when ``counter`` is set, to read the FlopCounterMode total at each phase boundary."""

    def __init__(self, trainer: Any, device: torch.device) -> None:
        self.trainer, self.device = trainer, device
        self.stage = "other"  # the enclosing stage: sample, update or other
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, int] = {}
        self.counter: Any = None
        self.rows = {"sample": 0, "update": 0}  # latent rows through the velocity
        self.kept_bytes = 0  # what a recompute-free mode keeps for the update (watch_recompute)
        t = trainer
        t._sample_and_score = self._stage("sample", t._sample_and_score)
        t._update = self._stage("update", t._update)
        t.optimizer.advantages = self._timed("advantages", t.optimizer.advantages)
        t.logger.log_traces = self._timed("log", t.logger.log_traces)
        t.logger.log = self._timed("log", t.logger.log)
        t.credit = _Credit(t.credit, self._timed("credit", t.credit.__call__))
        t.backbone.encode = self._timed("encode", t.backbone.encode)
        velocity = t.backbone.velocity
        t.backbone.velocity = self._velocity(velocity)
        precision = t.optimizer.precision  # the loop's backward (tpflow.optim.loop), scaled under fp16
        precision.backward = self._timed("update_backward", precision.backward)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.flops = dict.fromkeys(PHASES, 0)
        self.rows = {"sample": 0, "update": 0}
        self.kept_bytes = 0

    def _now_flops(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def _timed(self, phase: str, fn):
        def wrapped(*args, **kwargs):
            _timing.sync(self.device)
            start, flops = time.perf_counter(), self._now_flops()
            try:
                return fn(*args, **kwargs)
            finally:
                _timing.sync(self.device)
                self.seconds[phase] += time.perf_counter() - start
                self.flops[phase] += self._now_flops() - flops

        return wrapped

    def _stage(self, stage: str, fn):
        """The whole stage's time goes to ``<stage>_other`` less what its inner phases took."""

        def wrapped(*args, **kwargs):
            inner = dict(self.seconds), dict(self.flops)
            self.stage = stage
            _timing.sync(self.device)
            start, flops = time.perf_counter(), self._now_flops()
            try:
                return fn(*args, **kwargs)
            finally:
                _timing.sync(self.device)
                total, total_flops = time.perf_counter() - start, self._now_flops() - flops
                nested_s = sum(self.seconds[p] - inner[0][p] for p in PHASES)
                nested_f = sum(self.flops[p] - inner[1][p] for p in PHASES)
                self.seconds[f"{stage}_other"] += total - nested_s
                self.flops[f"{stage}_other"] += total_flops - nested_f
                self.stage = "other"

        return wrapped

    def _velocity(self, fn):
        def wrapped(z, sigma, cond, guidance):
            phase = "sample_model" if self.stage == "sample" else "update_forward"
            self.rows["sample" if self.stage == "sample" else "update"] += z.shape[0]
            return self._timed(phase, fn)(z, sigma, cond, guidance)

        return wrapped


class _Credit:
    """The trainer's credit assigner with its call timed (``needs_completions`` and the rest pass through)."""

    def __init__(self, inner: Any, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, trace):
        return self._call(trace)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def run_epoch(trainer: Any, probe: EpochProbe, epoch: int) -> dict[str, Any]:
    """One epoch as ``fit`` runs it (no evaluation): train_epoch, the metrics record, a checkpoint."""
    probe.reset()
    ACTIVE[0] = probe
    cuda = probe.device.type == "cuda"
    base = _timing.cuda_peak_reset(probe.device) if cuda else 0
    if not cuda:
        _timing.reset_rss_peak()
    _timing.sync(probe.device)
    start = time.perf_counter()
    metrics = trainer.train_epoch(epoch)
    trainer.logger.log(metrics, step=trainer.optimizer.global_step, epoch=epoch)
    checkpoint = time.perf_counter()
    trainer.epoch = epoch + 1
    trainer.checkpoints.save(trainer.epoch, trainer.last_eval, collective=False)
    _timing.sync(probe.device)
    end = time.perf_counter()
    seconds = dict(probe.seconds)
    seconds["checkpoint"] = end - checkpoint
    seconds["score_wait"] = metrics["score_wait_s"]
    seconds["sample_other"] -= metrics["score_wait_s"]
    epoch_s = end - start
    seconds["other"] = epoch_s - sum(seconds[p] for p in PHASES if p != "other")
    peak = _timing.cuda_peak_increase_mib(probe.device, base) + base / 2**20 if cuda else _timing.rss_peak_mib()
    return {
        "epoch_s": epoch_s,
        "phases": seconds,
        "decode_s": metrics["decode_s"],
        "reward_s": metrics["reward_s"],
        "nfe_per_traj": metrics["nfe_per_traj"],
        "first_ratio_max_deviation": metrics["first_ratio_max_deviation"],
        "rows": dict(probe.rows),
        "peak_mib": peak,
        "kept_mib": probe.kept_bytes / 2**20,
    }


def count_flops(trainer: Any, probe: EpochProbe, epoch: int, decode_rows: int) -> dict[str, float]:
    """FLOPs per phase of one untimed epoch under FlopCounterMode, plus the decode's (counted on one chunk)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        probe.counter = counter
        try:
            run_epoch(trainer, probe, epoch)
        finally:
            probe.counter = None
        flops = {p: float(f) for p, f in probe.flops.items()}
        flops["other"] = float(counter.get_total_flops()) - sum(flops.values())
    chunk = trainer.settings.score_batch
    z = trainer.backbone.initial_noise(min(chunk, decode_rows), torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        trainer.backbone.decode(z)
    flops["decode"] = counter.get_total_flops() / z.shape[0] * decode_rows
    return flops


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of several square matmuls in ``dtype`` (8192 on CUDA, 1024 on CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        _timing.sync(device)
        start = time.perf_counter()
        reps = 10 if device.type == "cuda" else 3
        for _ in range(reps):
            a @ b
        _timing.sync(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * n**3 / best


# ---- one backbone -------------------------------------------------------------------------------------------


def summarise(runs: list[dict], flops: dict[str, float] | None, peak_flops: float) -> dict[str, Any]:
    med = statistics.median
    typical = sorted(runs, key=lambda r: r["epoch_s"])[(len(runs) - 1) // 2]  # the median epoch (lower middle)
    phases = dict(typical["phases"])  # its phases: they add up to its time
    epoch_s = typical["epoch_s"]
    decode_s, reward_s = typical["decode_s"], typical["reward_s"]

    def overhead(r: dict) -> float:
        return 1 - (sum(r["phases"][p] for p in MODEL_PHASES) + r["phases"]["score_wait"]) / r["epoch_s"]

    overheads = [overhead(r) for r in runs]
    out: dict[str, Any] = {
        "epoch_s": epoch_s,
        "epoch_s_min_max": [min(r["epoch_s"] for r in runs), max(r["epoch_s"] for r in runs)],
        "phases": phases,
        "phase_medians": {p: med(r["phases"][p] for r in runs) for p in PHASES},
        "decode_s": decode_s,
        "reward_s": reward_s,
        "overlapped_s": max(0.0, decode_s + reward_s - phases["score_wait"]),
        "overhead": overhead(typical),
        "overhead_min_max": [min(overheads), max(overheads)],
        "nfe_per_traj": runs[0]["nfe_per_traj"],
        "first_ratio_max_deviation": max(r["first_ratio_max_deviation"] for r in runs),
        "rows": runs[0]["rows"],
        "peak_mib": max(r["peak_mib"] for r in runs),
        "kept_mib": max(r["kept_mib"] for r in runs),
        "runs": runs,
    }
    if flops is not None:
        model_flops = sum(flops[p] for p in MODEL_PHASES)
        model_s = sum(phases[p] for p in MODEL_PHASES)
        out["flops"] = flops
        out["flops_per_s"] = {p: flops[p] / phases[p] for p in MODEL_PHASES if phases[p] > 0}
        out["model_flops_per_s"] = model_flops / model_s if model_s else 0.0
        out["model_peak_share"] = out["model_flops_per_s"] / peak_flops
        out["epoch_flops_per_s"] = (model_flops + flops["decode"]) / epoch_s
        out["epoch_peak_share"] = out["epoch_flops_per_s"] / peak_flops
    return out


def bench_backbone(name: str, args: argparse.Namespace, peak_flops: float) -> dict[str, Any]:
    from rich.console import Console

    from tpflow.recipe import validate_recipe
    from tpflow.train.trainer import Trainer

    device = torch.device(args.device)
    base = base_recipe(name, args)
    variants = list(args.variants)
    trainers, probes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in variants:
            data = merge(base, VARIANTS[key][1])
            if data["rollout"].get("window_size") == "K":
                steps = data["rollout"]["num_steps"]
                data["rollout"].update(window_size=steps, window_range=[0, steps])
            data["train"]["run_dir"] = str(Path(tmp) / key)
            recipe = validate_recipe(data, where=f"epoch_cost {name} {key}")
            trainers[key] = trainer = Trainer(recipe, run_dir=Path(tmp) / key, console=Console(quiet=True))
            probes[key] = EpochProbe(trainer, device)
        for key in variants:  # warm-up: lazy imports, allocator growth, first-call caches
            run_epoch(trainers[key], probes[key], 0)
        runs: dict[str, list[dict]] = {key: [] for key in variants}
        for r in range(args.repeats):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for key in order:
                runs[key].append(run_epoch(trainers[key], probes[key], 1 + r))
                print(f"{name} {key} repeat {r}: {runs[key][-1]['epoch_s']:.2f} s", file=sys.stderr)
        summary = {}
        for key in variants:
            flops = None
            if args.flops:
                trainer = trainers[key]
                completions = trainer.credit.needs_completions
                n = trainer.settings.prompts_per_epoch * trainer.settings.group_size  # trajectories per epoch
                decode_rows = n * ((trainer.recipe.rollout.window_size + 1) if completions else 1)
                flops = count_flops(trainer, probes[key], 1 + args.repeats, decode_rows)
            summary[key] = summarise(runs[key], flops, peak_flops)
    return {"recipe": base, "variants": summary, "labels": {k: VARIANTS[k][0] for k in variants}}


def table(result: dict[str, Any]) -> list[str]:
    s, labels = result["variants"], result["labels"]
    flow = s["flow"]["epoch_s"] if "flow" in s else None
    lines = [
        "| variant | NFE / traj. | epoch s | rollout model (bwd) s | encode s | sampling other s | scoring wait s "
        "| decode + reward s (overlapped) | credit + adv. s | update fwd / bwd / other s | log + ckpt s | other s "
        "| **overhead** | model TFLOP/s (peak share) | peak MiB | kept MiB | × Flow |",
        "|---|" + "---|" * 16,
    ]
    for key, v in s.items():
        p = v["phases"]
        perf = f"{v['model_flops_per_s'] / 1e12:.3g} ({100 * v['model_peak_share']:.0f}%)" if "flops" in v else "–"
        ratio = f"{v['epoch_s'] / flow:.2f}" if flow else "–"
        lines.append(
            f"| {labels[key]} | {v['nfe_per_traj']:.1f} | {v['epoch_s']:.2f} | {p['sample_model']:.2f} "
            f"({p['sample_backward']:.2f}) "
            f"| {p['encode']:.2f} | {p['sample_other']:.2f} | {p['score_wait']:.2f} "
            f"| {v['decode_s'] + v['reward_s']:.2f} "
            f"({v['overlapped_s']:.2f}) | {p['credit'] + p['advantages']:.3f} | {p['update_forward']:.2f} / "
            f"{p['update_backward']:.2f} / {p['update_other']:.2f} | {p['log'] + p['checkpoint']:.3f} "
            f"| {p['other']:.3f} | **{100 * v['overhead']:.1f}%** | {perf} | {v['peak_mib']:.0f} "
            f"| {v['kept_mib']:.1f} | {ratio} |"
        )
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", nargs="+", choices=BACKBONES, default=None)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(DEFAULT_VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="sd3.5-medium-random's dtype")
    p.add_argument("--resolution", type=int, default=512, help="sd3.5-medium-random's resolution")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--set", nargs="*", default=[], help="recipe overrides for every variant: section.key=value")
    p.add_argument("--no-flops", dest="flops", action="store_false", help="skip the FLOP-counting epoch")
    p.add_argument("--tiny", action="store_true", help="K = 4, W = 2, 4 trajectories, 1 repeat: seconds")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.backbone is None:
        args.backbone = ["sd3.5-medium-random"] if args.device.startswith("cuda") else ["shapes-dit", "tiny-sd3"]
    if args.tiny:
        args.repeats = 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU.")
    _timing.tune_malloc()  # what the trainer does on CPU runs anyway
    watch_recompute()
    device = torch.device(args.device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype] if device.type == "cuda" else torch.float32
    peak = matmul_peak(device, dtype)
    command = "benchmarks/epoch_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "command": command,
        "machine": _timing.machine(device),
        "matmul_peak_flops": peak,
        "matmul_dtype": str(dtype),
        "backbones": {},
    }
    for name in args.backbone:
        result = bench_backbone(name, args, peak)
        report["backbones"][name] = result
        print(f"\n**{name}** (the median of {args.repeats} epochs; matmul peak {peak / 1e12:.3g} TFLOP/s {dtype})\n")
        print("\n".join(table(result)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
