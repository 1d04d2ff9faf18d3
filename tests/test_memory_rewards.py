"""The reward models in the memory estimate (tpflow.memory.rewards, `tpflow validate --gpu-memory`): each reward's
published size in the dtype its code loads, the trained, watched and diversity models counted on every process's
GPU, wrappers resolved, a model on the CPU or unknown to the table named in a note. The T5 encoder's ``wo`` in fp32
under fp16. Tiny models or none: seconds."""

from __future__ import annotations

import types
from pathlib import Path

from tests.test_memory_fit import TINY_SD3
from tpflow.memory import GIB, estimate_fit, setup_of
from tpflow.memory.accounting import component_rows
from tpflow.memory.rewards import DINO, MASK2FORMER_SWIN_S, OPEN_CLIP, PICKSCORE_V1, reward_models
from tpflow.recipe import load_recipe
from tpflow.settings import EvalSettings

ROOT = Path(__file__).resolve().parent.parent


def recipe(name: str, options: dict, **evaluation) -> types.SimpleNamespace:
    """What ``reward_models`` reads of a recipe: its reward section and its [eval] settings."""
    reward = types.SimpleNamespace(name=name, options=options)
    return types.SimpleNamespace(reward=reward, eval=EvalSettings(**evaluation))


def test_each_reward_is_its_published_size_in_the_dtype_it_loads():
    geneval = reward_models(recipe("geneval", {}))
    assert [m.nbytes for m in geneval.models] == [int(MASK2FORMER_SWIN_S * 4), int(OPEN_CLIP["ViT-L-14"] * 4)]
    assert 1.8 * GIB < geneval.nbytes < 1.9 * GIB and not geneval.notes  # GenEval's ~2 GB of weights
    assert reward_models(recipe("geneval", {"detector": "shapes"})).nbytes == 0
    assert reward_models(recipe("pickscore", {})).nbytes == int(PICKSCORE_V1 * 4)  # its default float32
    assert reward_models(recipe("pickscore", {"dtype": "bfloat16"})).nbytes == int(PICKSCORE_V1 * 2)
    assert reward_models(recipe("image-stat", {})).nbytes == 0
    assert reward_models(recipe("edit-consistency", {})).nbytes == int(OPEN_CLIP["ViT-L-14"] * 4)  # flow_grpo's CLIP
    assert reward_models(recipe("edit-consistency", {"features": "dino"})).nbytes == int(DINO["dinov2-base"] * 4)
    assert reward_models(recipe("edit-consistency", {"features": "pixel"})).nbytes == 0


def test_watched_rewards_the_diversity_embedding_and_wrapped_rewards_count_each_model():
    """A weighted reward holds each part's models; a watched reward and the diversity's open_clip are held from the
    first evaluation on; a reward on the CPU and a judge the table does not know are notes, not bytes."""
    parts = {"rewards": [{"name": "pickscore", "options": {"dtype": "float16"}}, {"name": "hpsv2"}]}
    found = reward_models(recipe("weighted", parts, rewards=[{"name": "clipscore"}, {"name": "aesthetic",
                          "options": {"device": "cpu"}}, {"name": "vlm-judge", "options": {"model": "/my/judge"}}],
                          diversity="clip:ViT-B-32", images_per_prompt=2))  # fmt: skip
    expected = PICKSCORE_V1 * 2 + OPEN_CLIP["ViT-H-14"] * 4 + OPEN_CLIP["ViT-L-14"] * 4 + OPEN_CLIP["ViT-B-32"] * 4
    assert abs(found.nbytes - expected) < 8  # each rounded down to whole bytes
    assert [m.what for m in found.models] == [
        "reward (weighted) 'pickscore': PickScore_v1 (CLIP ViT-H-14)",
        "reward (weighted) 'hpsv2': open_clip ViT-H-14",
        "eval.rewards 'clipscore': open_clip ViT-L-14",
        "eval.diversity: open_clip ViT-B-32",
    ]
    assert found.notes == [
        "eval.rewards 'aesthetic' runs on the CPU (its device option): not counted on the GPU",
        "reward 'vlm-judge': judge '/my/judge' is not in the table of published sizes; not counted",
    ]
    frames = reward_models(recipe("frames", {"reward": "pickscore", "options": {"dtype": "bfloat16"}}))
    assert frames.nbytes == int(PICKSCORE_V1 * 2)


def test_the_reward_models_are_in_the_static_bytes_and_the_verdict(tmp_path):
    """tiny-sd3 trained on PickScore (float32: 3.7 GiB): its weights are a row of the component table, in every
    process's static bytes whole, and in the verdict: with the CUDA context and the 1 GiB margin, not in 5 GiB."""
    path = tmp_path / "pick.toml"
    path.write_text(TINY_SD3.format(backbone="").replace('name = "image-stat"', 'name = "pickscore"'))
    fit = estimate_fit(load_recipe(path), 1, 5)
    row = ("reward 'pickscore': PickScore_v1 (CLIP ViT-H-14) (0.99 B params)", int(PICKSCORE_V1 * 4),
           "float32; published size", False)  # fmt: skip
    assert fit.rows[-1] == row and fit.figures.static == sum(v for _, v, _, _ in fit.rows)
    text = "\n".join(fit.lines())
    assert "  reward models: 3.7 GiB (PickScore_v1 (CLIP ViT-H-14) in float32; published sizes)" in text
    assert "verdict (estimate): does not fit reliably in 5 GiB per GPU" in text and not fit.fits


def test_the_t5_encoders_wo_is_counted_in_fp32_under_fp16():
    """transformers keeps T5's feed-forward output ``wo`` in float32 when the pipeline loads in fp16
    (``_keep_in_fp32_modules``): 24 layers × 4096 × 10240 weights, 1.9 GiB more than all-fp16; under bf16 not."""
    m = {"lora_params": 0, "transformer_bytes": 0, "vae_bytes": 0}
    sizes = {}
    for dtype in ("fp16", "bf16"):
        setup = setup_of(load_recipe(ROOT / "recipes" / "sd35" / "geneval_nft.toml"), "nft")
        setup.backbone = setup.backbone.model_copy(update={"dtype": dtype})
        sizes[dtype] = {n: v for n, v, *_ in component_rows(setup, m) if n.startswith("T5-XXL encoder")}
    (name, fp16), (_, bf16) = next(iter(sizes["fp16"].items())), next(iter(sizes["bf16"].items()))
    assert name == "T5-XXL encoder weights (4.76 B params)"
    wo = 24 * 4096 * 10240
    assert fp16 - bf16 == 2 * wo and 1.8 * GIB < fp16 - bf16 < 1.9 * GIB
