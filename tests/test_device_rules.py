"""The device rules of tpflow/devices.py, checked on the CPU, where CI runs: a GPU-only crash class caught without one.

A tensor made without ``device=`` lands on the CPU; on a CPU-only machine that is always right, so such a line passes
every CPU test and crashes the first GPU user (it happened: a CPU generator against CUDA latents, CPU advantages
against CUDA log-probs). ``FactoryWatch`` records every tensor factory call made from tpflow's own code without a
device while the whole training path runs (rollout of both completion kinds, scoring, credit, advantages, GRPO with
the KL pass, EMA, evaluation, checkpoint, resume, inspect-trajectory, export), with shapes-dit and with the diffusers
backbones (tiny-sd3, tiny-flux). Host bookkeeping that is meant to be on the CPU says ``device="cpu"``, so the rule is
checkable.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tpflow
from tpflow.devices import cpu_generator, randn, resolve_device, to_device
from tpflow.errors import UserError
from tpflow.recipe import Recipe, load_recipe
from tpflow.train.trainer import Trainer

from .test_train import tiny_recipe

PACKAGE = Path(tpflow.__file__).resolve().parent
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.randn,
    torch.rand,
    torch.randint,
    torch.randperm,
    torch.as_tensor,
}


class FactoryWatch(TorchFunctionMode):
    """Records ``file:line`` of each tensor factory call from tpflow's code that states no device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            if not (func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):  # keeps its device
                frame = sys._getframe(1)
                while frame is not None and "/torch/" in frame.f_code.co_filename:
                    frame = frame.f_back
                if frame is not None and _in_tpflow(frame) and not _building_a_module(frame):
                    where = Path(frame.f_code.co_filename).resolve().relative_to(PACKAGE.parent)
                    self.calls.append(f"{where}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


def _in_tpflow(frame) -> bool:
    return Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def _building_a_module(frame) -> bool:
    """Inside some ``nn.Module.__init__``: modules are built on the CPU and moved whole (``model.to(device)``)."""
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            return True
        frame = frame.f_back
    return False


def test_factory_watch_catches_a_tensor_without_device():
    """The check can fail: a factory call compiled as if in a tpflow module is recorded, one with a device is not."""
    code = compile("torch.zeros(3)\ntorch.ones(2, device='cpu')\n", str(PACKAGE / "optim" / "example.py"), "exec")
    with FactoryWatch() as watch:
        exec(code, {"torch": torch})
    assert watch.calls == ["tpflow/optim/example.py:1 torch.zeros"]


TINY_DIFFUSERS = 'name = "{}"\nseed = 0\nresolution = 16\ndevice = "cpu"'  # tiny-sd3 / tiny-flux, 16 px


@pytest.mark.parametrize(
    ("backbone", "completions"),
    [
        ("shapes-dit", "ode"),
        ("shapes-dit", "x0"),
        ("tiny-sd3", "x0"),
        ("tiny-flux", "ode"),
        ("tiny-qwen-image", "ode"),
    ],
)
def test_training_path_states_every_device(tmp_path, tiny_weights, plugin, backbone, completions):
    """Train (``completions`` as given, KL, EMA, eval, checkpoints), resume, inspect (sampled and a run's traces),
    export, `tpflow eval` and `tpflow sample`, with each backbone class: no tensor without a device."""
    import contextlib

    from tpflow.distributed import Distributed
    from tpflow.evaluation.run import EvalOptions, evaluate_target
    from tpflow.evaluation.sample import sample_images
    from tpflow.evaluation.targets import resolve_target
    from tpflow.export import export
    from tpflow.inspect.traces import load_run, run_trajectories, sample_trajectories, turning_point_stats

    section = None if backbone == "shapes-dit" else TINY_DIFFUSERS.format(backbone)
    recipe = tiny_recipe(tmp_path, tiny_weights, backbone=section)
    # one prompt's group of 4 an epoch (one rollout batch; the brightness reward spreads the group, so it trains):
    # every call of the training path runs, under the watch's per-call cost, on half the recipe's trajectories
    sets = [f"rollout.completions={completions}", "train.prompts_per_epoch=1"]
    with FactoryWatch() as watch:
        Trainer(load_recipe(recipe, [*sets, "train.epochs=1"])).fit()
        Trainer(load_recipe(recipe, [*sets, "train.epochs=2", "rollout.same_noise=true"]), resume=True).fit()
        # inspect-trajectory always completes by ODE (docs/inspect.md), here from an independent baseline
        loaded = load_recipe(recipe, ["rollout.baseline_noise=independent"])
        sample_trajectories(loaded, "a red circle", n=2, seed=0, checkpoint=tmp_path / "run")
        logged = load_run(tmp_path / "run")  # inspect-trajectory --run
        run_trajectories(logged, None, n=2)
        turning_point_stats(logged)
        export(tmp_path / "run", tmp_path / "export")
        target = resolve_target(tmp_path / "run")
        evaluate_target(target, EvalOptions(steps=2, images_per_prompt=2), Distributed(None), contextlib.nullcontext)
        sample_images(target, ["a red circle"], 2, steps=2, guidance=1.0, seed=0, autocast=contextlib.nullcontext)
    assert not watch.calls, "tensors made without device= (say device=... or use new_*/..._like):\n" + "\n".join(
        sorted(set(watch.calls))
    )


def test_nft_training_path_states_every_device(tmp_path, tiny_weights):
    """DiffusionNFT's path (final-samples rollout under the old policy, re-noising, old and reference passes, the
    old policy's update and checkpoint, resume): no tensor without a device."""
    from tests.test_nft_train import nft_recipe

    recipe = nft_recipe(tmp_path, tiny_weights)
    with FactoryWatch() as watch:
        Trainer(load_recipe(recipe, ["train.epochs=1"])).fit()
        Trainer(load_recipe(recipe, ["train.epochs=2"]), resume=True).fit()
    assert not watch.calls, "tensors made without device= (say device=... or use new_*/..._like):\n" + "\n".join(
        sorted(set(watch.calls))
    )


def _factory_calls_without_device(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function, factory) of each ``torch.<factory>(...)`` in ``path`` without ``device=``."""
    import ast

    names = {f.__name__ for f in FACTORIES}
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            func = getattr(child, "func", None)
            if (
                isinstance(child, ast.Call)
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "torch"
                and func.attr in names
                and not any(k.arg == "device" for k in child.keywords)
            ):
                found.append((child.lineno, function, func.attr))
            visit(child, function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_every_factory_call_in_the_source_states_a_device():
    """The watch sees the paths the tests run; this reads every file. A factory call without ``device=`` is allowed
    only where a module is built (``__init__``, and the initial position table it takes) and in the CPU-only shapes
    pretraining."""
    allowed = {("shapes/model.py", "_sincos_2d"), ("shapes/pretrain.py", "flow_loss")}
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} torch.{name} (in {function})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, function, name in _factory_calls_without_device(path)
        if function != "__init__" and (path.relative_to(PACKAGE).as_posix(), function) not in allowed
    ]
    assert not offenders, "say device=... (device='cpu' for host bookkeeping):\n" + "\n".join(offenders)


def test_only_cpu_generators_on_the_training_path():
    """Rule 1: generators are made by ``cpu_generator`` only (shapes pretraining is CPU-only and keeps its own)."""
    allowed = {PACKAGE / "devices.py", PACKAGE / "shapes" / "pretrain.py"}
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"torch\.Generator\(", line)
    ]
    assert not offenders, f"make generators with tpflow.devices.cpu_generator: {offenders}"


def test_randn_is_the_generators_draw_moved():
    """A CPU generator's draw does not depend on the target device or dtype (bitwise, before the cast)."""
    a = randn((2, 3), cpu_generator(7), "cpu")
    b = torch.randn((2, 3), generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert randn((2, 3), cpu_generator(7), "cpu", torch.float64).dtype == torch.float64
    assert randn((2, 3), cpu_generator(7), "meta").device.type == "meta"


HOST_VALUES = (torch.tensor(0.25), torch.tensor([0.5, 0.25, 1.0]), torch.tensor([True, False]), torch.tensor([3]))


def test_to_device_gives_the_values_of_a_plain_copy():
    """tpflow.devices.to_device (a host σ, mask or noise draw to the model's device without waiting for its queue)
    keeps values, dtype and shape; off CUDA it is ``.to``."""
    for t in HOST_VALUES:
        moved = to_device(t, "cpu")
        assert moved.device.type == "cpu" and moved.dtype == t.dtype and torch.equal(moved, t)
        assert to_device(t, "meta").shape == t.shape and to_device(t, "meta").device.type == "meta"


@pytest.mark.gpu
def test_to_device_on_cuda_fills_or_copies_from_pinned_memory(cuda):
    """On CUDA a one-element tensor is filled on the device and a larger one copied non_blocking from pinned
    memory: the same values as ``.to("cuda")``, read back after a synchronize."""
    for t in HOST_VALUES:
        moved = to_device(t, cuda)
        assert moved.device.type == torch.device(cuda).type and moved.dtype == t.dtype and moved.shape == t.shape
        assert torch.equal(moved.cpu(), t)


def test_sampler_noise_comes_from_the_generator_whatever_the_latent_device():
    """The SDE step draws ξ on the generator's device: on 'meta' latents (a stand-in for CUDA) it no longer raises."""
    from tpflow.samplers._common import draw_noise

    z = torch.zeros(2, 4, device="meta")
    assert draw_noise(z, cpu_generator(0), None).device.type == "meta"
    cpu = draw_noise(torch.zeros(2, 4), cpu_generator(0), None)
    assert torch.equal(cpu, torch.randn(2, 4, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name", ["gpu0", "cuda:abc", "tpu"])
def test_bad_device_names_are_user_errors(name):
    with pytest.raises(UserError, match="device"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_user_error_before_anything_loads(tmp_path, tiny_weights, plugin, monkeypatch):
    with pytest.raises(UserError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    built = []
    build = Recipe.build
    monkeypatch.setattr(Recipe, "build", lambda self, kind: built.append(kind) or build(self, kind))
    with pytest.raises(UserError, match="no CUDA GPU"):
        Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), ["backbone.device=cuda"]))
    assert built == ["dataset"]  # the prompts are read (and checked); nothing with weights is built


def test_a_second_trainer_in_one_process_gets_the_accelerator_it_asks_for():
    """accelerate's process-wide state would keep the first trainer's precision (or raise); outside a launcher the
    trainer resets a state that disagrees."""
    from tpflow.distributed import make_accelerator as _accelerator

    assert _accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"
    assert _accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    assert _accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"
