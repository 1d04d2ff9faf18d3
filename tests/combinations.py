"""The combination matrix: every combination of options tpflow accepts trains right, or is refused before anything
loads (docs/testing.md, "The combination matrix").

A combination is one level of each factor (``FACTORS``: backbone, rollout plan, sampler, credit, optimizer, recompute
mode, precision, compiled blocks, CFG gradient, LoRA or full fine-tune, GARDO's parts, the prompt policy, the replay
buffer). Each is judged on a tiny recipe, in one process:

* **refused**: ``load_recipe`` (what ``tpflow validate`` runs) raises a ``RecipeError`` of one paragraph; or
* **accepted**: the first optimizer step's gradient is the *reference* configuration's (the same combination with
  recompute native, fp32, blocks not compiled: what every mode is an exact or rounded rewrite of) within the
  tolerance of its precision (``TOLERANCE``, on the cosine: a GradScaler's scale does not change it), and, with one
  trajectory made non-finite (a NaN row of z₀, its reward kept finite), the weights after the epoch's update are
  finite.

Sharding (FSDP2 over 2 processes) is a factor of the benchmark's matrix (benchmarks/combinations.py), not of the
suite's. A covering design (:func:`covering`: every pair of levels in at least one accepted combination where one
exists, else in a refused one) keeps the suite's share small; the benchmark runs a larger one.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

# factor -> levels; the first level of each is the reference's where the reference fixes it
FACTORS: dict[str, list[str]] = {
    "backbone": [
        "shapes-dit",
        "shapes-edit-dit",
        "tiny-sd3",
        "tiny-flux",
        "tiny-flux-kontext",
        "tiny-qwen-image-edit",
        "tiny-flux.2-klein",
        "tiny-z-image",
    ],
    "plan": ["window", "trained-fraction", "entropy-steps"],
    "sampler": ["cps", "linear-sigma", "flow-sde"],
    "credit": ["outcome", "consistent", "branch"],
    "optimizer": ["grpo", "nft", "awm", "dgpo"],
    "recompute": ["native", "retain", "reweight"],
    "precision": ["no", "bf16", "fp16"],
    "compile": ["off", "on"],
    "cfg_gradient": ["full", "conditional"],
    "finetune": ["lora", "full"],
    "gardo": ["off", "shaped", "all"],
    "prompts": ["uniform", "skip-solved", "ability-matched", "fused"],
    "replay": ["off", "on"],
}
REFERENCE = {"recompute": "native", "precision": "no", "compile": "off"}
EDITING = {"shapes-edit-dit", "tiny-flux-kontext", "tiny-qwen-image-edit"}  # they edit a source: the editing dataset
# The suite's share (tests/test_combinations.py): the embedded backbone, blocks not compiled (aot_eager compiling
# costs seconds a run); ``SUITE_ROWS`` covers every pair of its levels, accepted where an accepted row can
# (written by ``benchmarks/combinations.py --suite-rows --seed 6``: of seeds 0-19 the design whose accepted rows cost
# least by a rough per-row estimate (an fp16 or editing row trains slower), 29 rows of which 18 train; the test checks
# the coverage, so a new level fails it until the rows are written again). The editing model is the suite's second
# backbone: every pair of an editing backbone with the other levels.
SUITE_FACTORS = {
    **{k: v for k, v in FACTORS.items() if k != "compile"},
    "backbone": ["shapes-dit", "shapes-edit-dit"],
}
# fmt: off
SUITE_ROWS: list[tuple[str, ...]] = [  # in SUITE_FACTORS' order
    ("shapes-dit", "entropy-steps", "flow-sde", "branch", "grpo", "native", "no", "full", "lora", "off", "uniform",
     "off"),
    ("shapes-dit", "window", "cps", "outcome", "grpo", "native", "no", "full", "lora", "all", "uniform", "off"),
    ("shapes-dit", "window", "cps", "outcome", "nft", "native", "no", "full", "lora", "all", "uniform", "off"),
    ("shapes-dit", "window", "cps", "outcome", "awm", "native", "no", "full", "lora", "shaped", "uniform", "off"),
    ("shapes-dit", "window", "cps", "outcome", "dgpo", "native", "no", "full", "lora", "off", "skip-solved", "off"),
    ("shapes-dit", "window", "cps", "outcome", "nft", "native", "no", "full", "lora", "off", "ability-matched", "off"),
    ("shapes-dit", "window", "cps", "outcome", "grpo", "native", "no", "full", "lora", "off", "fused", "on"),
    ("shapes-dit", "trained-fraction", "linear-sigma", "outcome", "grpo", "native", "fp16", "conditional", "full",
     "shaped", "uniform", "on"),
    ("shapes-dit", "window", "cps", "consistent", "grpo", "retain", "bf16", "full", "lora", "shaped", "skip-solved",
     "off"),
    ("shapes-dit", "entropy-steps", "linear-sigma", "branch", "nft", "reweight", "bf16", "conditional", "lora", "all",
     "skip-solved", "on"),
    ("shapes-edit-dit", "window", "flow-sde", "consistent", "grpo", "reweight", "no", "conditional", "lora", "shaped",
     "ability-matched", "off"),
    ("shapes-edit-dit", "trained-fraction", "cps", "outcome", "grpo", "native", "no", "full", "lora", "off", "fused",
     "off"),
    ("shapes-edit-dit", "window", "flow-sde", "branch", "awm", "retain", "fp16", "full", "full", "all", "fused", "on"),
    ("shapes-edit-dit", "trained-fraction", "linear-sigma", "consistent", "dgpo", "retain", "bf16", "conditional",
     "full", "off", "ability-matched", "on"),
    ("shapes-edit-dit", "window", "flow-sde", "outcome", "nft", "native", "no", "full", "lora", "all", "uniform",
     "off"),
    ("shapes-edit-dit", "entropy-steps", "flow-sde", "branch", "grpo", "retain", "no", "full", "lora", "off", "fused",
     "off"),
    ("shapes-edit-dit", "window", "flow-sde", "outcome", "dgpo", "native", "no", "full", "full", "shaped",
     "skip-solved", "off"),
    ("shapes-edit-dit", "window", "cps", "outcome", "grpo", "reweight", "bf16", "conditional", "lora", "shaped",
     "fused", "off"),
    ("shapes-edit-dit", "trained-fraction", "cps", "branch", "nft", "reweight", "fp16", "full", "lora", "shaped",
     "skip-solved", "off"),
    ("shapes-edit-dit", "entropy-steps", "linear-sigma", "branch", "dgpo", "retain", "fp16", "conditional", "full",
     "all", "ability-matched", "off"),
    ("shapes-edit-dit", "window", "flow-sde", "consistent", "grpo", "native", "no", "full", "lora", "all",
     "ability-matched", "off"),
    ("shapes-dit", "trained-fraction", "linear-sigma", "consistent", "awm", "reweight", "no", "full", "full", "off",
     "uniform", "off"),
    ("shapes-edit-dit", "entropy-steps", "linear-sigma", "consistent", "nft", "retain", "fp16", "full", "full", "all",
     "fused", "on"),
    ("shapes-dit", "window", "linear-sigma", "outcome", "grpo", "retain", "bf16", "full", "lora", "shaped", "uniform",
     "off"),
    ("shapes-dit", "entropy-steps", "cps", "outcome", "awm", "retain", "fp16", "conditional", "full", "off",
     "ability-matched", "off"),
    ("shapes-dit", "trained-fraction", "flow-sde", "branch", "awm", "native", "bf16", "full", "lora", "shaped",
     "fused", "on"),
    ("shapes-edit-dit", "window", "linear-sigma", "outcome", "awm", "native", "fp16", "full", "full", "off",
     "skip-solved", "off"),
    ("shapes-dit", "trained-fraction", "linear-sigma", "branch", "dgpo", "reweight", "bf16", "full", "lora", "all",
     "fused", "off"),
    ("shapes-edit-dit", "entropy-steps", "cps", "outcome", "dgpo", "retain", "fp16", "full", "lora", "shaped",
     "uniform", "off"),
]
# fmt: on
# levels the suite must see train, not only refused (entropy-steps with branch credit, GARDO's parts on both of its
# optimizers, every prompt policy, the replay buffer): the design starts from a row of each (``covering``'s first)
MUST_TRAIN: list[dict[str, str]] = [
    {"plan": "entropy-steps", "credit": "branch", "sampler": "flow-sde"},
    {"gardo": "all", "optimizer": "grpo"},
    {"gardo": "all", "optimizer": "nft"},
    {"gardo": "shaped", "optimizer": "awm"},
    {"prompts": "skip-solved", "optimizer": "dgpo"},
    {"prompts": "ability-matched", "optimizer": "nft"},
    {"prompts": "fused", "replay": "on"},
]
# 1 − cosine of the first step's gradient to the reference's, by precision: fp32 modes differ by float rounding (a
# batched forward's matmuls; the sum order of one backward); bf16 / fp16 autocast round the forward to 8 / 11 bits
# (measured on these tiny models: benchmarks/combinations.py's table)
TOLERANCE = {"no": 1e-6, "bf16": 2e-2, "fp16": 2e-3}

_FINAL_SAMPLES = {  # the final-sample optimizers' sections, as their shipped recipes set them, at test size
    "nft": {"beta": 1.0, "kl_weight": 0.0, "num_timesteps": 4, "timesteps_per_sample": 3},
    "awm": {"kl_weight": 0.0, "num_timesteps": 4, "train_timesteps": 2, "train_guidance": 1.0},
    "dgpo": {"kl_weight": 0.0, "num_timesteps": 4, "train_timesteps": 2, "trunc_steps": 2},
}


_SAMPLERS = {  # the sampler levels other than the recipe's default (cps), as ``--set`` values
    # flow-sde with flow_grpo's Wan noise std ε = α·(σ_min + (σ_max − σ_min)·σ) (docs/algorithm.md §1.4c)
    "linear-sigma": 'sampler={name = "flow-sde", noise_schedule = "linear-sigma", sigma_max = 0.98}',
    "flow-sde": 'sampler={name = "flow-sde"}',  # Flow-GRPO's ε(σ) = α·sqrt(σ/(1 − σ)), what entropy-steps ranks
}
# GARDO's levels (docs/algorithm.md §10.9): the diversity-shaped reward alone (any optimizer), and its three parts
# (that reward of a weighted reward's parts, the gated KL ranking them, the adaptive reference) with the advantage not
# divided by a std (grpo and nft; nft with the DiffusionNFT script's fallback and moving threshold)
_RULES = ('rewards = [{name = "image-stat", label = "bright"}, {name = "image-stat", label = "saturated", '
          'weight = 0.0, options = {statistic = "saturation"}}]')  # the main part, and one ranked only  # fmt: skip
_SHAPED = 'reward={name = "diversity-shaped", reward = {name = "image-stat"}, features = "pixels"}'
_KL = {"grpo": "optimizer.beta=1e-3", "nft": "optimizer.kl_weight=1e-3"}  # the KL weight each names (others: none)
_PROMPTS = {  # [train] prompt_policy's levels; "fused": AdaGRPO's curriculum with its advantage fusion (grpo)
    "skip-solved": ['train.prompt_policy="skip-solved"'],
    "ability-matched": ['train.prompt_policy="ability-matched"', "train.prompt_candidates=2"],
    "fused": ['train.prompt_policy="ability-matched"', "train.prompt_candidates=2",
              'optimizer.advantage_fusion="running-reward"'],
}  # fmt: skip


def _gardo(level: str, optimizer: str) -> list[str]:
    """The ``--set`` overrides of a GARDO level for ``optimizer``."""
    if level == "shaped":
        return [_SHAPED]
    kl = [_KL[optimizer]] if optimizer in _KL else ["optimizer.kl_weight=1e-3"]
    out = [f'reward={{name = "diversity-shaped", reward = {{name = "weighted", options = {{{_RULES}}}}}, '
           'features = "pixels"}', *kl, "optimizer.kl_gate=true", 'optimizer.kl_gate_main="weighted/bright"',
           'optimizer.kl_gate_aux=["weighted/saturated"]', "optimizer.adaptive_reference=true",
           'optimizer.advantage_std="none"']  # fmt: skip
    return out + (
        ["optimizer.kl_gate_batch=2", "optimizer.reference_reset_kl_moves=true"] if optimizer == "nft" else []
    )


def overrides(combo: dict[str, str], weights: Path) -> list[str]:
    """The ``--set`` overrides of a combination on the tiny recipe (``recipe_text``)."""
    out = []
    if combo["backbone"] == "shapes-dit":
        out += [f'backbone={{name = "shapes-dit", weights = "{weights}", lora_init = "gaussian"}}']
    elif combo["backbone"] == "shapes-edit-dit":  # the tiny editing model written beside the tiny shapes-dit
        edit = weights.parent / "shapes_edit_dit.safetensors"
        out += [f'backbone={{name = "shapes-edit-dit", weights = "{edit}", lora_init = "gaussian"}}']
    else:
        side = 32 if combo["backbone"] in ("tiny-flux.2-klein", "tiny-qwen-image-edit") else 16  # their least
        out += [f'backbone={{name = "{combo["backbone"]}", seed = 0, resolution = {side}, lora_init = "gaussian"}}']
    if combo["backbone"] in EDITING:  # instructions on rendered source scenes (no files)
        out.append('dataset={name = "shapes-edit", test_scenes = 1}')
    if combo["finetune"] == "full":
        out.append('backbone.finetune="full"')
    if combo["compile"] == "on":
        out.append("backbone.compile_blocks=true")
    if combo["plan"] == "entropy-steps":  # on the backbone's σ grid; its siblings branch from one ODE state, each
        grid = "sd3" if combo["backbone"].startswith(("shapes", "tiny-sd3")) else "linspace"  # completed by ODE
        out += [f'plan={{name = "entropy-steps", entropy_grid = "{grid}"}}', "rollout.same_noise=true",
                'rollout.completions="ode"']  # fmt: skip
        if combo["backbone"] in ("tiny-flux", "tiny-flux-kontext"):  # FLUX on E-GRPO's grid: its static shift 3
            out.append("backbone.time_shift=3.0")
    elif combo["plan"] != "window":
        out.append(f'plan={{name = "{combo["plan"]}"}}')
    if combo["sampler"] != "cps":
        out.append(_SAMPLERS[combo["sampler"]])
    out.append(f'credit.name="{combo["credit"]}"')
    name = combo["optimizer"]
    if name != "grpo":
        table = {"name": name, "learning_rate": 1e-2, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
                 **_FINAL_SAMPLES[name]}  # fmt: skip
        out.append("optimizer={" + ", ".join(f"{k} = {_toml(v)}" for k, v in table.items()) + "}")
        out += ["rollout.noise_level=0.0", "rollout.window_size=1", "rollout.window_range=[0, 1]"]
    if combo["recompute"] != "native":
        out.append(f'optimizer.recompute="{combo["recompute"]}"')
    if combo["cfg_gradient"] != "full":
        out.append(f'optimizer.cfg_gradient="{combo["cfg_gradient"]}"')
    if combo["precision"] != "no":
        out.append(f'train.mixed_precision="{combo["precision"]}"')
    if combo.get("gardo", "off") != "off":
        out += _gardo(combo["gardo"], name)
    if combo.get("replay", "off") == "on":  # OP-GRPO's buffer (docs/training.md): epoch 1 replays epoch 0's rows
        out += ["replay.capacity=8", "replay.min_advantage=0.1"]
    return out + _PROMPTS.get(combo.get("prompts", "uniform"), [])


def _toml(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def recipe_text(run_dir: Path) -> str:
    """The tiny recipe every combination starts from: 2 prompts × 4 images in one rollout batch of 8, K = 4, a window
    of 3 steps, CFG 2, one optimizer step of 2 micro-batches of 4, no KL (reweight's condition), no EMA."""
    return f"""
[backbone]
name = "shapes-dit"
[reward]
name = "image-stat"
[dataset]
name = "shapes"
test_size = 6
[credit]
name = "outcome"
[optimizer]
name = "grpo"
learning_rate = 1e-2
beta = 0.0
clip_range = 0.2
micro_batch_size = 4
gradient_accumulation_steps = 2
[rollout]
num_steps = 4
window_size = 3
window_range = [0, 3]
guidance = 2.0
[train]
epochs = 1
prompts_per_epoch = 2
group_size = 4
rollout_batch = 8
save_every = 0
ema = false
run_dir = "{run_dir}"
[eval]
every = 0
"""


@dataclass
class Outcome:
    combo: dict[str, str]
    status: str  # "refused", "accepted", or "FAILED"
    detail: str = ""  # the refusal's paragraph, or what failed
    distance: float | None = None  # 1 − cosine to the reference's first-step gradient
    finite: bool | None = None  # the weights after an update with one non-finite trajectory
    notes: list[str] = field(default_factory=list)


class _FirstStep(Exception):
    """Raised by the captured optimizer step: the gradient is taken, the rest of the epoch is not needed."""


@contextlib.contextmanager
def _fast_compile():
    """``compile_blocks`` through AOTAutograd without inductor's code generation (minutes on a CPU): what the mode's
    assumptions rest on (hooks and autograd inside a compiled region) is the same."""
    compile_ = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, *a, **k: compile_(self, backend="aot_eager")
    try:
        yield
    finally:
        torch.nn.Module.compile = compile_
        torch._dynamo.reset()


def _poisoned(backbone) -> None:
    """Trajectory 0's z₀ NaN from now on, in every rollout of ``backbone``."""
    noise = backbone.initial_noise

    def poisoned(n, generator=None):
        z = noise(n, generator)
        z[0] = float("nan")
        return z

    backbone.initial_noise = poisoned


def run_combination(recipe_path: Path, sets: list[str], nonfinite: bool = True) -> tuple[torch.Tensor, bool | None]:
    """One trainer of the recipe with ``sets``: its first optimizer step's gradient (flattened, float64; the epoch
    stopped there), then, with ``nonfinite``, whether every trainable weight is finite after a whole epoch in which
    trajectory 0's z₀ is NaN (its reward computed on the image with NaN read as 0, so the trainer's reward check lets
    the rollout through to the update)."""
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    runs = recipe_path.parent / "runs"  # a run dir each: an earlier trainer's lock may outlive it until collected
    runs.mkdir(exist_ok=True)
    run_dir = runs / str(sum(1 for _ in runs.iterdir()))
    with _fast_compile():
        trainer = Trainer(load_recipe(recipe_path, [*sets, f"train.run_dir={run_dir}"]))
        params = list(trainer.backbone.trainable_parameters())
        grads: list[torch.Tensor] = []
        step = trainer.optimizer.loop._step

        def capture(rows, totals):
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double()
                                    .flatten() for p in params]))  # fmt: skip
            raise _FirstStep

        trainer.optimizer.loop._step = capture
        with contextlib.suppress(_FirstStep):
            trainer.train_epoch(0)
        if not grads:
            raise AssertionError("no optimizer step was reached")
        if not nonfinite:
            return grads[0], None
        for p in params:
            p.grad = None
        trainer.optimizer.loop._step = step
        reward = trainer.reward
        trainer.reward = _Wrapped(reward, lambda images, *rest: reward(torch.nan_to_num(images, nan=0.0), *rest))
        _poisoned(trainer.backbone)
        trainer.train_epoch(1)
        return grads[0], all(bool(torch.isfinite(p).all()) for p in trainer.backbone.trainable_parameters())


class _Wrapped:
    """A reward whose call is replaced, its other attributes (capabilities, names) the wrapped one's."""

    def __init__(self, inner, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def judge(combo: dict[str, str], recipe_path: Path, weights: Path, cache: dict) -> Outcome:
    """Refused in one paragraph, or accepted with the reference's gradient and finite weights (module docstring)."""
    from tpflow.errors import RecipeError
    from tpflow.recipe import load_recipe

    sets = overrides(combo, weights)
    try:
        load_recipe(recipe_path, sets)
    except RecipeError as error:
        text = str(error).strip()
        ok = "\n\n" not in text and "Traceback" not in text
        return Outcome(combo, "refused" if ok else "FAILED", text if ok else f"not one paragraph: {text}")
    reference = {**combo, **REFERENCE}
    key = tuple(sorted(reference.items()))
    try:  # accepted: anything raised from here on is a failure (the check should have refused it)
        if key not in cache:
            cache[key] = run_combination(recipe_path, overrides(reference, weights), nonfinite=reference == combo)
        ref, finite = cache[key]
        if reference != combo or finite is None:
            grad, finite = run_combination(recipe_path, sets)
        else:
            grad = ref
    except Exception as error:  # noqa: BLE001 - reported as the combination's failure
        return Outcome(combo, "FAILED", f"accepted by the check, then raised {type(error).__name__}: {error}")
    distance = 1.0 - float(torch.nn.functional.cosine_similarity(grad, ref, dim=0))
    tolerance = TOLERANCE[combo["precision"]]
    bad = []
    if not distance <= tolerance:
        bad.append(f"gradient 1 − cos {distance:.2e} > {tolerance:g}")
    if float(ref.norm()) == 0:
        bad.append("the reference's gradient is zero")
    if not finite:
        bad.append("non-finite weights after one non-finite trajectory")
    return Outcome(combo, "FAILED" if bad else "accepted", "; ".join(bad), distance, finite)


def covering(
    factors: dict[str, list[str]], accepted, seed: int = 0, tries: int = 60, first: list[dict[str, str]] = (),
) -> list[dict[str, str]]:  # fmt: skip
    """A pairwise covering design: rows (one level per factor) such that every pair of levels of two factors is in
    some row; greedy (AETG-like), each new row the candidate covering most uncovered pairs, an ``accepted(row)`` one
    preferred (a pair no accepted candidate covers is covered by a refused one). The design starts from ``first``:
    each a few levels, the others every factor's first (the levels that go with most others), so that what few
    accepted rows can hold is not left to chance. Deterministic in ``seed``."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in factors[a] for y in factors[b]}
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []

    def pairs(row):
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    for levels in first:
        rows.append({n: levels.get(n, factors[n][0]) for n in names})
        uncovered -= pairs(rows[-1])

    while uncovered:
        target = sorted(uncovered)[0]
        best, best_score = None, -1.0
        for _ in range(tries):
            row = {n: rng.choice(factors[n]) for n in names}
            (a, x), (b, y) = target
            row[a], row[b] = x, y  # every row covers at least one new pair
            new = len(pairs(row) & uncovered)
            score = new + (1000 if accepted(row) else 0)
            if score > best_score:
                best, best_score = row, score
        rows.append(best)
        uncovered -= pairs(best)
    return rows
