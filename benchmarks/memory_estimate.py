"""Peak GPU memory per process of each paper recipe, and its time per epoch, ESTIMATED without a GPU (fake tensors).

    .venv/bin/python benchmarks/memory_estimate.py --out docs/results     # the paper recipes, full size
    .venv/bin/python benchmarks/memory_estimate.py --tiny                 # tiny-sd3 / tiny-flux sizes (a check)
    .venv/bin/python benchmarks/memory_estimate.py --recipes sd35/geneval_flowgrpo_full   # one recipe

Why: the distributed-training doc needs the memory each recipe needs per GPU, and the machines that write it have no
GPU. The estimate itself is ``tpflow.memory`` (method and caveats: ``tpflow.memory.report.CAVEATS``; the reward
models from their published sizes, the time from the FLOPs counted on the same calls: ``tpflow.memory.timing``),
which ``tpflow validate --gpu-memory`` runs too; this script writes its report for several recipes (about 10 minutes
on one CPU core for all of them).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

from tpflow.memory import CAVEATS, GIB, load_setup, measure, report, tiny_setup

RECIPES = (  # paths under recipes/ without .toml; the report names each by its stem
    "geneval_tp", "sd35/ocr_tp", "sd35/pickscore_tp", "flux/flux_pickscore_tp", "sd35/pickscore_sd35large_tp",
    "qwen_image/geneval_qwenimage_tp", "sd35/geneval_flowgrpo_full", "qwen_image/geneval_qwenimage_flowgrpo_sharded",
    "wan/wan_dancegrpo", "wan/wan_tp", "sd35/geneval_nft", "sd35/geneval_awm", "sd35/geneval_dgpo",
)  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write memory_estimate.md into this folder")
    parser.add_argument("--tiny", action="store_true", help="tiny-sd3 / tiny-flux sizes: checks the code, seconds")
    parser.add_argument(
        "--recipes", nargs="*", default=list(RECIPES), help="recipe paths under recipes/ without .toml (sd35/ocr_tp)"
    )
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    if args.tiny:
        setups = [tiny_setup("sd3"), tiny_setup("flux")]
    else:
        setups = [load_setup(root / "recipes" / f"{name}.toml") for name in args.recipes]
    sections, cache = [], {}
    for setup in setups:
        key = (setup.kind, repr(setup.backbone), repr(setup.rollout), repr(setup.train), repr(setup.optimizer))
        start = time.perf_counter()
        if key not in cache:  # geneval / ocr / pickscore share every memory-relevant setting
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FakeTensor's deprecation notices from inside diffusers
                cache[key] = measure(setup)
        print(f"{setup.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        sections.append(report(setup, cache[key], unit=2**10 if args.tiny else GIB))
    text = "# Estimated peak GPU memory per process\n\n" + CAVEATS + "\n" + "\n".join(sections)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_estimate.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
