"""Shared fixtures: the ``device`` fixture of the GPU suite, and a third-party plugin package installed into a
temporary sys.path entry through its metadata.

GPU suite (docs/testing.md): a test marked ``gpu`` needs CUDA and is skipped without it, but it is always collected,
so ``make test`` proves it still imports. A test that takes the ``device`` fixture runs twice, on ``"cpu"`` and, marked
``gpu``, on ``"cuda"``: the GPU suite (``pytest -m gpu``) runs what the CPU suite proves. ``TPFLOW_GPU_TESTS_ON_CPU=1``
runs the ``gpu`` tests on the CPU instead (``device`` is then ``"cpu"``): it checks the suite's own code on a machine
without a GPU; it proves nothing about CUDA.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tpflow import registry

GPU_ON_CPU = os.environ.get("TPFLOW_GPU_TESTS_ON_CPU") == "1"  # dry-run the GPU suite on the CPU
# The environment before any test ran. Libraries imported by earlier tests write into this process's os.environ (cv2
# prepends its bundled lib64 to LD_LIBRARY_PATH, W&B leaves WANDB_SERVICE naming its service socket); a long-lived
# subprocess started from here late in the suite inherited them, and `tpflow serve-reward` then failed to exit on
# Ctrl-C within 20 s in 2 of 3 full runs (never alone). Subprocesses that must behave as on a user's machine start
# from this snapshot.
SESSION_ENV: dict[str, str] = dict(os.environ)


def cuda_or_skip() -> str:
    """The device a ``gpu`` test runs on: "cuda", or "cpu" under TPFLOW_GPU_TESTS_ON_CPU=1; skips otherwise."""
    if torch.cuda.is_available():
        return "cuda"
    if GPU_ON_CPU:
        return "cpu"
    pytest.skip("needs CUDA (TPFLOW_GPU_TESTS_ON_CPU=1 dry-runs the GPU suite on the CPU)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``gpu`` where there is no CUDA (unless the GPU suite is dry-run on the CPU)."""
    if torch.cuda.is_available() or GPU_ON_CPU:
        return
    skip = pytest.mark.skip(reason="needs CUDA (TPFLOW_GPU_TESTS_ON_CPU=1 dry-runs the GPU suite on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Run the test on the CPU and, in the GPU suite, on CUDA."""
    return cuda_or_skip() if request.param == "cuda" else "cpu"


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """IEEE float32 matmuls and cuDNN convolutions (no TF32) inside the block; the previous settings after.

    Uses ``set_float32_matmul_precision`` and the cuDNN ``allow_tf32`` flag only: torch >= 2.9 raises on reading the
    legacy cuDNN flag once its new ``fp32_precision`` API has set conv and rnn, and ``cudnn.flags()`` reads it.
    """
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = conv


@pytest.fixture(autouse=True)
def torch_threads_restored() -> Iterator[None]:
    """torch's thread count as it was before the test: a command run in this process (``tpflow shapes pretrain`` sets
    one thread per core) must not leave more threads to the tests after it, whose timing they would change and whose
    processes forked from this one would wait for OpenMP threads that a fork does not copy."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """IEEE float32 on CUDA for the test (``exact_fp32``): PyTorch lets cuDNN convolutions use TF32 by default, whose
    10-bit mantissa alone moves a CPU-vs-CUDA comparison by about 1e-3."""
    with exact_fp32():
        yield


@pytest.fixture
def cuda() -> str:
    """For tests marked ``gpu`` that only make sense on CUDA (CPU vs CUDA equality, fp16/bf16 autocast)."""
    return cuda_or_skip()


PLUGIN_MODULE = textwrap.dedent(
    '''
    """A third-party tpflow plugin, as a user would write it."""
    import torch
    from pydantic import BaseModel, ConfigDict, Field

    from tpflow.types import RewardOutput


    class BrightnessReward:
        """RewardModel: mean brightness of the image, times a scale."""

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            scale: float = Field(1.0, description="Multiplies the score.")

        def __init__(self, options):
            self.scale = options.scale

        def __call__(self, images, prompts, metadata):
            return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)) * self.scale)


    class PluginBackboneOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        resolution: int = Field(32, ge=8, description="Image side in pixels.")


    class PluginBackbone:
        """Registered only so that recipes can be validated before tpflow ships a backbone; never built."""

        Options = PluginBackboneOptions

        def __init__(self, options):
            self.options = options
    '''
)


def write_plugin(root: Path, dist: str = "tpflow_brightness", version: str = "0.3.1") -> Path:
    """Write a module plus a ``.dist-info`` with entry points into ``root``; return ``root`` (a sys.path entry)."""
    root.mkdir(parents=True, exist_ok=True)
    module = f"{dist}_mod"
    (root / f"{module}.py").write_text(PLUGIN_MODULE)
    info = root / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[tpflow.rewards]\nbrightness = {module}:BrightnessReward\n\n"
        f"[tpflow.backbone]\nplugin-backbone = {module}:PluginBackbone\n"
    )
    return root


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The plugin on sys.path for this test (in process), and PYTHONPATH for subprocesses."""
    root = write_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    registry.refresh_plugins()
    yield root
    sys.modules.pop("tpflow_brightness_mod", None)
    monkeypatch.undo()
    registry.refresh_plugins()


def write_tiny_weights(folder: Path) -> Path:
    """A tiny random shapes-dit (width 32, one block) saved in ``folder``, its zero-initialised layers perturbed (the
    ``tiny_weights`` fixture's; benchmarks/combinations.py writes the same), and its editing twin (the same sizes, a
    ShapesEditDiT) beside it as ``EDIT_WEIGHTS``, which the combination matrix's ``shapes-edit-dit`` level loads."""
    import torch

    from tpflow.shapes.edit_model import ShapesEditConfig, ShapesEditDiT
    from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig, save_checkpoint

    sizes = {"width": 32, "depth": 1, "heads": 2, "text_width": 32, "text_layers": 1}
    for model_class, config, file in (
        (ShapesEditDiT, ShapesEditConfig(**sizes), EDIT_WEIGHTS),
        (ShapesDiT, ShapesDiTConfig(**sizes), "shapes_dit.safetensors"),
    ):
        torch.manual_seed(1)
        model = model_class(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        path = save_checkpoint(model, folder / file)
    return path


EDIT_WEIGHTS = "shapes_edit_dit.safetensors"  # the tiny editing model beside the tiny shapes-dit


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`write_tiny_weights` in a session folder."""
    return write_tiny_weights(tmp_path_factory.mktemp("tiny-shapes"))


@pytest.fixture
def sigint_not_ignored():
    """SIGINT as an interactive shell leaves it (Python's ``default_int_handler``) for the test. A run ignores a
    signal its process was started ignoring (``tpflow.train.stop``), and a suite started in the background of a
    non-interactive shell (``make test &``, some CI runners) starts with SIGINT ignored."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
