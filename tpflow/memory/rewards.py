"""The reward models' weights a training process holds on its GPU, from a stated table of published checkpoint sizes.

Why a table: the memory estimate runs before any weights are downloaded (and on machines without them), and the
reward models are not built on fake tensors like the backbone. Each reward the recipe names is looked up by its
registered name and its options: the models it loads (the architecture its options name), their parameter counts
as published (the source beside each), and the dtype its code loads them in (its ``dtype`` option where it has one,
float32 otherwise: open_clip, Mask2Former and ImageReward load in float32). Counted: the trained reward, the watched
ones (``[eval] rewards``: built at the first evaluation, then kept) and the diversity embedding (``[eval]
diversity``), each once per process (every process builds its own), on the GPU unless its ``device`` option puts it
on the CPU. Not counted: their activations while scoring (short, in the scoring thread), and a reward this table
does not know (a plugin, an architecture not listed): ``reward_models`` says so in a note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Published parameter counts (all parameters the reward's code loads onto its device).
OPEN_CLIP = {  # open_clip architectures, image and text towers (open_clip's docs/model_profile.csv)
    "ViT-B-32": 151.28e6,
    "ViT-B-16": 149.62e6,
    "ViT-L-14": 427.62e6,
    "ViT-L-14-quickgelu": 427.62e6,
    "ViT-L-14-336": 427.94e6,
    "ViT-H-14": 986.11e6,
    "ViT-g-14": 1366.68e6,
    "ViT-bigG-14": 2539.57e6,
}
MASK2FORMER_SWIN_S = 69e6  # Mask2Former Swin-S (Cheng et al. 2022, Table 2: 69 M; GenEval's COCO instance model)
PICKSCORE_V1 = 986.11e6  # yuvalkirstain/PickScore_v1: CLIP ViT-H-14 (laion2B) fine-tuned, the same architecture
IMAGEREWARD = 447e6  # THUDM/ImageReward: BLIP ViT-L/16, BERT-base with cross-attention, MLP (ImageReward.pt: 1.8 GB)
HPSV3 = 7.7e9  # MizzenAI/HPSv3: Qwen2-VL-7B without its unused lm_head, plus a small head (docs/rewards.md)
UNIFIED_REWARD_QWEN_7B = 8.29e9  # CodeGoat24/UnifiedReward-qwen-7b: Qwen2.5-VL-7B-Instruct, 8.29 B
AESTHETIC_HEAD = 0.92e6  # the LAION aesthetic MLP head on CLIP-L's 768-d embedding (768-1024-128-64-16-1)
DINO = {  # DINOv2 (Oquab et al. 2023, Table 1: ViT-S/B/L/g 21 M / 86 M / 300 M / 1.1 B) by the model id's end
    "dinov2-small": 21e6,
    "dinov2-base": 86e6,
    "dinov2-large": 300e6,
    "dinov2-giant": 1.1e9,
}


@dataclass(frozen=True)
class Resident:
    """One reward model held on the GPU: what it is, its parameters and bytes per parameter (0 bytes: off the GPU)."""

    what: str  # e.g. "reward 'geneval': Mask2Former Swin-S"
    params: float
    nbytes: int
    note: str  # dtype and where the size comes from


@dataclass
class RewardModels:
    """The reward models of a recipe on one process's GPU, and what the table could not count."""

    models: list[Resident]
    notes: list[str]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.models)


def _options(name: str, options: Any) -> Any:
    """The reward's validated options (defaults filled in) from a dict or an options model."""
    from tpflow import registry

    model = registry.get("reward", name).options
    if model is None:
        return options
    return options if isinstance(options, model) else model.model_validate(dict(options or {}))


def _on_cpu(options: Any) -> bool:
    return str(getattr(options, "device", "auto") or "auto").startswith("cpu")


def _open_clip(what: str, arch: str, notes: list[str]) -> list[tuple[str, float, str]]:
    if arch not in OPEN_CLIP:
        notes.append(f"{what}: open_clip architecture {arch!r} is not in the table of published sizes; not counted")
        return []
    return [(f"open_clip {arch}", OPEN_CLIP[arch], "float32")]


def _edit_consistency(options: Any, notes: list[str]) -> list[tuple[str, float, str]]:
    """edit-consistency's feature model: an open_clip tower pair, a DINO backbone, or none (pixel)."""
    if options.features == "pixel":
        return []
    if options.features == "clip":
        return _open_clip("reward 'edit-consistency'", options.model_name, notes)
    size = DINO.get(options.model_name.rstrip("/").rsplit("/", 1)[-1])
    if size is None:
        notes.append(f"reward 'edit-consistency': {options.model_name!r} is not in the table of published sizes")
        return []
    return [(options.model_name, size, "float32")]


def _judge(options: Any, notes: list[str]) -> list[tuple[str, float, str]]:
    if options.model.rstrip("/").endswith("UnifiedReward-qwen-7b"):
        return [("UnifiedReward-qwen-7b (Qwen2.5-VL-7B)", UNIFIED_REWARD_QWEN_7B, options.dtype)]
    notes.append(f"reward 'vlm-judge': judge {options.model!r} is not in the table of published sizes; not counted")
    return []


# Reward name -> (options, notes) -> the models it loads: (model, parameters, dtype). A reward whose models are not
# on the GPU, or have no weights, returns []; one that wraps others is resolved by ``_resident``.
TABLE: dict[str, Callable[[Any, list[str]], list[tuple[str, float, str]]]] = {
    "geneval": lambda o, n: [] if o.detector != "mask2former" else [
        ("Mask2Former Swin-S", MASK2FORMER_SWIN_S, "float32"), *_open_clip("reward 'geneval'", o.clip_model, n)],
    "pickscore": lambda o, n: [("PickScore_v1 (CLIP ViT-H-14)", PICKSCORE_V1, o.dtype)],
    "clipscore": lambda o, n: _open_clip("reward 'clipscore'", o.model, n),
    "temporal-consistency": lambda o, n: _open_clip("reward 'temporal-consistency'", o.model, n),
    "aesthetic": lambda o, n: [*_open_clip("reward 'aesthetic'", o.clip_model, n),
                               ("aesthetic MLP head", AESTHETIC_HEAD, "float32")],
    "hpsv2": lambda o, n: _open_clip("reward 'hpsv2'", o.model, n),
    "hpsv3": lambda o, n: [("HPSv3 (Qwen2-VL-7B)", HPSV3, o.dtype)],
    "imagereward": lambda o, n: [("ImageReward (BLIP)", IMAGEREWARD, "float32")],
    "vlm-judge": lambda o, n: _judge(o, n),
    "edit-consistency": lambda o, n: _edit_consistency(o, n),
    # no model on the training GPU: rule-based or embedded tiny models (a few MB at most), the CPU, another machine
    "image-stat": lambda o, n: [],
    "shapes-geneval": lambda o, n: [],
    "shapes-video": lambda o, n: [],
    "shapes-edit": lambda o, n: [],
    "shapes-clip": lambda o, n: [],
    "ocr": lambda o, n: [],
    "remote": lambda o, n: [],
}  # fmt: skip
WRAPPERS = {  # rewards that hold other rewards: their (name, options) pairs
    "weighted": lambda o: [(part.name, part.options) for part in o.rewards],
    "frames": lambda o: [(o.reward, o.options)],
    "pairwise": lambda o: [(o.judge.name, o.judge.options)],
}


def _resident(name: str, options: Any, role: str, notes: list[str]) -> list[Resident]:
    """The models of reward ``name`` (``role``: where the recipe names it), wrappers resolved."""
    if name in WRAPPERS:
        opts = _options(name, options)
        return [r for inner, o in WRAPPERS[name](opts) for r in _resident(inner, o, f"{role} ({name})", notes)]
    if name not in TABLE:
        notes.append(f"{role} {name!r}: its models are not in the table of published sizes; not counted")
        return []
    opts = _options(name, options)
    found = TABLE[name](opts, notes)
    if found and _on_cpu(opts):
        notes.append(f"{role} {name!r} runs on the CPU (its device option): not counted on the GPU")
        return []
    return [Resident(f"{role} {name!r}: {model}", params, int(params * BYTES[dtype]),
                     f"{dtype}; published size") for model, params, dtype in found]  # fmt: skip


def _diversity(spec: str | None, notes: list[str]) -> list[Resident]:
    """``[eval] diversity``'s embedding: an open_clip image tower is held whole (``clip:<arch>[:<pretrained>]``)."""
    if not spec or not spec.startswith("clip:"):
        return []  # "pixels" has no model; "shapes-clip" is the embedded tiny CLIP
    arch = spec.split(":")[1]
    return [Resident(f"eval.diversity: open_clip {arch}", p, int(p * 4), "float32; published size")
            for _, p, _ in _open_clip("eval.diversity", arch, notes)]  # fmt: skip


def reward_models(recipe: Any) -> RewardModels:
    """The reward models a process of ``recipe`` holds on its GPU: the trained reward, the watched ones, the
    diversity embedding (module docstring)."""
    notes: list[str] = []
    models = _resident(recipe.reward.name, recipe.reward.options, "reward", notes)
    evaluation = recipe.eval
    for watched in evaluation.rewards:
        models += _resident(watched.name, watched.options, "eval.rewards", notes)
    models += _diversity(evaluation.diversity, notes)
    return RewardModels(models, notes)
