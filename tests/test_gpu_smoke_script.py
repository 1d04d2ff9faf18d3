"""benchmarks/gpu_smoke.py keeps working: its --tiny mode runs the same epoch code on tiny-sd3 on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_smoke.py"


def test_gpu_smoke_tiny_mode_runs_one_epoch(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "smoke.json"
    # bf16 autocast: the script's dtype is only the recipe's mixed_precision (fp16's GradScaler path is trained in
    # tests/test_precision.py), and the CPU's fp16 matmuls take twice bf16's time
    args = ["--tiny", "--prompts", "1", "--group", "4", "--dtype", "bf16", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["gpu_smoke.py", *args])
    module.main()
    report = json.loads(out.read_text())
    assert report["trajectories"] == 4 and report["nfe_per_traj"] == 55  # K = 10, W = 9 with velocity reuse
    assert report["sample_s"] > 0 and report["update_s"] > 0
    assert report["trainable_params"] > 0
    with torch.device("meta"):  # the SD3.5-M configuration builds (2.24 B parameters), without allocating it
        from diffusers import SD3Transformer2DModel

        big = SD3Transformer2DModel(**module.SD35_MEDIUM_TRANSFORMER)
    assert 2.2e9 < sum(p.numel() for p in big.parameters()) < 2.3e9
