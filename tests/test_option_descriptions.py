"""Every option field of the built-in components is described, and described once per kind: a name two components
of one kind declare reads the same in both (`tpflow components` shows one meaning per name), unless it is on the
allow-list below, where the name means another thing in each component. A shared field takes its text from one
place (tpflow/backbones/option_help.py, tpflow/rewards/option_help.py, tpflow/optim/options.py, ...)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tpflow import registry

# (kind, field): why the components that declare it describe it apart
ALLOWED: dict[tuple[str, str], str] = {
    # a different model family per reward: an open_clip architecture (clipscore, temporal-consistency, hpsv2), a
    # Hugging Face id or folder of PickScore weights (pickscore), of a vision-language judge (vlm-judge)
    ("reward", "model"): "names a different model family in each reward",
    # a different file per reward: HPS v2.1's .pt, HPSv3's whole-model safetensors, ImageReward's .pt state dict
    ("reward", "checkpoint"): "a different checkpoint file format per reward",
    # frames applies the named image reward to each frame; remote checks that its server serves the named reward;
    # diversity-shaped wraps an inner {name, options} spec whose scores it shapes
    ("reward", "reward"): "the reward each wrapper names plays a different role in it",
    # diversity-shaped: the spec string of the extractor a group's images are compared by; edit-consistency: which of
    # its three comparisons (pixels, CLIP, DINO) an edit and its source are compared by
    ("reward", "features"): "what an image is compared by, in two different comparisons",
}


def _builtin(kind: str) -> dict[str, type[BaseModel]]:
    """The option models of the kind's built-in components (a test's or a plugin's are their authors' own)."""
    entries = {name: registry.get(kind, name) for name in registry.names(kind)}
    return {name: e.options for name, e in entries.items() if e.qualname.startswith("tpflow.")}


def descriptions(models: dict[str, type[BaseModel]]) -> dict[str, dict[str | None, list[str]]]:
    """field -> its description -> the components that declare it with that description."""
    by_field: dict[str, dict[str | None, list[str]]] = {}
    for name, model in models.items():
        for field, info in model.model_fields.items():
            by_field.setdefault(field, {}).setdefault(info.description, []).append(name)
    return by_field


def described_apart(models: dict[str, type[BaseModel]]) -> dict[str, dict[str | None, list[str]]]:
    """The fields declared with more than one description."""
    return {field: texts for field, texts in descriptions(models).items() if len(texts) > 1}


@pytest.mark.parametrize("kind", registry.KINDS)
def test_no_field_is_described_two_ways_within_a_kind(kind):
    models = _builtin(kind)
    assert models, f"no built-in {kind}"
    apart = {f: texts for f, texts in described_apart(models).items() if (kind, f) not in ALLOWED}
    report = [
        f"{kind}.{field}: " + " | ".join(f"{names}: {text!r}" for text, names in texts.items())
        for field, texts in apart.items()
    ]
    assert not report, (
        "one description per option name per kind: take the shared text from the kind's option_help module (or "
        "the base options model), or add the name to ALLOWED with why it differs\n" + "\n".join(report)
    )


@pytest.mark.parametrize("kind", registry.KINDS)
def test_every_field_has_a_description(kind):
    bare = [f"{name}.{field}" for name, model in _builtin(kind).items() for field, info in model.model_fields.items()
            if not (info.description or "").strip()]  # fmt: skip
    assert not bare, f"{kind} option fields without a description: {bare}"


def test_every_allowed_name_is_still_described_apart():
    """The allow-list cannot go stale: each entry is a name still declared by two components with two texts."""
    for kind, field in ALLOWED:
        assert field in described_apart(_builtin(kind)), f"{kind}.{field} is described once now: drop it from ALLOWED"


def test_the_names_each_kind_shares_are_there():
    """The shared names this file guards are still declared by several components (the check is not vacuous)."""
    shared = {
        "backbone": {"lora_alpha", "lora_targets", "device", "dtype", "resolution", "flow_shift"},
        "reward": {"device", "dtype", "batch_size", "max_pixels", "clip_model"},
        "credit": {"first_step"},
        "dataset": {"path", "test_path", "seed", "test_size"},
        "optimizer": {"learning_rate", "kl_weight", "old_decay_max", "beta"},
    }
    for kind, fields in shared.items():
        seen = descriptions(_builtin(kind))
        assert {f for f in fields if sum(len(n) for n in seen.get(f, {}).values()) > 1} == fields, kind


def test_two_descriptions_of_one_name_are_found():
    class A(BaseModel):
        device: str = Field("cpu", description="Torch device.")
        seed: int = Field(0, description="Seed.")

    class B(BaseModel):
        device: str = Field("auto", description="Torch device of the model.")
        seed: int = Field(1, description="Seed.")

    assert described_apart({"a": A, "b": B}) == {
        "device": {"Torch device.": ["a"], "Torch device of the model.": ["b"]}
    }
