"""``[train] shard = "fsdp"`` on a GPU (``pytest -m gpu``): FSDP2 over NCCL, a group of one process (the machine
lent to the GPU suite has one GPU; the 2-process arithmetic is tested on the CPU, tests/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cuda_or_skip
from tests.distributed_workers import gpu_sharded_worker, spawn


@pytest.mark.gpu
def test_an_fsdp_sharded_step_on_the_gpu_is_the_unsharded_one(tmp_path):
    """tiny-sd3's whole model, one GRPO step: sharded by ``fully_shard`` (weights gathered per block, gradients
    reduce-scattered over NCCL) against the same step unsharded, in fp32 and under bf16 autocast."""
    device = cuda_or_skip()
    (out,) = spawn(gpu_sharded_worker, tmp_path, device, world_size=1, backend="nccl" if device == "cuda" else "gloo")
    for mode, least in (("no", 0.99999), ("bf16", 0.999)):
        sharded, plain = out[f"{mode}/True"].double(), out[f"{mode}/False"].double()
        assert plain.norm() > 0
        cosine = float(torch.nn.functional.cosine_similarity(sharded, plain, dim=0))
        assert cosine >= least, (mode, cosine)
