"""The ``geneval`` prompt dataset: GenEval's templates and metadata format, disjoint seeded splits, GenEval files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import tpflow
from tpflow.data import geneval
from tpflow.errors import UserError
from tpflow.interfaces import PromptDataset
from tpflow.rewards.geneval import score
from tpflow.rewards.geneval.colors import COLORS
from tpflow.rewards.geneval.detectors import COCO_CLASSES


class Det:
    def __init__(self, cls, color, box):
        self.cls, self.color, self.box, self.score = cls, color, box, 0.99


_BESIDE = {"left of": (5, 40), "right of": (75, 40), "above": (40, 5), "below": (40, 75)}  # (x, y) of a 20 px box


def _perfect(meta: dict) -> list[Det]:
    """Detections that satisfy the metadata exactly, in a 100×100 image: the reference of a position clause in the
    centre and the other object beside it, other clauses on separate rows."""
    out = []
    for i, clause in enumerate(meta["include"]):
        for j in range(clause["count"]):
            x, y = 5 + 22 * j, 5 + 45 * i
            if meta["tag"] == "position":
                x, y = _BESIDE[clause["position"][0]] if "position" in clause else (40, 40)
            out.append(Det(clause["class"], clause.get("color"), (x, y, x + 20, y + 20)))
    return out


@pytest.fixture(scope="module")
def dataset():
    return tpflow.build("dataset", "geneval", train_size=3000, test_size=600, seed=0)


def test_splits_are_disjoint_balanced_and_cover_every_tag(dataset):
    assert isinstance(dataset, PromptDataset) and dataset.splits == ("train", "test")
    train, test = dataset.split("train"), dataset.split("test")
    assert not {it.prompt for it in train} & {it.prompt for it in test}
    assert len(train) == 3000 and Counter(it.metadata["tag"] for it in train) == dict.fromkeys(geneval.TAGS, 500)
    # 100 per tag, but single_object gives at most half of its 80 prompts; test prompts never repeat
    assert Counter(it.metadata["tag"] for it in test) == {**dict.fromkeys(geneval.TAGS, 100), "single_object": 40}
    assert len({it.prompt for it in test}) == len(test)
    # train prompts repeat only once a tag's remaining prompts are used up: single_object has 80 − 40 left,
    # counting 80 classes × 3 counts − 100
    per_tag = Counter(it.metadata["tag"] for it in {it.prompt: it for it in train}.values())
    assert per_tag == {**dict.fromkeys(geneval.TAGS, 500), "single_object": 40, "counting": 140}
    with pytest.raises(UserError):
        dataset.split("validation")


def test_generation_is_deterministic(dataset):
    again = tpflow.build("dataset", "geneval", train_size=3000, test_size=600, seed=0)
    assert again.split("train") == dataset.split("train") and again.split("test") == dataset.split("test")
    other = tpflow.build("dataset", "geneval", train_size=3000, test_size=600, seed=1)
    assert other.split("test") != dataset.split("test") and other.split("train") != dataset.split("train")
    # the evaluation prompts do not move when only the train size changes
    assert tpflow.build("dataset", "geneval", train_size=50, seed=0).split("test") == dataset.split("test")


def test_metadata_is_genevals_format(dataset):
    for item in dataset.split("test") + dataset.split("train")[:600]:
        meta = item.metadata
        assert meta["prompt"] == item.prompt and json.loads(json.dumps(meta)) == meta
        assert list(meta) == (["tag", "include", "exclude", "prompt"] if meta["tag"] == "counting" else
                              ["tag", "include", "prompt"])  # fmt: skip
        classes = [c["class"] for c in meta["include"]]
        assert set(classes) <= set(COCO_CLASSES) and len(set(classes)) == len(classes)
        colors = [c["color"] for c in meta["include"] if "color" in c]
        assert set(colors) <= set(COLORS) and len(set(colors)) == len(colors)
        assert not ("person" in classes and colors)  # GenEval asks no colour of a person
        if meta["tag"] == "counting":
            (clause,) = meta["include"]
            assert clause["count"] in (2, 3, 4) and meta["exclude"] == [
                {"class": clause["class"], "count": clause["count"] + 1}
            ]
        else:
            assert all(c["count"] == 1 for c in meta["include"])
        if meta["tag"] == "position":
            relation, target = meta["include"][1]["position"]
            assert target == 0 and f" {relation} " in item.prompt and relation in geneval.RELATIONS
        assert {"colors": 1, "color_attr": 2}.get(meta["tag"], 0) == len(colors)


def test_templates_word_for_word():
    assert geneval.single_object("apple").prompt == "a photo of an apple"
    assert geneval.two_object("umbrella", "bus").prompt == "a photo of an umbrella and a bus"
    assert geneval.counting("wine glass", 2).prompt == "a photo of two wine glasses"
    assert geneval.counting("skis", 4).prompt == "a photo of four skises"  # GenEval's plural rule, kept as is
    assert geneval.colors("car", "orange").prompt == "a photo of an orange car"
    assert geneval.position("cat", "right of", "elephant").metadata == {
        "tag": "position",
        "include": [{"class": "elephant", "count": 1}, {"class": "cat", "count": 1, "position": ["right of", 0]}],
        "prompt": "a photo of a cat right of an elephant",
    }
    assert geneval.color_attr("oven", "white", "bed", "orange").prompt == "a photo of a white oven and an orange bed"


def test_perfect_detections_are_strictly_correct(dataset):
    for item in dataset.split("test") + dataset.split("train")[:300]:
        result = score(_perfect(item.metadata), item.metadata, (100, 100))
        assert result.strict_correct and result.correct and result.score == 1.0, (item.prompt, result.reason)


def test_genevals_files_replace_generated_splits(tmp_path, dataset):
    # GenEval's evaluation file holds every single object; write one like it
    official = [geneval.single_object(c) for c in COCO_CLASSES] + dataset.split("test")[:50]
    (tmp_path / "evaluation_metadata.jsonl").write_text("\n".join(json.dumps(it.metadata) for it in official) + "\n")
    built = tpflow.build("dataset", "geneval", test_path=str(tmp_path / "evaluation_metadata.jsonl"), train_size=500)
    assert built.split("test") == official  # the metadata keeps its prompt, as in GenEval's files
    train = built.split("train")
    assert not {it.prompt for it in train} & {it.prompt for it in official}
    counts = Counter(it.metadata["tag"] for it in train)
    assert "single_object" not in counts and sorted(counts.values()) == [100] * 5  # balanced over the other tags

    (tmp_path / "train.jsonl").write_text(json.dumps(official[0].metadata) + "\n")
    built = tpflow.build("dataset", "geneval", path=str(tmp_path / "train.jsonl"))
    assert built.split("train") == official[:1] and official[0].prompt not in {it.prompt for it in built.split("test")}

    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a photo of a cat"}) + "\n")
    with pytest.raises(UserError, match="not GenEval metadata"):
        tpflow.build("dataset", "geneval", path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(UserError, match="not found"):
        tpflow.build("dataset", "geneval", test_path=str(tmp_path / "missing.jsonl"))
