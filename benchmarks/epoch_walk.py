"""How many rooms one training epoch walks through: the files and packages of tpflow/ its code runs in, in order.

    .venv/bin/python benchmarks/epoch_walk.py [--recipe recipes/shapes_tp.toml] [--set KEY=VALUE ...]

A profile hook follows the main thread through one ``Trainer.train_epoch`` of a small shapes run (2 prompts × 4
images, one update) and writes down the tpflow file each executed Python frame belongs to, on every call and every
return; the background scoring thread is left out. Consecutive frames of one file are one stay. The walk is then
read at two grains:

* files: stays (raw: every loop's calls counted) and distinct files;
* rooms (a package of tpflow/, or a module at its root, as docs/architecture.md's Layers table places them): the
  distinct moves from one room to another (a move inside a loop counts once), the distinct climbs (a call from a
  room into one of a higher layer: code of a lower layer handing control up, through an object or a function it
  was given), and the rooms returned to (entered again after the walk had left them).

A reading of the code's shape, not of its speed: a change that moves the same work between fewer rooms lowers the
counts. Counts depend on the recipe (another optimizer walks other files); compare one recipe across commits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.epochs=1", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch=4",
         "optimizer.micro_batch_size=4", "eval.every=0", "log.trackers=[]", "rollout.num_steps=4",
         "rollout.window_size=2", "rollout.window_range=[0, 2]"]  # fmt: skip


def room_of(path: str) -> str | None:
    """``tpflow/train`` for tpflow/train/x.py, ``tpflow/recipe.py`` for a root module; None outside tpflow/."""
    try:
        parts = Path(path).resolve().relative_to(ROOT / "tpflow").parts
    except ValueError:
        return None
    return f"tpflow/{parts[0]}"  # a package's folder, or a root module's file


def walk_epoch(recipe: Path, sets: list[str]) -> tuple[list[str], set[tuple[str, str]]]:
    """The tpflow files the main thread runs in during one epoch, on every call and return, consecutive repeats
    merged (paths relative to the repository); and the distinct (caller, callee) file pairs of its calls from one
    tpflow file into another."""
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_recipe(recipe, [*SMALL, f"train.run_dir={tmp}/run", *sets]))
        main = threading.main_thread()
        stays: list[str] = []
        calls: set[tuple[str, str]] = set()

        def hook(frame, event, arg):  # noqa: ARG001 (the profile hook's signature)
            if event not in ("call", "return") or threading.current_thread() is not main:
                return
            path = frame.f_code.co_filename
            if room_of(path) is None:
                return
            where = Path(path).resolve().relative_to(ROOT).as_posix()
            if event == "return" and frame.f_back is not None:  # control goes back to the caller's file
                caller = frame.f_back.f_code.co_filename
                if room_of(caller) is None:
                    return
                where = Path(caller).resolve().relative_to(ROOT).as_posix()
            if event == "call" and stays and stays[-1] != where:
                calls.add((stays[-1], where))
            if not stays or stays[-1] != where:
                stays.append(where)

        sys.setprofile(hook)
        try:
            trainer.train_epoch(0)
        finally:
            sys.setprofile(None)
    return stays, calls


def layers() -> dict[str, int]:
    """docs/architecture.md's Layers table: place (``tpflow/x.py`` or ``tpflow/pkg/``) -> layer number."""
    sys.path.insert(0, str(ROOT))
    from tests.test_layers import layer_table

    text = (ROOT / "docs" / "architecture.md").read_text()
    return {place.rstrip("/"): number for place, (number, _) in layer_table(text).items()}


def summary(stays: list[str], calls: set[tuple[str, str]]) -> dict[str, int]:
    """The walk's counts. The raw ones grow with the loops (every sampler step is a call and a return); the distinct
    ones (each move between two rooms counted once, whatever the loop) read the code's shape."""
    table = layers()
    rooms = [room_of(str(ROOT / s)) for s in stays]
    merged = [r for i, r in enumerate(rooms) if i == 0 or rooms[i - 1] != r]
    moves = list(zip(merged, merged[1:], strict=False))
    distinct = set(moves)
    room_calls = {(room_of(str(ROOT / a)), room_of(str(ROOT / b))) for a, b in calls}
    climbing = {(a, b) for a, b in room_calls if a != b and table.get(b, 0) > table.get(a, 0)}
    left, returns = set(), set()
    for previous, current in moves:
        left.add(previous)
        if current in left:
            returns.add(current)
    return {"file stays": len(stays), "files": len(set(stays)), "room stays": len(merged), "rooms": len(set(merged)),
            "distinct moves between rooms": len(distinct), "distinct climbs": len(climbing),
            "rooms returned to": len(returns)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "shapes_tp.toml")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a recipe override, repeatable")
    args = parser.parse_args()
    stays, calls = walk_epoch(args.recipe, args.sets)
    for key, value in summary(stays, calls).items():
        print(f"{key}: {value}")
    table = layers()
    for a, b in sorted(calls):
        up = table.get(room_of(str(ROOT / b)), 0) > table.get(room_of(str(ROOT / a)), 0)
        if up and room_of(str(ROOT / a)) != room_of(str(ROOT / b)):
            print(f"  climbs: {a} calls {b}")
    print("most entered files:", ", ".join(f"{f} {n}" for f, n in Counter(stays).most_common(6)))


if __name__ == "__main__":
    main()
