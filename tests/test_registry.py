"""Registry: built-ins, plugins by entry point, duplicate and unknown names, option validation."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import tpflow
from tpflow import registry
from tpflow.errors import DuplicateComponentError, UnknownComponentError, UserError


@pytest.fixture
def scratch_names():
    """Remove components a test registers under throwaway names."""
    added: list[tuple[str, str]] = []
    yield added
    for kind, name in added:
        registry._entries[kind].pop(name, None)


def test_builtin_kinds_are_registered():
    assert registry.names("credit") == ["branch", "consistent", "incremental", "outcome", "turning_point"]
    assert {"cps", "flow-sde"} <= set(registry.names("sampler"))
    assert "grpo" in registry.names("optimizer")
    plans = ["branch", "dpm-solver", "entropy-steps", "sa-solver", "trained-fraction", "window", "window-per-image",
             "window-schedule"]  # fmt: skip
    assert registry.names("plan") == plans
    assert {"text-file", "jsonl"} <= set(registry.names("dataset"))
    entry = registry.get("credit", "turning_point")
    assert entry.source == "tpflow"
    assert entry.origin.split(":")[0].endswith("tpflow/credit/turning_point.py")


def test_every_builtin_option_is_described():
    """STYLE.md rule 6: every option is described. A subclass that redefines a field (a backbone's own lora_targets
    default) loses the parent's description unless it gives one."""
    package = Path(tpflow.__file__).resolve().parent  # built in: defined in the package (a benchmark may add its own)
    undescribed = [
        f"{kind} {entry.name}: {field}"
        for kind in registry.KINDS
        for entry in registry.entries(kind)
        if entry.source == "tpflow" and Path(entry.origin.rsplit(":", 1)[0]).resolve().is_relative_to(package)
        for field, info in entry.options.model_fields.items()
        if not info.description
    ]
    assert not undescribed, undescribed


def test_build_validates_options_and_passes_them():
    assigner = tpflow.build("credit", "turning_point", balanced=False)
    assert assigner.needs_completions
    with pytest.raises(UserError) as info:
        tpflow.build("credit", "turning_point", balance=False)
    message = str(info.value)
    assert "unknown option 'balance'" in message and "did you mean 'balanced'" in message
    assert "Allowed options: balanced, first_step" in message
    with pytest.raises(UserError, match="option 'balanced'"):
        tpflow.build("credit", "turning_point", balanced="sometimes")


def test_unknown_name_lists_available_and_suggests():
    with pytest.raises(UnknownComponentError) as info:
        tpflow.build("credit", "turning-point")
    message = str(info.value)
    assert "Did you mean 'turning_point'?" in message
    assert "Available: branch, consistent, incremental, outcome, turning_point." in message
    with pytest.raises(UnknownComponentError) as info:
        registry.get("sampler", "zzz")
    assert "Did you mean" not in str(info.value) and "cps" in str(info.value)


def test_unknown_kind():
    with pytest.raises(UserError, match="Kinds are: backbone, sampler, plan, reward, credit, optimizer, dataset"):
        registry.names("rewards")


def test_duplicate_name_raises_with_first_location(scratch_names):
    with pytest.raises(DuplicateComponentError) as info:

        @registry.register("credit", "incremental")
        class Another:  # noqa: F841 - registration is the point
            pass

    message = str(info.value)
    assert "registered twice" in message
    assert "tpflow/credit/incremental.py" in message  # where the first one lives
    assert "test_registry.py" in message  # and the second


def test_reregistering_the_same_definition_is_idempotent(scratch_names):
    class Opts(BaseModel):
        model_config = ConfigDict(extra="forbid")
        k: int = 1

    def factory(options):
        return options.k * 2

    scratch_names.append(("optimizer", "scratch-double"))
    registry.register("optimizer", "scratch-double", options=Opts)(factory)
    registry.register("optimizer", "scratch-double", options=Opts)(factory)
    assert tpflow.build("optimizer", "scratch-double", k=4) == 8


def test_options_model_must_forbid_extra():
    class Loose(BaseModel):
        x: int = 0

    with pytest.raises(TypeError, match="extra='forbid'"):
        registry.register("reward", "scratch-loose", options=Loose)(lambda options: None)


def test_plugin_is_discovered_and_buildable(plugin):
    assert "brightness" in registry.names("reward")
    entry = registry.get("reward", "brightness")
    assert entry.source == "plugin tpflow_brightness 0.3.1"
    reward = tpflow.build("reward", "brightness", scale=2.0)
    images = torch.full((3, 3, 4, 4), 0.25)
    assert torch.allclose(reward(images, ["a"] * 3, [{}] * 3).scores, torch.full((3,), 0.5))
    with pytest.raises(UserError, match="unknown option 'scal'"):
        tpflow.build("reward", "brightness", scal=2.0)
    assert "plugin-backbone" in registry.names("backbone")


def test_broken_plugin_is_reported_not_fatal(plugin):
    info = next(plugin.glob("*.dist-info"))
    with (info / "entry_points.txt").open("a") as f:
        f.write("\n[tpflow.credit]\nbroken = no_such_module_xyz:Thing\n")
    registry.refresh_plugins()
    assert "turning_point" in registry.names("credit")
    errors = registry.plugin_errors("credit")
    assert len(errors) == 1 and "no_such_module_xyz" in errors[0]
    with pytest.raises(UnknownComponentError, match="Plugins that failed to load: broken"):
        registry.get("credit", "broken")


def test_plugin_clashing_with_builtin_raises(plugin):
    info = next(plugin.glob("*.dist-info"))
    with (info / "entry_points.txt").open("a") as f:
        f.write("\n[tpflow.sampler]\ncps = tpflow_brightness_mod:BrightnessReward\n")
    registry.refresh_plugins()
    with pytest.raises(DuplicateComponentError, match="tpflow/samplers/cps.py"):
        registry.names("sampler")


BROKEN_BUILTIN = """
from tpflow.registry import register


def _helper():
    raise ImportError("No module named 'some_dependency'")


_helper()  # fails on import, before it registers anything


@register("credit", "never-registered")
class NeverRegistered:
    pass
"""


def test_a_builtin_module_that_fails_to_import_fails_every_lookup_with_its_error(tmp_path, monkeypatch):
    """Not 'unknown component' on the second lookup: each lookup of the kind re-raises the import error, with its
    traceback (a broken install or a bug, not a user's mistake) and a note naming the module."""
    (tmp_path / "tpflow_broken_builtin.py").write_text(BROKEN_BUILTIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry._BUILTIN_MODULES, "credit", ("tpflow.credit", "tpflow_broken_builtin"))
    monkeypatch.setattr(registry, "_builtins_loaded", set())
    for _ in range(2):
        with pytest.raises(ImportError, match="some_dependency") as info:
            registry.get("credit", "never-registered")
        assert not isinstance(info.value, UserError)
        assert "_helper" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
        assert any("tpflow_broken_builtin" in note for note in getattr(info.value, "__notes__", []))
    monkeypatch.undo()  # the real modules again: the kind loads
    registry._builtins_loaded.discard("credit")
    assert "turning_point" in registry.names("credit")
