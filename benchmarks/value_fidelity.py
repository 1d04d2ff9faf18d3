"""Do the completions' rewards measure the states' values? The premise of TP-GRPO's step credit (docs/results.md §3.3).

    .venv/bin/python benchmarks/value_fidelity.py [--recipe PATH] [--checkpoint RUN_DIR] [--prompts 8] [--copies 2]
        [--M 32] [--ks 1 2 3] [--seed 0] [--threads 1] [--cache runs/value_fidelity] [--out FILE]

TP-GRPO credits window step j with d_j = R_{j+1} − R_j, where R_j is the reward of the ODE completion from the state
x_j entering window step j (docs/algorithm.md §3). That is a credit for the step only if R_j measures the state's
value under the policy, V(x_j) = E[R(x_K) | x_j] with the remaining window steps sampled by the SDE
(``tpflow.probe.value``: M continuations per state). This benchmark samples trajectories as training does (the
recipe's model, sampler, window draw and reward; one rollout batch per prompt, ``--copies`` trajectories each), once
with exact ODE completions, once per k-step completion (``completion_steps = k``) and once with the x0 estimate —
the main trajectories bitwise the same in every variant (checked; velocity calls of at most ``--copies`` rows, see
``paired_max_batch``) — estimates V_0..V_{W-1} of their states (V_W is
R_W), and reports per variant, pooled over every (trajectory, j):

* NFE per trajectory of the variant's rollout;
* sign agreement of d_j with the MC increments V_{j+1} − V_j (sign 0 its own class), and the same over the
  increments that the MC resolves, |V_{j+1} − V_j| > 2·sqrt(SE_j² + SE_{j+1}²);
* Spearman's rank correlation of R_j with V_j (states j < W) and of the increments; the mean |R_j − V_j|;
* the ``consistent`` assigner's turning points (the recipe's credit options, per rollout batch as training balances
  them) on the completion trace against those on the MC trace V_0..V_W: precision and recall, counts in parentheses.

Default recipe: the Evidence II task (``benchmarks/evidence.py``: ``recipe_data(REGIME, 10, "cpu")``, shapes-dit
with the soft shapes-geneval reward). Each trajectory's MC values are cached under ``--cache`` (a JSON file keyed by
the recipe, M, the seed and the trajectory's own latents), so an interrupted run resumes where it stopped. Not run
in CI (tests/test_benchmarks_smoke.py runs it at toy size).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from scipy.stats import spearmanr

import tpflow
from tpflow.devices import cpu_generator
from tpflow.probe.arms import paired_max_batch, same_main_trajectories
from tpflow.probe.value import Values, mc_values
from tpflow.recipe import apply_overrides, load_recipe, validate_recipe
from tpflow.rollout import draw_window, rollout_from_settings
from tpflow.scoring.call import recipe_policy
from tpflow.train.scoring import score_rollout
from tpflow.types import Rollout

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from completion_fidelity import _fit  # noqa: E402
from evidence import BASE_RECIPE, REGIME, recipe_data  # noqa: E402


@dataclass
class Batch:
    """One rollout batch (one prompt, ``copies`` trajectories) and where its window sat."""

    rollout: Rollout  # the exact variant's: its stored states are every variant's
    start: int  # window start s
    prompt: str
    metadata: dict[str, Any]


def build(recipe_path: Path | None, overrides: list[str]):
    """The recipe and its label: a TOML file, or the Evidence II task with ``overrides``."""
    if recipe_path is not None:
        return load_recipe(recipe_path, overrides), recipe_path.name
    data = recipe_data(REGIME, 10, "cpu")
    apply_overrides(data, overrides)
    return validate_recipe(data, where="Evidence II task", path=BASE_RECIPE), "Evidence II task (evidence.py)"


def pick_prompts(items: list, count: int, seed: int) -> list[int]:
    """``count`` item indices, round-robin over the metadata tags (in a seeded order) when every item has one."""
    rng = random.Random(seed)
    if not all("tag" in item.metadata for item in items):
        return rng.sample(range(len(items)), min(count, len(items)))
    by_tag: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_tag.setdefault(item.metadata["tag"], []).append(i)
    pools = [rng.sample(by_tag[t], len(by_tag[t])) for t in rng.sample(sorted(by_tag), len(by_tag))]
    picks = [pool[r] for r in range(max(map(len, pools))) for pool in pools if r < len(pool)]
    return picks[:count]


def sample(recipe, backbone, sampler, reward, items, picks, copies, ks, seed):
    """The batches and, per variant, its traces [copies, W+1] per batch, NFE per trajectory and rollout seconds."""
    r = recipe.rollout.model_copy(update={"max_batch": paired_max_batch(copies, recipe.rollout.max_batch)})
    names = [("exact", "ode", "all"), *((f"k={k}", "ode", k) for k in ks), ("x0", "x0", "all")]
    out = {name: {"traces": [], "nfe": 0.0, "rollout_s": 0.0} for name, _, _ in names}
    batches = []
    warm = backbone.encode([items[picks[0]].prompt])  # one untimed call first: it pays for the warm-up
    window = draw_window(r.num_steps, r.window_size, r.window_range, random.Random(seed))
    rollout_from_settings(backbone, sampler, warm, [0], window, r, "ode", cpu_generator(seed))
    for b, index in enumerate(picks):
        item = items[index]
        cond = backbone.encode([item.prompt] * copies)
        window = draw_window(r.num_steps, r.window_size, r.window_range, random.Random(seed * 100_003 + b))
        for name, completions, steps in names:
            settings = r.model_copy(update={"completions": completions, "completion_steps": steps})
            start = time.perf_counter()
            roll = rollout_from_settings(
                backbone, sampler, cond, [0] * copies, window, settings, completions, cpu_generator(seed + b)
            )
            rollout_s = time.perf_counter() - start
            if name == "exact":
                batches.append(Batch(roll, window.start, item.prompt, dict(item.metadata)))
            elif not same_main_trajectories(roll, batches[-1].rollout):
                raise RuntimeError(f"variant {name}: the main trajectories differ from the exact variant's.")
            scored = score_rollout(backbone.decode, reward, roll.final, roll.completions, [item.prompt] * copies,
                                   [item.metadata] * copies, window.size, chunk=recipe.train.score_batch,
                                   policy=recipe_policy(recipe.train))  # fmt: skip
            v = out[name]
            v["traces"].append(scored.trace.double())  # [copies, W+1]
            v["nfe"] += roll.cost.nfe / len(picks)
            v["rollout_s"] += rollout_s
    if 1 in ks and all(torch.equal(a, b) for a, b in zip(out["x0"]["traces"], out["k=1"]["traces"], strict=True)):
        del out["x0"]  # the x0 estimate is the one-step completion: its row would repeat k=1's
    return batches, out


def values(recipe, backbone, sampler, reward, batches, samples, seed, cache, tag) -> tuple[list[Values], dict]:
    """MC values per batch (``tpflow.probe.value``), each trajectory's read from ``cache`` when it is there."""
    sigmas = backbone.sigmas(recipe.rollout.num_steps)
    out, spent, fresh = [], 0.0, 0
    total = sum(len(batch.rollout) for batch in batches)
    for b, batch in enumerate(batches):
        parts = []
        for c in range(len(batch.rollout)):
            traj_seed = random.Random(f"{seed}/value/{b}/{c}").getrandbits(63)
            one = batch.rollout.index(torch.tensor([c], device=batch.rollout.device))
            path = None if cache is None else cache / f"{_key(recipe, one, samples, traj_seed, tag)}.json"
            if path is not None and path.is_file():
                record = json.loads(path.read_text())
            else:
                start = time.perf_counter()
                got = mc_values(backbone, sampler, reward, one, sigmas, batch.start, [batch.prompt],
                                [batch.metadata], samples, cpu_generator(traj_seed), chunk=recipe.train.score_batch,
                                policy=recipe_policy(recipe.train), max_batch=recipe.rollout.max_batch)  # fmt: skip
                record = {"mean": got.mean[0].tolist(), "se": got.se[0].tolist(), "nfe": got.nfe[0].tolist(),
                          "seconds": time.perf_counter() - start, "prompt": batch.prompt}  # fmt: skip
                fresh += 1
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(record))
                    os.replace(tmp, path)  # atomic: a cached trajectory is wholly there or not at all
            spent += record["seconds"]
            parts.append(record)
            done = sum(len(x.rollout) for x in batches[:b]) + c + 1
            print(f"[{done}/{total}] MC values, {record['seconds']:.1f} s", file=sys.stderr, flush=True)
        stack = {
            k: torch.tensor([p[k] for p in parts], dtype=torch.float64, device="cpu") for k in ("mean", "se", "nfe")
        }
        out.append(Values(stack["mean"], stack["se"], stack["nfe"], samples))
    return out, {"seconds": spent, "fresh": fresh, "total": total}


def _key(recipe, one: Rollout, samples: int, traj_seed: int, tag: str) -> str:
    """What a trajectory's MC values depend on: the recipe, the adapter, M, their seed and the states themselves."""
    h = hashlib.sha256(json.dumps([recipe.data, tag, samples, traj_seed], sort_keys=True, default=str).encode())
    for t in (one.latents, one.final):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def compare(traces: list[torch.Tensor], vals: list[Values], assigner) -> dict:
    """One variant's row against the MC values (module docstring); V_W is R_W."""
    trace = torch.cat(traces)  # [N, W+1]
    width = trace.shape[1] - 1
    value = torch.cat([v.mean for v in vals]).clone()
    value[:, width] = trace[:, width]
    se = torch.cat([v.se for v in vals])
    d, dv = trace.diff(dim=1), value.diff(dim=1)  # [N, W]
    resolved = dv.abs() > 2 * (se[:, :-1] ** 2 + se[:, 1:] ** 2).sqrt()
    agree = torch.sign(d) == torch.sign(dv)
    row = {
        "sign_agreement": float(agree.double().mean()),
        "resolved_agreement": float(agree[resolved].double().mean()) if resolved.any() else float("nan"),
        "resolved": int(resolved.sum()),
        "spearman_values": _spearman(trace[:, :width], value[:, :width]),
        "spearman_increments": _spearman(d, dv),
        "mae": float((trace[:, :width] - value[:, :width]).abs().mean()),
    }
    start, hits, got, ref = 0, 0, 0, 0
    for t in traces:  # per rollout batch, as the trainer balances
        rows = slice(start, start + t.shape[0])
        start += t.shape[0]
        mine, mc = assigner(t).turning_points, assigner(value[rows]).turning_points
        hits, got, ref = hits + int((mine & mc).sum()), got + int(mine.sum()), ref + int(mc.sum())
    nan = float("nan")
    row.update(tp_precision=hits / got if got else nan, tp_recall=hits / ref if ref else nan, tp=got, tp_mc=ref)
    return row


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().numpy(), b.flatten().numpy()
    return float(spearmanr(a, b).statistic) if a.std() > 0 and b.std() > 0 else float("nan")


def table(rows: dict[str, dict], notes: list[str]) -> str:
    head = (
        "| completions | NFE / traj | rollout s | sign(d_j) = sign(ΔV) | same, resolved ΔV (n) | Spearman R_j, V_j "
        "| Spearman d_j, ΔV | mean abs(R_j − V_j) | consistent TP precision (n) | recall (n MC) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {name} | {r['nfe']:.1f} | {r['rollout_s']:.1f} | {r['sign_agreement']:.3f} "
        f"| {r['resolved_agreement']:.3f} ({r['resolved']}) | {r['spearman_values']:.3f} "
        f"| {r['spearman_increments']:.3f} | {r['mae']:.4f} | {r['tp_precision']:.3f} ({r['tp']}) "
        f"| {r['tp_recall']:.3f} ({r['tp_mc']}) |"
        for name, r in rows.items()
    ]
    return head + "\n".join(lines) + "\n\n" + "\n".join(f"* {n}" for n in notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=None, help="a TOML recipe (default: the Evidence II task)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a run dir or checkpoint whose adapter to load")
    parser.add_argument("--prompts", type=int, default=8, help="rollout batches, one prompt each, balanced over tags")
    parser.add_argument("--copies", type=int, default=2, help="trajectories per prompt")
    parser.add_argument("--M", type=int, default=32, help="MC continuations per state")
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3], help="k-step completions to compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--set", action="append", default=[], help="recipe override, section.key=value")
    parser.add_argument(
        "--cache", type=Path, default=ROOT / "runs" / "value_fidelity", help="MC values per trajectory"
    )
    parser.add_argument("--no-cache", action="store_true", help="compute every MC value afresh, store none")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write (default: print only)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    recipe, label = build(args.recipe, args.set)
    torch.manual_seed(args.seed)
    backbone, sampler, reward = recipe.build("backbone"), recipe.build("sampler"), recipe.build("reward")
    tag = "base"
    if args.checkpoint is not None:
        from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint

        path, found = find_checkpoint(args.checkpoint)
        for note in found:
            print(note, file=sys.stderr)
        if path is None:
            sys.exit(f"No valid checkpoint in {args.checkpoint}: pass a run dir or a checkpoints/<step> dir.")
        backbone.load_adapter(load_checkpoint(path).adapter_dir)
        tag = str(path.resolve())
    items = list(recipe.build("dataset").split("train"))
    picks = pick_prompts(items, args.prompts, args.seed)
    with torch.no_grad():
        batches, sampled = sample(recipe, backbone, sampler, reward, items, picks, args.copies, args.ks, args.seed)
        cache = None if args.no_cache else args.cache
        vals, mc = values(recipe, backbone, sampler, reward, batches, args.M, args.seed, cache, tag)
    exact = torch.cat(sampled["exact"]["traces"])
    width = exact.shape[1] - 1
    assigner = tpflow.build("credit", "consistent", **_fit(recipe.credit.options.model_dump(), "consistent"))
    rows = {name: {**compare(v["traces"], vals, assigner), **v} for name, v in sampled.items()}
    se = torch.cat([v.se[:, :width] for v in vals])
    last = (torch.cat([v.mean[:, width] for v in vals]) - exact[:, width]).abs().max()
    notes = [
        f"{exact.shape[0]} trajectories ({len(batches)} prompts x {args.copies}), W = {width}, window starts "
        f"{sorted({b.start for b in batches})}: {se.numel()} states x_0..x_(W-1), {se.numel()} increments.",
        f"M = {args.M} continuations per state: standard error mean {se.mean():.4f}, max {se.max():.4f}; "
        f"{torch.cat([v.nfe for v in vals]).sum(dim=1).mean():.0f} NFE per trajectory; {mc['seconds']:.0f} s "
        f"({mc['fresh']} of {mc['total']} trajectories computed in this run, the rest from the cache).",
        f"V_W is R_W (the final image's reward; scored again by the MC pass, they differ by at most {last:.2g}). "
        "Turning points: consistent, options " + json.dumps(assigner.options.model_dump()) + ", per rollout batch.",
        "x0 row left out: its completions are bitwise the k=1 ones." if "x0" not in sampled else "",
        f"rollout s: velocity calls of at most {paired_max_batch(args.copies, recipe.rollout.max_batch)} rows "
        "(paired_max_batch), not the recipe's batching; NFE is the cost that carries over.",
        f"{time.perf_counter() - began:.0f} s in all.",
    ]
    if recipe.rollout.baseline_noise == "independent":
        notes.append("baseline_noise = independent: R_0 is the ODE sample of other noise, not a completion of x_0.")
    text = table(rows, [n for n in notes if n])
    print(text)
    if args.out is not None:
        command = " ".join(shlex.quote(a) for a in ["benchmarks/value_fidelity.py", *(argv or sys.argv[1:])])
        machine = f"{platform.machine()} {platform.processor() or ''}".strip()
        args.out.write_text(
            f"# Completion rewards against Monte Carlo state values\n\n`{command}` on {machine} "
            f"({os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, torch {torch.__version__}, model on "
            f"{backbone_device(backbone)}), recipe {label}{' with ' + ', '.join(args.set) if args.set else ''}"
            f"{', adapter ' + tag if args.checkpoint else ''}.\n\n{text}"
        )
    return 0


def backbone_device(backbone) -> str:
    params = getattr(getattr(backbone, "model", None), "parameters", None)
    return str(next(params()).device) if params else "?"


if __name__ == "__main__":
    sys.exit(main())
