"""The example plugin package (plugins/tpflow-example-reward) installs with pip, is discovered, and trains.

pip builds the package from a copy of its folder (so no build/ or egg-info lands in the checkout) and installs it
offline with ``--target`` into a temporary directory that this test puts on the path: the same entry-point discovery
as site-packages, while the shared environment stays exactly as it was, even if the test is interrupted.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_run import tpflow
from tests.test_train import tiny_recipe
from tpflow import registry
from tpflow.recipe import load_recipe
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

PLUGIN = Path(__file__).resolve().parent.parent / "plugins" / "tpflow-example-reward"


def _run(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The plugin pip-installed into tmp_path/site, on sys.path here and on PYTHONPATH for subprocesses."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment: pip cannot build the plugin offline.")
    source = shutil.copytree(
        PLUGIN, tmp_path / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "COLUMNS": "200"}
    out = _run(*pip, "--target", str(site), str(source), env=env)
    assert out.returncode == 0, out.stderr
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    registry.refresh_plugins()
    yield source, site, {**env, "PYTHONPATH": os.environ["PYTHONPATH"]}
    for module in [m for m in sys.modules if m.split(".")[0] == "tpflow_example_reward"]:
        del sys.modules[module]
    monkeypatch.undo()
    importlib.invalidate_caches()
    registry.refresh_plugins()


def test_installed_plugin_is_listed_passes_its_tests_and_trains(installed, tmp_path, tiny_weights):
    source, site, env = installed
    assert (site / "tpflow_example_reward" / "saturation.py").is_file()
    listing = tpflow("components", "reward")  # in this process: the entry point read from the installed metadata
    assert listing.returncode == 0, listing.stderr
    assert "example-saturation" in listing.stdout and "plugin tpflow-example-reward 0.1.0" in listing.stdout
    assert "target" in listing.stdout and "failed to load" not in listing.stdout
    # In process: discovered through its entry point (before anything imports it by hand).
    entry = registry.get("reward", "example-saturation")
    assert entry.source == "plugin tpflow-example-reward 0.1.0"
    assert Path(sys.modules[entry.factory.__module__].__file__).is_relative_to(site)
    # The package's own tests, run here against the installed copy (pytest does not collect plugins/ by itself).
    spec = importlib.util.spec_from_file_location(
        "tpflow_example_reward_tests", source / "tests" / "test_example_saturation.py"
    )
    own_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own_tests)
    tests = [getattr(own_tests, name) for name in dir(own_tests) if name.startswith("test_")]
    assert len(tests) >= 2
    for test in tests:
        test()  # none takes fixtures
    # One shapes epoch with it, from a recipe.
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="example-saturation", extra='[sampler]\nname = "cps"\n')
    settings = ["rollout.noise_level=0.7", "train.epochs=1", "eval.every=0"]  # sampler as in recipes/shapes_tp.toml
    loaded = load_recipe(recipe, [*settings, "reward.target=0.2"])
    assert loaded.components["reward"].options.target == 0.2
    trainer = Trainer(loaded)
    metrics = trainer.fit()
    epochs = [line for line in read_jsonl(trainer.run_dir / "metrics.jsonl") if "reward_mean" in line]
    assert [line["epoch"] for line in epochs] == [0]
    assert -0.8 <= epochs[0]["reward_mean"] <= 0.0  # -|saturation - 0.2| with saturation in [0, 1]
    assert metrics["optimizer_steps"] >= 1
