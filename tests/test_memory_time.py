"""The time estimate of `tpflow validate --gpu-memory GIB --gpu NAME` (tpflow.memory.flops, tpflow.memory.timing):
the FLOP counter against hand counts, the epoch's arithmetic on the tiny SD3 test size by hand, and the command's
options. Tiny models: seconds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tests.cli_run import tpflow
from tests.test_memory_fit import tiny_recipe
from tpflow.memory import Probe, measure, tiny_setup
from tpflow.memory.flops import Flops
from tpflow.memory.timing import (
    DEFAULT_GPU,
    GPUS,
    UTILIZATION,
    epoch_time,
    training_times,
    velocity_rows_per_trajectory,
)


def test_the_flop_counter_counts_a_linear_and_the_cpu_flash_attention_by_hand():
    """2 FLOPs per multiply-add; the backward of a linear layer is two matmuls of the forward's size (grad input,
    grad weight); flash attention's backward recomputes the scores Q·Kᵀ, then four matmuls of that size."""
    x, layer = torch.randn(3, 5, requires_grad=True), torch.nn.Linear(5, 7)
    with Flops() as counted:
        y = layer(x)
    assert counted.total == 2 * 3 * 5 * 7
    with Flops() as counted:
        y.sum().backward()
    assert counted.total == 2 * (2 * 3 * 5 * 7)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (4, 6, 6))  # [B, H, L, d]
    with Flops() as counted:
        out = F.scaled_dot_product_attention(q, k, v)
    assert counted.total == 2 * (2 * 1 * 2 * 4 * 6 * 8)  # Q·Kᵀ and P·V: 2·B·H·Lq·Lk·d each
    with Flops() as counted:
        out.sum().backward()
    assert counted.total == 5 * (2 * 1 * 2 * 4 * 6 * 8)


def test_the_counter_equals_a_layer_by_layer_hand_count_on_the_tiny_sd3():
    """The tiny SD3 transformer's forward on fake tensors: the counter's total is, exactly, 2·in·out per token of
    every linear layer, 2·out·in·k² per output element of the patch convolution, and 2·2·B·H·Lq·Lk·d per attention,
    each counted at the module (MMDiT: image and prompt tokens through their own weights, so much less than the
    2 × parameters × tokens rule of thumb)."""
    from diffusers import SD3Transformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    from tpflow.memory import TINY_SD3

    hand = []

    class Attention(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is F.scaled_dot_product_attention:
                (b, h, lq, d), lk = args[0].shape, args[1].shape[-2]
                hand.append(2 * 2 * b * h * lq * lk * d)
            return func(*args, **(kwargs or {}))

    def linear(module, inputs, out):  # noqa: ANN001
        hand.append(2 * module.in_features * module.out_features * (inputs[0].numel() // module.in_features))

    def conv(module, inputs, out):  # noqa: ANN001
        hand.append(2 * out.numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1])

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = SD3Transformer2DModel(**TINY_SD3)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(linear)
            elif isinstance(module, torch.nn.Conv2d):
                module.register_forward_hook(conv)
        x, text = torch.randn(2, 4, 16, 16), torch.randn(2, 85, TINY_SD3["joint_attention_dim"])
        pooled = torch.randn(2, TINY_SD3["pooled_projection_dim"])
        with torch.no_grad(), Attention(), Flops() as counted:
            model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                  timestep=torch.tensor([500.0, 500.0]), return_dict=False)  # fmt: skip
    assert len(hand) > 20 and counted.total == sum(hand)


@pytest.fixture(scope="module")
def tiny():
    """The tiny SD3 test setup (K = 4 steps, window of 3 from step 0, ODE completions, rollout batches of 2, 2
    prompts × 2, micro-batches of 2, CFG 4.5) and its fake-tensor measurement."""
    setup = tiny_setup("sd3")
    return setup, measure(setup)


def test_the_velocity_calls_flops_are_linear_in_rows_and_doubled_by_cfg(tiny):
    """FLOPs per velocity row: the probe's call of ``rollout_rows`` rows, divided by them, is a 1-row call's; CFG
    runs the transformer on twice the rows."""
    setup, m = tiny
    copy = dataclasses.replace(setup)
    with Probe(copy) as probe:
        probe.rollout(1)
        one = probe.flops
        copy.rollout = copy.rollout.model_copy(update={"guidance": 1.0})
        probe.rollout(1)
        unguided = probe.flops
    assert m["rollout_flops"] == m["rollout_rows"] * one > 0 and one == 2 * unguided


def test_the_epoch_time_is_the_hand_arithmetic_on_the_tiny_model(tiny):
    """Per trajectory: 4 main steps + the completions' and the shared baseline's rows (0 + 1 + 2 + 3) = 10 velocity
    rows, W + 1 = 4 decoded latents, W = 3 training steps; 4 trajectories an epoch; on 2 A100s at 40 % of 312
    TFLOP/s."""
    setup, m = tiny
    assert velocity_rows_per_trajectory(setup) == 10 and training_times(setup) == 3
    time = epoch_time(setup, m, 2, "a100")
    assert time.rollout == 4 * 10 * m["rollout_flops"] / m["rollout_rows"]
    assert time.decode == 4 * 4 * m["decode_flops"] / m["decode_rows"]
    assert time.train == 4 * 3 * m["train_flops"] / 2
    assert UTILIZATION == 0.4 and GPUS["a100"][1] == 312e12 and GPUS[DEFAULT_GPU] == ("H100 SXM", 989e12)
    assert time.seconds == pytest.approx(time.flops / (2 * 0.4 * 312e12), rel=1e-12)
    assert time.gpu_hours == pytest.approx(time.flops * setup.train.epochs / (0.4 * 312e12) / 3600, rel=1e-12)
    lines = time.lines()
    assert lines[0].startswith("time per epoch (estimated, not measured: FLOPs counted on these calls, at 40% of the ")
    assert "A100's 312 TFLOP/s bf16 dense peak" in lines[0] and "s per epoch on 2 GPUs" in lines[2]


def test_validate_prints_the_time_on_the_named_gpu_and_refuses_a_gpu_alone(tmp_path):
    """--gpu a100 (default h100, the time estimate's table) with --gpu-memory; alone, or a GPU not in the table, is
    refused before anything loads."""
    path = str(tiny_recipe(tmp_path))
    out = tpflow("validate", path, "--no-machine", "--gpu-memory", "80", "--gpu", "a100")
    assert out.returncode == 0, out.stderr
    assert "time per epoch (estimated, not measured" in out.stdout and "A100's 312 TFLOP/s" in out.stdout
    assert "GPU-hours for 100 epochs" in out.stdout
    alone = tpflow("validate", path, "--no-machine", "--gpu", "a100")
    assert alone.returncode == 2 and "comes with the memory estimate: add --gpu-memory" in alone.stderr
    unknown = tpflow("validate", path, "--no-machine", "--gpu-memory", "80", "--gpu", "v100")
    assert unknown.returncode == 2 and "h100 (H100 SXM), h100-pcie (H100 PCIe)" in " ".join(unknown.stderr.split())
    assert "estimating" not in unknown.stderr  # refused before anything loads
