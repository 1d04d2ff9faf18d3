"""The editing shapes world: its instructions, splits and scene references, the pairs pretraining learns from, the
``shapes-edit`` reward (the target scores 1, the unedited source 0, a wrong edit between), the editing model's start
from the image model, its backbone (the source in the conditioning's rows and in both CFG branches) and its
pretraining's atomic, resumable save."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tpflow import sources
from tpflow.errors import UserError
from tpflow.registry import build
from tpflow.shapes import edit_world, vocab
from tpflow.shapes.edit_model import ShapesEditConfig, ShapesEditDiT, load_edit_checkpoint
from tpflow.shapes.render import SceneObject, draw_scene

TINY = dict(width=32, depth=1, heads=2, text_width=32, text_layers=1)


@pytest.fixture(scope="module")
def dataset():
    return build("dataset", "shapes-edit")


@pytest.fixture(scope="module")
def targets(dataset):
    """Each test item's target scene, drawn: [78, 3, 32, 32]."""
    rng = np.random.default_rng(0)
    return torch.stack([draw_scene(edit_world.target_scene(it, rng)) for it in dataset.split("test")])


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory) -> Path:
    """Two pretraining steps of a tiny editing model from scratch (the real file format), then one more continued
    from that file."""
    from tpflow.shapes.edit_pretrain import edit_pretrain

    out = tmp_path_factory.mktemp("edit")
    kwargs = dict(minutes=1, out=out, batch_size=2, progress=False, threads=1, config=ShapesEditConfig(**TINY))
    edit_pretrain(max_steps=2, init="none", save_every=1, **kwargs)
    return edit_pretrain(max_steps=1, init=out / "shapes_edit_dit.safetensors", **kwargs)


def test_the_world_has_39_instructions_and_the_train_split_never_asks_for_a_held_out_one(dataset):
    prompts = {edit_world.instruction(e["kind"], e["shape"], e["color"], e["direction"]) for e in edit_world.EDITS}
    assert len(prompts) == 39 and len(edit_world.HELD_OUT) == 6
    train, test = dataset.split("train"), dataset.split("test")
    assert len(train) == edit_world.TRAIN_SIZE and not any(it.metadata["held_out"] for it in train)
    assert len(test) == 78 and sum(it.metadata["held_out"] for it in test) == 12
    assert {it.prompt for it in test} == prompts and {it.metadata["tag"] for it in test} == set(edit_world.KINDS)
    tokens, _ = edit_world.tokenize(sorted(prompts))
    assert not bool((tokens == vocab.UNK).any())  # every word is in the editing vocabulary
    assert edit_world.WORDS[: len(vocab.WORDS)] == vocab.WORDS  # the image model's word ids kept
    # held-out: the 6 held-out instructions alone, each on 20 scenes of its own draw, none a test item's scene
    held = dataset.split("held-out")
    assert len(held) == 120 and all(it.metadata["held_out"] for it in held)
    assert {it.prompt for it in held} == {it.prompt for it in test if it.metadata["held_out"]}
    assert len({(it.prompt, it.metadata["sources"][0]) for it in held}) == 120
    assert not {it.metadata["sources"][0] for it in held} & {it.metadata["sources"][0] for it in test}
    assert dataset.split("test") == test  # the test split is as before the held-out split was added


def test_reserved_instructions_are_pretrained_ones_the_train_split_leaves_out(dataset):
    """At reserved_per_kind 2: 8 instructions, 2 of each kind, none held out; the train split never asks them, the
    reserved split asks them alone on 20 scenes each; at 0 the train split is the default's and asking for the
    empty reserved split says which option fills it."""
    two, one = edit_world.reserved(2), edit_world.reserved(1)
    assert len(two) == 8 and one < two and not two & edit_world.HELD_OUT
    assert sorted(k[0] for k in two) == sorted(2 * list(edit_world.KINDS))
    kept = build("dataset", "shapes-edit", reserved_per_kind=2)
    asked = {
        (e["kind"], e["shape"], e["color"] or e["direction"])
        for e in (it.metadata["edit"] for it in kept.split("train"))
    }
    assert len(asked) == 25 and not asked & two and not asked & edit_world.HELD_OUT  # 39 - 6 held out - 8 reserved
    items = kept.split("reserved")
    assert len(items) == 160 and not any(it.metadata["held_out"] for it in items)
    assert {
        (
            it.metadata["edit"]["kind"],
            it.metadata["edit"]["shape"],
            it.metadata["edit"]["color"] or it.metadata["edit"]["direction"],
        )
        for it in items
    } == two
    assert not {it.metadata["sources"][0] for it in items} & {it.metadata["sources"][0] for it in kept.split("test")}
    assert kept.split("test") == dataset.split("test") and kept.split("held-out") == dataset.split("held-out")
    assert kept.splits == ("train", "test", "held-out", "reserved")
    assert dataset.splits == ("train", "test", "held-out")  # every split a dataset names holds prompts (preflight)
    with pytest.raises(UserError, match="only with dataset.reserved_per_kind set"):
        dataset.split("reserved")


def test_eval_takes_any_split_of_the_recipes_dataset_by_name(tmp_path):
    """``tpflow eval RUN --prompts held-out`` on an editing recipe; an unknown name lists the dataset's splits."""
    from tpflow.evaluation.prompt_sets import check_prompt_set, prompt_set
    from tpflow.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "shapes_edit_flowgrpo.toml")
    items, split = prompt_set("held-out", recipe)
    assert split == "held-out" and len(items) == 120 and items[0].metadata["sources"]
    with pytest.raises(UserError, match=r"train, test, held-out, reserved\), nor an existing file"):
        prompt_set(str(tmp_path / "nothing"), recipe)
    check_prompt_set("held-out", recipe)  # what tpflow eval checks before any weights load
    with pytest.raises(UserError, match=r"train, test, held-out, reserved\), nor an existing prompt file"):
        check_prompt_set("heldout", recipe)


def test_a_scene_travels_as_a_reference_and_renders_without_files():
    scene = [SceneObject("circle", "red", (2.0, 3.25, 12.0, 13.25)), SceneObject("square", "blue", (18, 18, 28, 28))]
    ref = edit_world.scene_ref(scene)
    assert ref == "shapes-scene:red-circle@2,3.25,12,13.25;blue-square@18,18,28,28"
    assert edit_world.parse_spec(ref.partition(":")[2]) == scene
    torch.testing.assert_close(sources.load(ref), draw_scene(scene), rtol=0, atol=0)
    with pytest.raises(UserError, match="colour-shape@x0,y0,x1,y1"):
        sources.load("shapes-scene:purple-circle@1,1,9,9")


def test_a_target_is_its_source_with_exactly_the_one_change(dataset):
    rng = np.random.default_rng(1)
    for item in dataset.split("test"):
        edit = item.metadata["edit"]
        source = edit_world.parse_spec(item.metadata["sources"][0].partition(":")[2])
        target = edit_world.target_scene(item, rng)
        assert 1 <= len(source) <= 3 and len({o.cls for o in target}) == len(target)  # distinct shapes
        unchanged = [o for o in source if o.cls != edit["shape"]]
        assert [o for o in target if o.cls != edit["shape"]] == unchanged
        changed = [o for o in target if o.cls == edit["shape"]]
        before = [o for o in source if o.cls == edit["shape"]]
        if edit["kind"] == "remove":
            assert not changed and len(before) == 1
        elif edit["kind"] == "add":
            assert not before and [o.color for o in changed] == [edit["color"]]
        elif edit["kind"] == "recolor":
            assert changed == [before[0]._replace(color=edit["color"])] and before[0].color != edit["color"]
        else:
            dx, dy = edit_world.DIRECTIONS[edit["direction"]]
            shift = np.subtract(changed[0].box, before[0].box)
            assert shift.tolist() == [dx * edit_world.MOVE, dy * edit_world.MOVE] * 2


def test_the_reward_scores_the_target_1_the_unedited_source_0_and_a_wrong_edit_between(dataset, targets):
    reward = build("reward", "shapes-edit")
    items = dataset.split("test")
    meta, prompts = [it.metadata for it in items], [it.prompt for it in items]
    right = reward(targets, prompts, meta)
    assert float(right.scores.min()) == 1.0 and float(right.details["strict"].min()) == 1.0
    unedited = reward(torch.stack([sources.load(m["sources"][0]) for m in meta]), prompts, meta)
    assert float(unedited.scores.max()) == 0.0 and float(unedited.details["preserve"].min()) == 1.0
    # the wrong colour asked of add and recolor: half the add instruction (its shape), none of recolor's
    wrong = [dict(m, edit=dict(m["edit"], color="red" if m["edit"]["color"] != "red" else "blue")) for m in meta]
    out = reward(targets, prompts, wrong)
    kinds = [m["edit"]["kind"] for m in meta]
    assert {float(s) for s, k in zip(out.scores, kinds, strict=True) if k == "add"} == {0.5}
    assert {float(s) for s, k in zip(out.scores, kinds, strict=True) if k == "recolor"} == {0.0}
    # the edit made, and the rest of a scene wiped: the instruction holds, the scene is not kept
    blank = torch.ones(1, 3, 32, 32)
    crowded = next(m for m in meta if m["edit"]["kind"] == "remove" and m["sources"][0].count(";") == 2)
    out = reward(blank, ["remove"], [crowded])
    assert out.details["instruction"].item() == 1.0 and out.details["preserve"].item() == 0.0
    assert out.scores.item() == 0.5
    with pytest.raises(UserError, match="shapes-edit dataset"):
        reward(blank, ["a red circle"], [{"tag": "colors"}])


def test_the_editing_model_without_a_source_is_the_image_model_it_starts_from():
    """Every shared layer copied (the shipped shapes-dit): with no source, the same velocity bit for bit; with one,
    the source's tokens reach the output."""
    from tpflow.backbones.shapes import WEIGHTS_DIR
    from tpflow.shapes.edit_init import start_model
    from tpflow.shapes.model import load_checkpoint

    image = load_checkpoint(WEIGHTS_DIR / "shapes_dit.safetensors")
    model = ShapesEditDiT().eval()
    assert start_model(model, "image") == "inflated shapes_dit.safetensors"
    assert not model.source_pos.any() and not model.source_embed.any()
    x, sigma = torch.randn(2, 3, 32, 32), torch.tensor([0.3, 0.8])
    tokens, mask = vocab.tokenize(["a photo of a red circle", "a photo of two squares"], edit_world.MAX_TOKENS)
    null = torch.tensor([False, True])
    with torch.no_grad():
        assert torch.equal(model(x, sigma, tokens, mask, null), image(x, sigma, tokens, mask, null))
        with_source = model(x, sigma, tokens, mask, null, torch.rand(2, 3, 32, 32) * 2 - 1)
    assert not torch.allclose(with_source, image(x, sigma, tokens, mask, null))
    shipped = load_edit_checkpoint(WEIGHTS_DIR / "shapes_edit_dit.safetensors")  # what the backbone loads by default
    assert shipped.config == ShapesEditConfig() and shipped.source_pos.abs().sum() > 0  # the source terms trained


def test_the_backbone_keeps_the_source_in_its_rows_and_in_both_cfg_branches(tiny_edit):
    from tpflow.guidance import combine

    backbone = build("backbone", "shapes-edit-dit", weights=str(tiny_edit))
    assert backbone.source_images == (1, 1) and sources.takes_sources(backbone)
    images = [[torch.rand(3, 32, 32)], [torch.rand(3, 64, 64)]]  # the second resized to 32×32
    cond = backbone.encode(["add a red circle", "remove the square"], sources=images)
    source = cond.tensors["source"]
    assert source.shape == (2, 3, 32, 32) and float(source.min()) >= -1 and float(source.max()) <= 1
    torch.testing.assert_close(source[0], images[0][0] * 2 - 1)
    assert torch.equal(cond.index([1, 1]).tensors["source"][1], source[1])  # rows index with the words
    z, sigma = torch.randn(2, 3, 32, 32), torch.tensor(0.6)
    with torch.no_grad():
        v = backbone.velocity(z, sigma, cond, 3.0)
        s, t, m = sigma.expand(2), cond.tensors["tokens"], cond.tensors["mask"]
        uncond = backbone.model(z, s, t, m, torch.ones(2, dtype=torch.bool), source)
        expected = combine(uncond, backbone.model(z, s, t, m, None, source), 3.0)
    torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="one source image per instruction"):
        backbone.encode(["add a red circle"])


def test_pretraining_saves_atomically_and_continues_from_its_file(tiny_edit):
    import json

    stats = json.loads(tiny_edit.with_suffix(".json").read_text())["stats"]
    assert stats["init"] == "continued shapes_edit_dit.safetensors" and stats["iterations"] == 1
    assert not list(tiny_edit.parent.glob("*.tmp"))
