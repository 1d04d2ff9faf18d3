"""Training on 2 CPU processes (gloo): one model, the same trajectories and advantages as one process, exact resume.

The 2-process runs are started once per module (``two_process_runs``, through ``torch.multiprocessing.spawn`` so
that each rank can hand back its own adapter): starting a process costs more than these tiny trainings, so the same
two processes train the recipe (2 epochs) and then its DiffusionNFT variant (1 epoch). The resume of a killed
sharded run, the error in the processes and the 2-process eval are launched by ``tpflow ... --num-processes 2`` with
the launcher in this process (``tpflow_launching``: the processes are real); the two "machines" are two real
``tpflow train`` processes, each launching its own. A replicated 2-process run resumed on 2 processes is checked bit
for bit after a stop at every phase in tests/test_interrupt.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.cli_run import TpflowForked, tpflow_launching
from tests.distributed_workers import spawn, train_recipes_worker
from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_nft_train import nft_recipe
from tests.test_train import tiny_recipe
from tpflow.optim.advantages import group_advantages
from tpflow.recipe import load_recipe
from tpflow.train.checkpoints import shards as checkpoint_shards
from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

SMALL_BATCHES = ["train.rollout_batch=2", "optimizer.micro_batch_size=2"]  # 4 batches per epoch, 2 per process


# Velocity calls of one row: each rollout batch makes as many calls as it has rows alive, which depend on its window
# start (the consistent credit's completions) and on its distinct prompts (same_noise: one row per distinct noise
# before the window), so the two processes' batches make different numbers of them (tpflow.train.lockstep)
UNEVEN_CALLS = ["rollout.max_batch=1", "rollout.same_noise=true"]
REPLICATED_SETS = [*SMALL_BATCHES, "optimizer.learning_rate=1e-4", *UNEVEN_CALLS]  # the whole model on each process
FSDP_SETS = [*REPLICATED_SETS, 'train.shard="fsdp"']
# DanceGRPO's plan: every step SDE (dance-sde), int((K - 1)·0.6) = 1 of the first 3 trained per trajectory, outcome
# a replay buffer ([replay], tests/test_replay.py): epoch 1 replays what epoch 0 admitted, dealt over the processes
REPLAY_SETS = ["replay.capacity=6", "replay.min_advantage=0.5", "optimizer.replay_min_sigma=0.3", "eval.every=0",
               'credit.name="outcome"', "train.ema=false"]  # fmt: skip
# the newest methods, one epoch each: E-GRPO's entropy-steps plan (one segment merged over 1 -> 3 on
# shapes-dit's K = 4 grid), AdaGRPO's ability-matched prompts (2 candidates per prompt: 4 anchors dealt over the two)
# with the fused advantage, GARDO's adaptive reference on nft
ONE_EPOCH = [*SMALL_BATCHES, "train.epochs=1", "eval.every=0", "train.ema=false"]
NEWEST_SETS = {
    "entropy": [*ONE_EPOCH, 'plan.name="entropy-steps"', 'plan.entropy_grid="sd3"', "plan.grid_shift=3.0",
                "plan.entropy_threshold=1.3", "rollout.window_size=1", 'credit.name="branch"',
                'sampler.name="flow-sde"', "rollout.same_noise=true"],
    "curriculum": [*ONE_EPOCH, 'train.prompt_policy="ability-matched"', "train.prompt_candidates=2",
                   'credit.name="outcome"', 'optimizer.advantage_fusion="running-reward"'],
    "gardo-nft": [*ONE_EPOCH, "optimizer.adaptive_reference=true", "optimizer.gradient_accumulation_steps=4"],
}  # fmt: skip
DANCE_SETS = ['plan.name="trained-fraction"', "plan.fraction=0.6", "plan.exclude_last=true",
              'sampler.name="dance-sde"', "rollout.window_size=4", "rollout.noise_level=0.3", 'credit.name="outcome"',
              "optimizer.beta=0", "eval.every=0", "train.epochs=1"]  # fmt: skip


def fsdp_recipe(tmp_path: Path, weights: Path) -> Path:
    """``recipe`` with the whole model trained (sharded over the processes with ``FSDP_SETS``)."""
    backbone = f'name = "shapes-dit"\nweights = "{weights}"\nfinetune = "full"'
    return tiny_recipe(tmp_path, None, reward="image-stat", backbone=backbone)


def recipe(tmp_path: Path, weights: Path) -> Path:
    """The trainer tests' tiny recipe (2 prompts x 4 copies) with a built-in reward, so that spawned processes
    need no test plugin; with ``SMALL_BATCHES``."""
    return tiny_recipe(tmp_path, weights, reward="image-stat")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, tiny_weights) -> dict[str, tuple[Path, list[dict]]]:
    """Two processes that train, in turn, the recipe for 2 epochs ("grpo"), its DiffusionNFT variant for 1 epoch
    without evaluations ("nft"), its whole model for 2 epochs FSDP-sharded ("fsdp") and replicated ("full", no
    evaluations), DanceGRPO's trained subset of steps for 1 epoch, whole model sharded ("dance") and replicated
    ("dance-full"), the recipe's LoRA sharded for 1 epoch ("lora-fsdp"), and the recipe replaying trajectories for 2
    epochs ("replay"): for each, (its directory, what each rank returned)."""
    root = tmp_path_factory.mktemp("two-process")
    names = ("nft", "fsdp", "full", "dance", "dance-full", "lora-fsdp", "replay")
    nft, fsdp, full, dance, dance_full, lora_fsdp, replay = (root / n for n in names)
    for folder in (nft, fsdp, full, dance, dance_full, lora_fsdp, replay):
        folder.mkdir()
    runs = [
        (str(recipe(root, tiny_weights)), SMALL_BATCHES),
        (str(nft_recipe(nft, tiny_weights)), [*SMALL_BATCHES, "eval.every=0", "train.epochs=1"]),
        (str(fsdp_recipe(fsdp, tiny_weights)), FSDP_SETS),
        (str(fsdp_recipe(full, tiny_weights)), [*REPLICATED_SETS, "eval.every=0"]),
        (str(fsdp_recipe(dance, tiny_weights)), [*FSDP_SETS, *DANCE_SETS, 'train.checkpoint_layout="gathered"']),
        (str(fsdp_recipe(dance_full, tiny_weights)), [*REPLICATED_SETS, *DANCE_SETS]),
        (
            str(recipe(lora_fsdp, tiny_weights)),
            [*SMALL_BATCHES, 'train.shard="fsdp"', "train.epochs=1", "eval.every=0"],
        ),
        (str(recipe(replay, tiny_weights)), [*SMALL_BATCHES, *REPLAY_SETS]),
    ]
    newest = {name: root / name for name in NEWEST_SETS}
    for name, folder in newest.items():
        folder.mkdir()
        runs.append((str(_newest_recipe(name, folder, tiny_weights)), NEWEST_SETS[name]))
    zero, one = spawn(train_recipes_worker, root, runs)
    names = [("grpo", root), ("nft", nft), ("fsdp", fsdp), ("full", full), ("dance", dance),
             ("dance-full", dance_full), ("lora-fsdp", lora_fsdp), ("replay", replay), *newest.items()]  # fmt: skip
    return {name: (folder, [zero["runs"][i], one["runs"][i]]) for i, (name, folder) in enumerate(names)}


def _newest_recipe(name: str, folder: Path, weights: Path) -> Path:
    """The tiny recipe (nft's for GARDO on nft) that ``NEWEST_SETS[name]`` changes."""
    return nft_recipe(folder, weights) if name == "gardo-nft" else recipe(folder, weights)


@pytest.fixture(scope="module")
def two_process_run(two_process_runs) -> tuple[Path, list[dict]]:
    """The recipe trained for 2 epochs by 2 processes: (its directory, what each rank returned)."""
    return two_process_runs["grpo"]


def _epoch_traces(run: Path, epoch: int) -> list[dict]:
    rows = [r for r in read_jsonl(run / "traces.jsonl") if r["epoch"] == epoch]
    return sorted(rows, key=lambda r: (r["batch"], r["row"]))


def _final_adapter(run: Path) -> dict[str, torch.Tensor]:
    """The trained weights of the run's newest checkpoint, whole, from its adapter folder or (a sharded run's) its
    shards."""
    path, _ = find_checkpoint(run)
    if (path / "adapter").is_dir():
        return safetensors.torch.load_file(next((path / "adapter").glob("*.safetensors")))
    layout = load_checkpoint(path).layout
    meta = checkpoint_shards.stored(path / "shards")
    tensors = checkpoint_shards.empty(meta, list(layout["model"].values()), None)
    checkpoint_shards.read(path / "shards", tensors, meta)
    return {name: tensors[key] for name, key in layout["model"].items()}


def test_two_processes_train_one_model(two_process_run):
    root, (zero, one) = two_process_run
    assert zero["world_size"] == one["world_size"] == 2
    for a, b in zip(zero["end"], one["end"], strict=True):
        assert torch.equal(a, b), "both ranks must end with bitwise identical adapter weights"
    moved = [not torch.equal(a, b) for a, b in zip(zero["start"], zero["end"], strict=True)]
    assert sum(moved) >= len(moved) - 1, "the adapter is trained"
    # The main process alone logs, and it logs every process's trajectories once.
    metrics = read_jsonl(root / "run" / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [0, 1, 2]  # two epochs and the final evaluation
    for epoch in (0, 1):
        traces = _epoch_traces(root / "run", epoch)
        assert sorted((r["batch"], r["row"]) for r in traces) == [(b, k) for b in range(4) for k in range(2)]
    assert metrics[0]["trajectories_trained"] <= 8 and metrics[0]["optimizer_steps"] >= 1


def test_gathered_advantages_equal_a_single_process_computation(two_process_run, tiny_weights, tmp_path):
    root, _ = two_process_run
    single = Trainer(load_recipe(recipe(tmp_path, tiny_weights), [*SMALL_BATCHES, "train.epochs=1"]))
    single.fit()
    two, one = _epoch_traces(root / "run", 0), _epoch_traces(single.run_dir, 0)
    assert len(two) == len(one) == 8
    for a, b in zip(two, one, strict=True):
        # the same trajectories (same batches, seeds and weights), whatever the process that sampled them
        assert (a["group"], a["batch"], a["row"]) == (b["group"], b["batch"], b["row"])
        assert a["trace"] == b["trace"]
    step_rewards = torch.tensor([r["step_rewards"] for r in one], dtype=torch.float64)
    expected = group_advantages(step_rewards, [r["group"] for r in one])
    gathered = torch.tensor([r["advantages"] for r in two], dtype=torch.float64)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(gathered, expected, rtol=0, atol=1e-12)
    assert len({r["group"] for r in two[:4]} | {r["group"] for r in two[4:]}) == 2


def test_a_two_process_checkpoint_resumes_on_one_process(two_process_run, tiny_weights, tmp_path):
    root, _ = two_process_run
    _resume_on_one_process(root, recipe(tmp_path, tiny_weights), SMALL_BATCHES, tmp_path)


def _resume_on_one_process(root: Path, recipe_path: Path, sets: list[str], tmp_path: Path) -> None:
    """A copy of the 2-process run under ``root``, its newest checkpoint removed, resumed by one process: it resumes
    at epoch 1 and samples epoch 1's trajectories as the 2 processes did (the same weights)."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    shutil.rmtree(find_checkpoint(run)[0])
    trainer = Trainer(load_recipe(recipe_path, sets), resume=True)
    assert trainer.epoch == 1
    trainer.fit()
    for a, b in zip(_epoch_traces(run, 1), _epoch_traces(root / "run", 1), strict=True):
        assert a["trace"] == b["trace"], "epoch 1 samples the same trajectories from the same weights on 1 process"


def test_a_process_count_that_cannot_share_the_epoch_is_refused(two_process_run):
    from tests.cli_run import tpflow

    root, _ = two_process_run
    command = ["train", str(root / "tiny.toml"), "--num-processes", "3"]
    command += [a for o in SMALL_BATCHES for a in ("--set", o)]
    out = tpflow(*command)  # refused before any process starts
    assert out.returncode == 2
    assert "3 processes cannot share the epoch" in out.stderr and "[1, 2, 4]" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_error_in_the_processes_exits_2_with_its_message(
    two_process_run, tmp_path, tiny_weights, capfd, monkeypatch
):
    root, _ = two_process_run
    # A shapes-dit config beside tensors that are not the model's: the file passes the checks before the launch and
    # fails to load in the processes (a missing file is refused before any process starts).
    safetensors.torch.save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    shutil.copy(tiny_weights.with_suffix(".json"), tmp_path / "other.json")
    for weights, expected in (("other", "one of the processes exited with status 2"), ("missing", "are missing")):
        command = ["train", str(root / "tiny.toml"), "--num-processes", "2"]
        command += ["--run-dir", str(tmp_path / "run"), "--set", f"backbone.weights={tmp_path / weights}.safetensors"]
        command += [a for o in SMALL_BATCHES for a in ("--set", o)]
        out = tpflow_launching(capfd, monkeypatch, *command)  # "missing": refused here, before any process starts
        assert out.returncode == 2, out.stderr
        assert f"{weights}.safetensors" in out.stderr and expected in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_two_machines_of_one_process_each_train_the_same_model(two_process_run, tmp_path):
    """The multi-machine launch (static rendezvous at --main-process-ip), with both "machines" on localhost: each a
    launcher forked from this process (torch imported), which starts its machine's process (a new interpreter)."""
    from tests.distributed_workers import free_port

    root, _ = two_process_run
    port = free_port()
    command = ["train", str(root / "tiny.toml"), "--epochs", "1"]
    command += ["--run-dir", str(tmp_path / "run"), "--num-processes", "1", "--num-machines", "2"]
    command += ["--main-process-ip", "127.0.0.1", "--main-process-port", str(port)]
    command += [a for o in SMALL_BATCHES for a in ("--set", o)]
    one_thread = {"OMP_NUM_THREADS": "1"}
    machines = [
        TpflowForked(*command, "--machine-rank", str(r), folder=tmp_path / f"m{r}", env=one_thread, session=True)
        for r in range(2)
    ]
    try:
        codes = [m.wait(300) for m in machines]
    finally:
        for machine in machines:
            machine.kill_group()
    outs = [m.output() for m in machines]
    assert codes == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "2 processes" in outs[0][0] and outs[1][0] == "", "machine 0's process alone reports"
    after_epoch_0 = sorted((root / "run" / "checkpoints").iterdir())[0]  # the 2-process run's epoch-0 checkpoint
    expected = safetensors.torch.load_file(next((after_epoch_0 / "adapter").glob("*.safetensors")))
    got = _final_adapter(tmp_path / "run")
    assert all(torch.equal(expected[k], got[k]) for k in expected), "the same model as the 2-process run"


def test_eval_on_two_processes_equals_one_process(two_process_run, tmp_path, capfd, monkeypatch):
    """`tpflow eval --num-processes 2` deals the images to two processes and gathers: the same figures as one."""
    import json

    from tests.cli_run import tpflow

    root, _ = two_process_run
    command = ["eval", str(root / "run"), "--steps", "3", "--images-per-prompt", "2"]
    one_process = tpflow(*command, "--out", str(tmp_path / "one"))  # in this process
    two_out = ["--out", str(tmp_path / "two"), "--num-processes", "2"]
    two_processes = tpflow_launching(capfd, monkeypatch, *command, *two_out)  # the launcher starts two new ones
    for out in (one_process, two_processes):
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.count("overall") == 1  # one process prints the table
    one, two = (json.loads((tmp_path / n / "eval.json").read_text())["target"] for n in ("one", "two"))
    assert len(one["images"]) == 12
    assert [i["prompt"] for i in two["images"]] == [i["prompt"] for i in one["images"]]
    assert [i["score"] for i in two["images"]] == pytest.approx([i["score"] for i in one["images"]], abs=1e-6)
    assert two["metrics"]["eval_reward"] == pytest.approx(one["metrics"]["eval_reward"], abs=1e-6)


def test_nft_on_two_processes_trains_one_model(two_process_runs):
    """DiffusionNFT's update on 2 processes: each re-noises its own final samples (each sample's times and noise
    drawn from its row in the epoch, as on one process), the gradients are averaged, and both ranks end with the same
    adapter, bit for bit (the old policy follows from it)."""
    folder, (zero, one) = two_process_runs["nft"]
    assert zero["world_size"] == one["world_size"] == 2
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))
    moved = [not torch.equal(a, b) for a, b in zip(zero["start"], zero["end"], strict=True)]
    assert sum(moved) >= len(moved) - 1, "the adapter is trained"
    metrics = read_jsonl(folder / "run" / "metrics.jsonl")
    assert metrics[-1]["trajectories_trained"] == 8 and metrics[-1]["optimizer_steps"] >= 1


def test_two_processes_replay_one_buffer_and_train_one_model(two_process_runs):
    """Replay on 2 processes: each admits its own rows of the gathered advantages, the admitted rows are gathered (a
    ragged share each), epoch 1 replays them all, dealt over the two, the checkpoints' collective comparison of the
    buffers passes, and both ranks end with the same adapter, bit for bit. What epoch 0 admitted is what its logged
    advantages (every process's rows) admit."""
    folder, (zero, one) = two_process_runs["replay"]
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))
    metrics = read_jsonl(folder / "run" / "metrics.jsonl")
    scores = [sum(r["advantages"]) / len(r["advantages"]) for r in _epoch_traces(folder / "run", 0)]
    assert metrics[0]["replay_admitted"] == sum(s >= 0.5 for s in scores) > 0
    assert metrics[1]["replay_drawn"] == metrics[1]["replay_rows_trained"] == min(6, metrics[0]["replay_admitted"])
    state = safetensors.torch.load_file(find_checkpoint(folder / "run")[0] / "replay.safetensors")
    assert len(state["row"]) == min(6, metrics[1]["replay_held"])  # what epoch 2 could draw


def test_an_fsdp_sharded_run_trains_the_whole_model_as_a_replicated_one_does(two_process_runs):
    """``[train] shard = "fsdp"`` on 2 processes: both end with one model (gathered whole), trained, where the same
    2-process run with the model replicated on each process ends, up to the float rounding of the sharded
    reduction (its evaluations included: 6 images, 3 per process); both sample the same trajectories in epoch 0.
    Their rollout batches make different numbers of velocity calls (``UNEVEN_CALLS``): the process with fewer
    repeats forwards to stay in step, which changes nothing it samples (it aborted with "collective mismatch")."""
    root, (zero, one) = two_process_runs["fsdp"]
    replicated_root, (replicated, _) = two_process_runs["full"]
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["repeats"] + one["repeats"] > 0, "the test's batches make as many calls: nothing was padded"
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))
    start, end = (torch.cat([t.flatten() for t in zero[k]]) for k in ("start", "end"))
    moved = end - start
    assert moved.norm() > 0
    other = torch.cat([t.flatten() for t in replicated["end"]])
    # measured 1.0e-3 of the movement after 4 AdamW steps: the sharded sum rounds otherwise (one step's gradient
    # is within 4e-7, tests/test_distributed.py), and AdamW moves a weight whose gradient is near 0 by about the
    # learning rate whatever its sign
    assert float((other - end).norm() / moved.norm()) < 1e-2
    for a, b in zip(_epoch_traces(root / "run", 0), _epoch_traces(replicated_root / "run", 0), strict=True):
        assert a["trace"] == b["trace"]
    assert [m["epoch"] for m in read_jsonl(root / "run" / "metrics.jsonl")] == [0, 1, 2]


def test_an_fsdp_run_resumes_on_two_processes_from_what_a_kill_leaves(two_process_runs, tmp_path, capfd, monkeypatch):
    """What a kill of a sharded 2-process launch leaves once its first checkpoint (each process's shards) is in place
    (that checkpoint, logs that run past it, a later checkpoint's unfinished ``.tmp-*`` folder), made from a copy of
    the uninterrupted run, resumed by ``tpflow train --num-processes 2 --resume``: sharded again, it ends bitwise
    where the uninterrupted run did, with the same metrics. (A real SIGKILL of a writer: tests/test_nft_train.py;
    a real stop of a launched sharded run: the Ctrl-C test below, whose checkpoint equals the uninterrupted one.)"""
    root, _ = two_process_runs["fsdp"]
    run = tmp_path / "run"
    first, *later = what_a_kill_leaves(root / "run", run)
    assert later, "the uninterrupted run wrote more than one checkpoint"
    step = int(re.sub(r"\D", "", later[0].name))
    dead = subprocess.Popen(["true"])  # a process that has ended: the killed writer's pid
    dead.wait()
    (run / "checkpoints" / f".tmp-{step}-{dead.pid}").mkdir()  # the writer, killed mid-checkpoint
    (run / ".lock").unlink(missing_ok=True)
    sets = [a for o in FSDP_SETS for a in ("--set", o)]
    command = ["train", str(root / "tiny.toml"), "--run-dir", str(run), "--num-processes", "2", *sets]
    out = tpflow_launching(capfd, monkeypatch, *command, "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "FSDP-sharded over 2" in out.stdout
    straight, resumed = _final_adapter(root / "run"), _final_adapter(run)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert comparable_metrics(run) == comparable_metrics(root / "run")
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir()), "the leftover is tidied"


def test_an_fsdp_sharded_lora_run_ends_bitwise_where_the_replicated_one_does(two_process_runs):
    """A LoRA on a sharded base, 2 processes, one epoch: its gradient is reduced once per step, after each process
    summed its own losses as a replicated process does (``deferred_sync``), so it ends with the replicated run's
    adapter after epoch 0, bit for bit (reduced after every loss, the sums rounded otherwise)."""
    _, (zero, one) = two_process_runs["lora-fsdp"]
    root, _ = two_process_runs["grpo"]
    after_epoch_0 = sorted((root / "run" / "checkpoints").iterdir())[0]  # the replicated run's epoch-0 checkpoint
    backbone = load_recipe(root / "tiny.toml", SMALL_BATCHES).build("backbone")
    load_checkpoint(after_epoch_0).load_weights(backbone)
    expected = [p.detach() for p in backbone.trainable_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))


def test_ctrl_c_to_a_sharded_runs_launcher_stops_the_processes_together_to_save(two_process_runs, tmp_path):
    """SIGINT to the launcher of a sharded 2-process run once epoch 0 has ended, and SIGTERM to its process 1 (as
    Slurm signals every process), no checkpoint of a later state on disk (save_every 3): the processes stop together
    at the next safe point of epoch 1 (its start, the end of its evaluation or of a rollout batch), on SIGTERM or on
    SIGINT (which one depends on whether process 1 ran its handler before that point's all-reduce), and write its
    checkpoint together, nothing temporary left behind. Its shards (weights, AdamW's moments, the EMA) and RNG
    state are those of the uninterrupted run's checkpoint of the same step, bit for bit, so --resume continues as
    that run did (as the SIGKILL test resumes such a checkpoint). It used to print "saving epoch 1", die with
    "Connection reset by peer" and leave only a .tmp-* folder; a SIGTERM to a process killed it."""
    root, _ = two_process_runs["fsdp"]
    run = tmp_path / "run"
    sets = [a for o in [*FSDP_SETS, "train.save_every=3"] for a in ("--set", o)]
    # the launcher forked from this process (torch imported), leading a session of its own; its processes are new
    # interpreters
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path]),
    }
    command = ["train", str(root / "tiny.toml"), "--run-dir", str(run), "--num-processes", "2", *sets]
    proc = TpflowForked(*command, folder=tmp_path / "out", env=env, session=True)
    try:
        deadline = time.monotonic() + 300
        while not re.search(r"^epoch   0", proc.output()[0], re.MULTILINE):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(proc.output())[-3000:]
            time.sleep(0.05)
        # SIGTERM to process 1 (the default action would kill it), and the launcher's copy of the SIGINT within 2 s:
        # the same request
        os.kill(_launched_process(proc.pid, rank=1), signal.SIGTERM)
        os.kill(proc.pid, signal.SIGINT)  # the launcher alone: it passes the signal on to its processes
        proc.wait(300)
    finally:
        proc.kill_group()
    output = "".join(proc.output())
    assert proc.returncode == 130, output[-3000:]
    assert re.search(r"Interrupted \((SIGTERM|Ctrl-C)\): saving epoch", output), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "interrupted (SIGINT); resume with" in output, output[-3000:]  # the launcher's line, its only one
    assert "death signal" not in output, output[-3000:]
    (saved,) = (run / "checkpoints").iterdir()  # one checkpoint, no .tmp-* folder
    ckpt = load_checkpoint(saved)
    assert ckpt.train_state["epoch"] in (1, 2) and ckpt.layout["processes"] == 2
    straight = load_checkpoint(root / "run" / "checkpoints" / saved.name)  # the same step, uninterrupted
    assert straight.train_state["epoch"] == ckpt.train_state["epoch"]
    for name in sorted(p.name for p in (straight.path / "shards").iterdir()):
        ours, theirs = (safetensors.torch.load_file(c.path / "shards" / name) for c in (ckpt, straight))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert torch.equal(ckpt.rng_state["torch"], straight.rng_state["torch"])


def _launched_process(launcher: int, rank: int) -> int:
    """The pid of the process of ``rank`` that the launcher ``launcher`` started (its child with RANK=rank)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0") if parent == launcher else []
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    raise AssertionError(f"no process of rank {rank} under launcher {launcher}")


def test_a_sharded_runs_checkpoint_holds_each_process_shards_and_loads_whole_on_one_process(two_process_runs):
    """``checkpoint_layout = "sharded"`` (the default): each of the 2 processes wrote its own safetensors file of
    shards, no adapter folder, nothing pickled; one process reads the weights back whole into a fresh backbone
    (what ``tpflow export`` and ``tpflow eval`` do), equal to the model the processes ended with, and the EMA whole.
    The gathered layout (the DanceGRPO run's) writes the adapter folder as an unsharded run does."""
    root, (zero, _) = two_process_runs["fsdp"]
    path, _ = find_checkpoint(root / "run")
    assert not (path / "adapter").exists() and (path / "layout.json").is_file()
    assert sorted(p.name for p in (path / "shards").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]  # fmt: skip
    ckpt = load_checkpoint(path)
    assert ckpt.layout["processes"] == 2 and checkpoint_shards.markers(ckpt.optimizer_state)
    backbone = load_recipe(root / "tiny.toml", FSDP_SETS).build("backbone")
    ckpt.load_weights(backbone)
    loaded = [p.detach() for p in backbone.trainable_parameters()]
    assert len(loaded) == len(zero["end"]) and all(torch.equal(a, b) for a, b in zip(loaded, zero["end"], strict=True))
    ema = ckpt.full_ema()
    assert ema is not None and [tuple(t.shape) for t in ema.values()] == [tuple(t.shape) for t in loaded]
    gathered, _ = find_checkpoint(two_process_runs["dance"][0] / "run")
    assert (gathered / "adapter").is_dir() and not (gathered / "shards").exists()


def test_an_fsdp_checkpoint_resumes_on_one_process(two_process_runs, tiny_weights, tmp_path):
    """The sharded run's checkpoint, written as each process's shards, read whole by one process (resharded): it
    resumes at epoch 1 and samples epoch 1's trajectories from the same weights."""
    root, _ = two_process_runs["fsdp"]
    _resume_on_one_process(root, fsdp_recipe(tmp_path, tiny_weights), FSDP_SETS, tmp_path)


def test_an_fsdp_sharded_run_of_a_trained_subset_of_steps_trains_as_a_replicated_one(two_process_runs):
    """DanceGRPO's trained-fraction plan (packed losses: one per step each trajectory trains, as many on every
    process) under ``shard = "fsdp"``: the 2 processes stay in step and end where the replicated run ends."""
    root, (zero, one) = two_process_runs["dance"]
    _, (replicated, _) = two_process_runs["dance-full"]
    assert all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))
    start, end, other = (torch.cat([t.flatten() for t in w]) for w in (zero["start"], zero["end"], replicated["end"]))
    assert (end - start).norm() > 0
    assert float((other - end).norm() / (end - start).norm()) < 1e-2
    assert read_jsonl(root / "run" / "metrics.jsonl")[0]["optimizer_steps"] >= 1


@pytest.mark.parametrize("name", list(NEWEST_SETS))
def test_the_newest_methods_train_on_two_processes_as_on_one(two_process_runs, tiny_weights, tmp_path, name):
    """E-GRPO's merged entropy steps, AdaGRPO's anchors dealt over the processes and its fused advantage, GARDO's
    adaptive reference on nft: both ranks end with one adapter, bit for bit, and it moved, where a single process
    trains the same recipe with the same optimizer steps (up to float rounding: the gradient's sums run in another
    order). nft's times and noise are drawn per sample (its global row), not per process; each process shuffles its
    own rows, so its run is compared at one optimizer step per pass (2 x 2 rows, accumulated twice), whose rows are
    every row whatever the order. GARDO's reference: every process saw the same KL and reset alike (the
    checkpoint's collective comparison passed), logged once."""
    folder, (zero, one) = two_process_runs[name]
    assert zero["world_size"] == 2 and all(torch.equal(a, b) for a, b in zip(zero["end"], one["end"], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(zero["start"], zero["end"], strict=True)), "the adapter moved"
    if name == "gardo-nft":
        metrics = read_jsonl(folder / "run" / "metrics.jsonl")
        assert [m["reference_age"] for m in metrics] == [0.0] and metrics[0]["optimizer_steps"] >= 1, metrics
    # one process takes the two processes' micro-batches of 2 rows as one of 4: the same optimizer steps
    sets = [*NEWEST_SETS[name], "optimizer.micro_batch_size=4"]
    single = Trainer(load_recipe(_newest_recipe(name, tmp_path, tiny_weights), sets))
    single.fit()
    alone = [p.detach() for p in single.backbone.trainable_parameters()]
    for a, b in zip(alone, zero["end"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
