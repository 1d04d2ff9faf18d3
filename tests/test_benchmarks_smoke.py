"""benchmarks/rollout_cost.py at its smallest sizes, so that the script cannot rot, and the invariants it relies on."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import tpflow

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SMALL = ["--prompts", "2", "--copies", "2", "--steps", "4", "--window", "2", "--window-start", "1"]


@pytest.fixture(scope="module")
def rollout_cost():
    spec = importlib.util.spec_from_file_location("rollout_cost_bench", BENCHMARKS / "rollout_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.modules.pop("_timing", None)


def test_every_kind_on_tiny_sd3(rollout_cost, tmp_path):
    """One round of every kind: NFE as docs/algorithm.md §3.5 counts it, the meter agrees with the engine, a report."""
    argv = ["--backbone", "tiny-sd3", *SMALL, "--repeats", "1", "--warmup", "0", "--memory", "none"]
    result = rollout_cost.main([*argv, "--out", str(tmp_path)])["tiny-sd3"]
    s = result["summary"]
    k, w, start, n = 4, 2, 1, 4
    reference = k + w * (k - start) - w * (w - 1) // 2  # main + baseline from z_s + branches j = 1..W-1
    assert s["flow"]["nfe"] == s["tp-x0"]["nfe"] == k
    assert s["tp-seq"]["nfe"] == s["tp-noreuse"]["nfe"] == reference
    assert s["tp"]["nfe"] == reference - w  # each branch's first step reuses the main velocity
    # same_noise: the prefix (s steps) and the baseline (after its reused first step) run once per prompt, not per copy
    assert s["tp-same-noise"]["nfe"] == pytest.approx(s["tp"]["nfe"] - (k - 1) * (n - 2) / n)
    for key, row in s.items():  # velocity calls counted by the wrapper = the engine's own count
        assert row["counted_nfe"] == pytest.approx(row["nfe"]), key
        assert 0 <= row["outside"] < 1 and row["rollout_s"] > 0 and row["score_s"] > 0
    assert s["tp"]["calls"] == s["flow"]["calls"] == k and s["tp-seq"]["calls"] == reference  # one call per step
    text = result["path"].read_text()
    assert result["path"] == tmp_path / "rollout_cost_tiny-sd3.md"
    assert "| TP-GRPO, sequential (reference order) |" in text and text.count("**PASS**") + text.count("**FAIL**") == 2


def test_sequential_reference_matches_the_engine(rollout_cost):
    """The reference-order variant computes what the batched engine computes, for a window starting at s > 0."""
    args = rollout_cost.parse(["--backbone", "shapes-dit", *SMALL])
    b = rollout_cost.build_bench("shapes-dit", args)
    z0, source, _ = rollout_cost.inputs(b, False, seed=0)
    runs = {v.key: v.run for v in rollout_cost.VARIANTS}
    final, completions, _ = runs["tp-seq"](b, z0, source, torch.Generator().manual_seed(5))
    final_e, completions_e, _ = runs["tp"](b, z0, source, torch.Generator().manual_seed(5))
    assert completions.shape == completions_e.shape == (4, 2, 3, 32, 32)
    assert torch.allclose(final, final_e, atol=1e-4) and torch.allclose(completions, completions_e, atol=1e-4)


def test_memory_probe_sees_an_allocation(rollout_cost, capsys):
    """The RSS high-water method counts memory touched inside the call, and the probe entry point prints it."""
    timing = sys.modules["_timing"]
    peak = timing.rss_peak_increase_mib(lambda: torch.ones(64, 2**20 // 4).sum())  # 64 MiB float32, touched
    assert 60 < peak < 200
    rollout_cost.main(["--backbone", "shapes-dit", *SMALL, "--memory-probe", "tp-x0"])
    probed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_mib"]
    assert 1 < probed < 200  # a rollout of this size touches about 10 MiB of new memory; doing nothing, < 1 MiB


@pytest.fixture(scope="module")
def epoch_cost():
    spec = importlib.util.spec_from_file_location("epoch_cost_bench", BENCHMARKS / "epoch_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.modules.pop("_timing", None)


def test_epoch_cost_phases_add_up_to_the_epoch(epoch_cost, tmp_path):
    """benchmarks/epoch_cost.py --tiny: every phase present, none negative, their sum the epoch's wall time with
    little left unattributed, FLOPs counted, and the first micro-batch on policy."""
    out = tmp_path / "epoch_cost.json"
    epoch_cost.main(["--tiny", "--backbone", "shapes-dit", "--variants", "flow", "tp", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["matmul_peak_flops"] > 0
    variants = report["backbones"]["shapes-dit"]["variants"]
    assert set(variants) == {"flow", "tp"}
    for key, v in variants.items():
        for run in v["runs"]:
            phases = run["phases"]
            assert list(phases) == list(epoch_cost.PHASES), key
            assert sum(phases.values()) == pytest.approx(run["epoch_s"], rel=1e-9), key
            assert min(phases.values()) >= -1e-3, (key, phases)  # "other" is the remainder: nothing counted twice
            assert phases["other"] <= 0.25 * run["epoch_s"], (key, phases)  # and nearly everything is attributed
            for phase in ("sample_model", "update_forward", "update_backward", "checkpoint"):
                assert phases[phase] > 0, (key, phase)
        assert 0 < v["overhead"] < 1 and v["peak_mib"] > 0
        assert v["flops"]["sample_model"] > 0 and v["flops"]["update_backward"] > 0
        assert v["model_flops_per_s"] > 0 and 0 < v["model_peak_share"]
        assert v["first_ratio_max_deviation"] <= 1e-6
    assert variants["tp"]["nfe_per_traj"] > variants["flow"]["nfe_per_traj"]
    assert variants["tp"]["rows"]["sample"] > variants["flow"]["rows"]["sample"]


def test_completion_fidelity_at_toy_size(tmp_path):
    """benchmarks/completion_fidelity.py on 2 prompts x 2 copies: the exact row agrees with itself, k = 1 costs the
    main trajectory's NFE only (K), and the report is written."""
    spec = importlib.util.spec_from_file_location("completion_fidelity_bench", BENCHMARKS / "completion_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "fidelity.md"
    argv = ["--prompts", "2", "--copies", "2", "--ks", "1", "--set", "rollout.num_steps=4", "--set",
            "rollout.window_size=3", "--set", "rollout.window_range=[0,3]", "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    text = out.read_text()
    exact = next(line for line in text.splitlines() if line.startswith("| exact |"))
    one = next(line for line in text.splitlines() if line.startswith("| k=1 |"))
    assert exact.split("|")[2].strip() == "10.0"  # K + W·K − W(W − 1)/2 − W (reused velocities), K = 4, W = 3
    assert one.split("|")[2].strip() == "4.0"  # K: every completion reuses the main velocity and jumps to σ = 0
    assert exact.split("|")[4].strip() == "1.000"  # the exact completions agree with themselves


@pytest.fixture()
def value_fidelity():
    spec = importlib.util.spec_from_file_location("value_fidelity_bench", BENCHMARKS / "value_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)  # its --threads 1 holds for the test only
    for name in (spec.name, "completion_fidelity", "evidence"):  # imported from benchmarks/ by the script
        sys.modules.pop(name, None)


def test_value_fidelity_at_toy_size(value_fidelity, tmp_path, tiny_weights, monkeypatch):
    """benchmarks/value_fidelity.py on a tiny shapes-dit, 2 prompts x 2 copies, M = 3: the variants' NFE, the MC's
    M·Σ_j (K − s − j) evaluations per trajectory, and a rerun that reads every MC value from the cache (none is
    computed again) and writes the same table."""
    from .test_train import tiny_recipe

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    out, cache = tmp_path / "value.md", tmp_path / "cache"
    argv = ["--recipe", str(recipe), "--prompts", "2", "--copies", "2", "--M", "3", "--ks", "1", "--cache",
            str(cache), "--set", "rollout.window_range=[0,3]", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert value_fidelity.main(argv) == 0
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines() if line.startswith("| ")}
    assert rows["exact"][2].strip() == "10.0" and rows["k=1"][2].strip() == "4.0"  # K = 4, W = 3, s = 0
    assert "x0" not in rows and "x0 row left out" in text  # the x0 estimate is the one-step completion
    assert "12 states" in text and "27 NFE per trajectory" in text  # 3·(4 + 3 + 2)
    assert "4 of 4 trajectories computed" in text and len(list(cache.glob("*.json"))) == 4

    def fail(*args, **kwargs):
        raise AssertionError("computed again although cached")

    monkeypatch.setattr(value_fidelity, "mc_values", fail)
    assert value_fidelity.main(argv) == 0
    again = out.read_text()
    assert "0 of 4 trajectories computed" in again

    def numbers(markdown: str) -> list[list[str]]:  # every table cell but the rollout seconds
        return [line.split("|")[:3] + line.split("|")[4:] for line in markdown.splitlines() if line.startswith("| ")]

    assert numbers(again) == numbers(text)


def test_value_fidelity_scores_a_trace_against_its_values(value_fidelity):
    """The comparison by hand: a completion trace equal to the MC values agrees everywhere; one with a state off flips
    one increment's sign and adds a turning point; only increments the MC resolves (|ΔV| > 2·SE) count as resolved."""
    from tpflow.probe.value import Values

    values = torch.tensor([[0.5, 0.2, 0.6, 0.9], [0.4, 0.45, 0.1, 0.3]], dtype=torch.float64)
    se = torch.tensor([[0.01, 0.01, 0.01, 0.0], [0.01, 0.2, 0.01, 0.0]], dtype=torch.float64)
    mc = [Values(values, se, torch.zeros_like(se), 4)]
    assigner = tpflow.build("credit", "consistent", balanced=False)
    same = value_fidelity.compare([values.clone()], mc, assigner)
    assert same["sign_agreement"] == same["resolved_agreement"] == 1.0 and same["mae"] == 0.0
    assert same["spearman_values"] == pytest.approx(1.0) and same["tp_precision"] == same["tp_recall"] == 1.0
    assert same["tp"] == same["tp_mc"] == 1  # trajectory 0: a dip (d_0 < 0), then the recovery at i = 1
    off = values.clone()
    off[1, 2] = 0.35  # 0.1 -> 0.35: d_2 of trajectory 1 turns negative, and i = 1 becomes a turning point
    got = value_fidelity.compare([off], mc, assigner)
    assert got["sign_agreement"] == pytest.approx(5 / 6) and got["mae"] == pytest.approx(0.25 / 6)
    # resolved: all of trajectory 0's and trajectory 1's ΔV_2 = 0.2 > 2·0.01; not ΔV_0, ΔV_1 (SE 0.2 at j = 1)
    assert got["resolved"] == 4 and got["resolved_agreement"] == pytest.approx(3 / 4)
    assert got["tp"] == 2 and got["tp_mc"] == 1 and got["tp_precision"] == 0.5 and got["tp_recall"] == 1.0


def test_benchmarks_import_no_circle():
    """No module of benchmarks/ imports, directly or through others, one that imports it back (imports inside
    functions included): shared code lives in the library, or flows one way."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    mods = {p.stem: p for p in root.glob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
        graph[name] = {d for d in deps if d in mods and d != name}

    def reaches(start: str, target: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node == target:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    assert [name for name in graph if reaches(name, name)] == []
