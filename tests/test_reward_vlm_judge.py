"""The ``vlm-judge`` reward on a tiny Qwen2.5-VL built here (random weights, two text layers, a one-block vision
tower) with a byte-level tokenizer built in code, saved once per module and loaded through the reward's own path.

The random judge says nothing about images: these tests check the plumbing (shapes, the answer position, batching,
parsing, the fallback, the error paths, the pair question and its use by ``pairwise``), not the quality of its
scores.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tpflow import registry
from tpflow.errors import UserError
from tpflow.rewards._vlm import budget_size, judge_pixels, parse_score

PROMPTS = ["a red cube", "two blue spheres on a table", "a green frog", "a cat"]

# A Qwen2-VL chat template cut to what the reward sends: one user turn of an image and a text, then the assistant.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_judge(folder: Path) -> torch.nn.Module:
    """Write a tiny Qwen2.5-VL judge (model, tokenizer, image processor, chat template) to ``folder``."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2Tokenizer,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from tpflow.backbones.tiny_tokenizers import _bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}  # one token per byte: digits are single
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")  # fmt: skip
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials), strict=True))
    text = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_theta": 1e6, "vocab_size": len(tokenizer), "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}}  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32,
                       "fullatt_block_indexes": [0], "window_size": 56},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vlm-judge")
    tiny_judge(folder)
    return folder


@pytest.fixture(scope="module")
def judge(judge_folder: Path):
    """The logits-mode reward over the tiny judge with the one-forward question ("score-only"), loaded once (the
    tests share its model)."""
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32",
                            batch_size=4, max_pixels=56 * 84, question="score-only")  # fmt: skip
    reward.load()
    return reward


def images(n: int, seed: int = 0, h: int = 64, w: int = 96) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g, device="cpu")


def scripted_generate(tokenizer, answers: list[str], seen: list[dict] | None = None):
    """A stand-in for the model's ``generate``: the prompt, then the next of ``answers`` on each row (right-padded);
    the keyword arguments of each call are appended to ``seen``."""
    queue = iter(answers)

    def generate(self, input_ids, **kwargs):
        if seen is not None:
            seen.append(kwargs)
        rows = [torch.tensor(tokenizer.encode(next(queue), add_special_tokens=False), dtype=torch.long)
                for _ in input_ids]  # fmt: skip
        width = max(len(r) for r in rows)
        pad = torch.full((width,), tokenizer.pad_token_id, dtype=torch.long)
        return torch.cat([input_ids, torch.stack([torch.cat([r, pad[len(r) :]]) for r in rows])], 1)

    return generate


def test_logits_mode_is_the_expected_digit_under_the_judges_own_logits(judge):
    """Score = (E[d] - 1) / 4 with E[d] = Σ d·softmax(logits of "1".."5") at the last position of the judge's input,
    computed here in float64 from the model's full logits, row by row, without the reward's batching."""
    x = images(3)
    out = judge(x, PROMPTS[:3], [{}] * 3)
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert ((out.scores >= 0) & (out.scores <= 1)).all()
    tokenizer = judge._processor.tokenizer
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, 6)]
    for i in range(3):
        batch = judge.inputs(x[i : i + 1], PROMPTS[i : i + 1])
        assert tokenizer.decode(batch["input_ids"][0]).endswith("<|im_start|>assistant\nFinal Score: ")
        with torch.no_grad():
            logits = judge._model(**batch).logits[0, -1].double()  # [V]
        p = logits[digits].softmax(-1)
        expected = float((p * torch.arange(1, 6, dtype=torch.float64)).sum())
        assert abs(float(out.details["vlm_judge_score"][i]) - expected) < 1e-5
        assert abs(float(out.scores[i]) - (expected - 1) / 4) < 1e-6
        mass = float(logits.softmax(-1)[digits].sum())
        assert abs(float(out.details["vlm_judge_token_mass"][i]) - mass) < 1e-6


def test_scores_do_not_depend_on_the_batch(judge):
    """Left padding in a batch of 4 (prompts of different lengths) gives each image the score it has alone."""
    x = images(4, seed=1)
    together = judge(x, PROMPTS, [{}] * 4).scores
    judge.options.batch_size = 1
    try:
        alone = judge(x, PROMPTS, [{}] * 4).scores
    finally:
        judge.options.batch_size = 4
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    assert judge(x[:0], [], []).scores.shape == (0,)


@pytest.mark.parametrize(
    ("text", "marker", "expected"),
    [
        ("Score: 4", "", 4.0),
        ("4/5", "", 4.0),
        ("I'd say 3.5", "", 3.5),
        ("none", "", None),
        ("", "", None),
        ("10", "", None),  # off the 1-5 scale
        ("0 stars", "", None),
        ("cat (object): 1\nFinal Score: 4", "Final Score:", 4.0),  # the number after the marker, not the first
        ("final score: 2.5 out of 5", "Final Score:", 2.5),
        ("no marker, 3", "Final Score:", None),  # an answer without its marker has no score
        ("cat (object): 1\nsphere (object): 0", "Final Score:", None),  # cut off before the score: not its elements
        ("Final Score: unclear", "Final Score:", None),
    ],
)
def test_the_parser_reads_the_first_number_on_the_scale(text, marker, expected):
    assert parse_score(text, 1, 5, marker) == expected


def test_answer_mode_parses_the_greedy_answer_and_falls_back_with_a_warning(judge_folder, judge, monkeypatch, caplog):
    """The answer mode generates, decodes what follows the input, parses it after the answer prefix ("Final Score: "
    here); an answer with no score scores the fallback, marked in its detail and counted in a warning, never an
    error."""
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32",
                            score_from="answer", max_new_tokens=3, fallback_score=2, max_pixels=56 * 84,
                            question="score-only")  # fmt: skip
    reward._model, reward._processor, reward._digit_ids = judge._model, judge._processor, judge._digit_ids
    x = images(4, seed=2)
    real = reward(x, PROMPTS, [{}] * 4)  # the random judge's own greedy answers: parsed or the fallback
    assert real.scores.shape == (4,) and set(real.details) == {"vlm_judge_score", "vlm_judge_unparsed"}
    fell = real.details["vlm_judge_unparsed"] == 1
    assert (real.details["vlm_judge_score"][fell] == 2).all()
    answers = ["4/5", "none", "I'd say 3.5", "Final Score: 9"]
    monkeypatch.setattr(type(judge._model), "generate", scripted_generate(judge._processor.tokenizer, answers))
    before = reward.unparsed
    with caplog.at_level(logging.WARNING, logger="tpflow.rewards.vlm_judge"):
        out = reward(x, PROMPTS, [{}] * 4)
    monkeypatch.undo()
    assert out.details["vlm_judge_score"].tolist() == [4.0, 2.0, 3.5, 2.0]
    assert out.details["vlm_judge_unparsed"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.scores.tolist() == [0.75, 0.25, 0.625, 0.25]
    assert reward.unparsed == before + 2
    assert "2 of 4 answers gave no score" in caplog.text


# UnifiedReward's pointwise question, copied from its public inference script (CodeGoat24/UnifiedReward, commit
# ed52f98, inference_qwen/image_generation/qwen_point_score_image_generation.py), with {prompt} left as the slot.
UNIFIED_REWARD_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after 'Final "
    "Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
QWEN_VL_UTILS_MAX_PIXELS = 16384 * 28 * 28  # qwen_vl_utils' MAX_PIXELS, which the script's process_vision_info uses


def test_by_default_the_judge_is_asked_unifiedrewards_own_question_within_its_own_budget(judge_folder):
    """The defaults are UnifiedReward's protocol: its question verbatim, nothing put in the judge's mouth (it writes
    its element list, then its score), up to 512 new tokens and 16384·28² pixels as its script allows. The shorter
    question stays an explicit option, with the answer started at "Final Score: "."""
    from tpflow.rewards.vlm_judge import VLMJudgeOptions

    default = VLMJudgeOptions()
    assert default.template == UNIFIED_REWARD_QUESTION and default.answer_prefix == ""
    assert default.max_pixels == QWEN_VL_UTILS_MAX_PIXELS and default.max_new_tokens == 512
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32")
    reward.load()
    assert reward.writes_first
    (text,) = reward.texts(["a red cube"])
    assert text.endswith(
        UNIFIED_REWARD_QUESTION.replace("{prompt}", "a red cube") + "<|im_end|>\n<|im_start|>assistant\n"
    )
    brief = VLMJudgeOptions(question="score-only")
    assert brief.answer_prefix == "Final Score: " and "Extract key elements" not in brief.template
    assert VLMJudgeOptions(question="score-only", answer_prefix="").answer_prefix == ""  # explicit values win


def test_the_processors_own_pixel_limit_caps_the_budget(judge_folder):
    """UnifiedReward's script resizes within 16384·28², then calls the processor with its resize on, which holds the
    image within the processor's own max_pixels (the tiny judge's: 112²): a 256² image is judged at 112², Qwen2-VL's
    smart_resize of 256² within [56², 112²]; with a smaller option, the option's budget."""
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32")
    reward.load()
    assert reward._pixels(images(1, h=256, w=256)).shape == (1, 3, 112, 112)
    reward.options.max_pixels = 56 * 84
    assert reward._pixels(images(1, h=256, w=256)).shape == (1, 3, 56, 56)


def hand_digit_score(judge, image: torch.Tensor, prompt: str, written: str) -> float:
    """E[d] by hand, float64: the default question in the chat, ``written`` after it as the judge's answer so far,
    the processor called directly on the 8-bit pixels at 56×84 (Qwen2-VL's smart_resize of 64×96), the digits'
    softmax at the last position."""
    processor = judge._processor
    content = [{"type": "image"}, {"type": "text", "text": UNIFIED_REWARD_QUESTION.replace("{prompt}", prompt)}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    batch = processor(text=[chat + written], images=list(judge_pixels(image[None], (56, 84))), do_resize=False,
                      return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        logits = judge._model(**batch).logits[0, -1].double()  # [V]
    digits = [processor.tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, 6)]
    return float((logits[digits].softmax(-1) * torch.arange(1, 6, dtype=torch.float64)).sum())


def test_default_logits_mode_reads_the_digit_where_the_judge_writes_its_score(
    judge_folder, judge, monkeypatch, caplog
):
    """With UnifiedReward's question the judge writes first, greedily, until "Final Score:" (a stop string, at most
    max_new_tokens); the score is the expected digit after what it wrote plus a space, as it writes "Final Score: 4".
    Scripted answers: one that runs past the marker (cut there), one ending at it, one without it and an empty one
    (the marker appended on its own line, marked and counted)."""
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32",
                            batch_size=4)  # fmt: skip
    reward._model, reward._processor, reward._digit_ids = judge._model, judge._processor, judge._digit_ids
    x = images(4, seed=9)
    reward.options.max_new_tokens = 6  # too few to spell the marker: the random judge's answers get it appended
    real = reward(x[:2], PROMPTS[:2], [{}] * 2)
    assert set(real.details) == {"vlm_judge_score", "vlm_judge_token_mass", "vlm_judge_no_marker"}
    assert real.details["vlm_judge_no_marker"].tolist() == [1.0, 1.0] and torch.isfinite(real.scores).all()

    reward.options.max_new_tokens = 512
    answers = ["cat (object): 1\nFinal Score: 4 because", "sphere (object): 0\nFinal Score:", "no marker here", ""]
    seen: list[dict] = []
    monkeypatch.setattr(type(judge._model), "generate", scripted_generate(judge._processor.tokenizer, answers, seen))
    with caplog.at_level(logging.WARNING, logger="tpflow.rewards.vlm_judge"):
        out = reward(x, PROMPTS, [{}] * 4)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0]["stop_strings"] == ["Final Score:"] and seen[0]["max_new_tokens"] == 512
    assert seen[0]["do_sample"] is False
    written = ["cat (object): 1\nFinal Score: ", "sphere (object): 0\nFinal Score: ", "no marker here\nFinal Score: ",
               "Final Score: "]  # fmt: skip
    for i in range(4):
        expected = hand_digit_score(judge, x[i], PROMPTS[i], written[i])
        assert abs(float(out.details["vlm_judge_score"][i]) - expected) < 1e-5
        assert abs(float(out.scores[i]) - (expected - 1) / 4) < 1e-6
    assert out.details["vlm_judge_no_marker"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert "2 of 4 answers wrote no 'Final Score:'" in caplog.text


def test_default_answer_mode_reads_the_number_after_the_marker_not_the_elements(judge_folder, judge, monkeypatch):
    """Answer mode with UnifiedReward's question: the score is the number after "Final Score:", as its users read
    it; an answer cut off inside its element list scores the fallback, not an element's 0 or 1."""
    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32",
                            score_from="answer")  # fmt: skip
    reward._model, reward._processor, reward._digit_ids = judge._model, judge._processor, judge._digit_ids
    answers = ["cat (object): 1\nFinal Score: 3", "cat (object): 1\ncube (object): 1"]
    monkeypatch.setattr(type(judge._model), "generate", scripted_generate(judge._processor.tokenizer, answers))
    out = reward(images(2, seed=10), PROMPTS[:2], [{}] * 2)
    assert out.details["vlm_judge_score"].tolist() == [3.0, 1.0]
    assert out.details["vlm_judge_unparsed"].tolist() == [0.0, 1.0]


def test_two_threads_loading_at_once_share_one_judge(judge_folder):
    """The first calls of two scoring threads load the judge once, under the reward's lock."""
    from concurrent.futures import ThreadPoolExecutor

    reward = registry.build("reward", "vlm-judge", model=str(judge_folder), device="cpu", dtype="float32")
    seen = []
    original = type(reward)._score_token_ids

    def counted(self, tokenizer):
        seen.append(1)
        return original(self, tokenizer)

    type(reward)._score_token_ids = counted
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: reward.load(), range(2)))
    finally:
        type(reward)._score_token_ids = original
    assert seen == [1] and reward._model is not None


def test_the_pixel_budget_and_the_resize():
    assert budget_size(512, 512, 28, 3136, 512 * 512) == (504, 504)
    h, w = budget_size(1024, 768, 28, 3136, 256 * 256)
    assert h % 28 == w % 28 == 0 and h * w <= 256 * 256 and h > w
    assert budget_size(10, 10, 28, 3136, 10**6) == (56, 56)  # up to the minimum
    x = images(2, seed=3)
    both = judge_pixels(x, (56, 84))
    assert both.shape == (2, 3, 56, 84) and both.dtype == torch.uint8
    assert torch.equal(both[1:], judge_pixels(x[1:], (56, 84)))


def test_options_are_checked():
    with pytest.raises(UserError, match="scale_min"):
        registry.build("reward", "vlm-judge", scale_min=5, scale_max=5)
    with pytest.raises(UserError, match="prompt"):
        registry.build("reward", "vlm-judge", template="Rate this image.")
    with pytest.raises(UserError, match="fallback_score"):
        registry.build("reward", "vlm-judge", fallback_score=7)
    with pytest.raises(UserError, match="pair_template"):
        registry.build("reward", "vlm-judge", pair_template="Which is better?")
    with pytest.raises(UserError, match="pair_answers"):
        registry.build("reward", "vlm-judge", pair_answers=["1", "1"])


def test_missing_judge_is_one_paragraph_before_any_weights_load(tmp_path, monkeypatch):
    from tests.cli_run import tpflow
    from tests.test_train import tiny_recipe

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    reward = registry.build("reward", "vlm-judge")
    with pytest.raises(UserError, match="CodeGoat24/UnifiedReward-qwen-7b"):
        reward.load()
    (source,) = registry.get("reward", "vlm-judge").factory.weight_sources(reward.options, {})
    assert source.problem and "never downloads" in source.problem and "download CodeGoat24" in source.problem
    folder = registry.build("reward", "vlm-judge", model=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="does not exist"):
        folder.load()
    recipe = tiny_recipe(tmp_path, None, reward="vlm-judge", backbone='name = "tiny-sd3"\nseed = 0')
    out = tpflow("validate", str(recipe))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "'CodeGoat24/UnifiedReward-qwen-7b' is not in the Hugging Face cache" in err
    assert "Traceback" not in err
    shipped = Path(__file__).parents[1] / "recipes" / "sd35" / "sd35_flowgrpo_unifiedreward.toml"
    preset = tpflow("validate", str(shipped))
    err = " ".join(preset.stderr.split())
    assert preset.returncode == 2 and "[reward] reward 'vlm-judge' model (option model)" in err
    assert "`hf download CodeGoat24/UnifiedReward-qwen-7b`" in err or "huggingface-cli download" in err
    described = tpflow("components", "reward", "vlm-judge", columns="80")
    assert described.returncode == 0
    for option in ("question", "score_from", "answer_prefix", "batch_size", "max_pixels", "fallback_score",
                   "scale_max", "pair_template", "pair_answer_prefix", "pair_answers"):  # fmt: skip
        assert option in described.stdout


def pair_probability(judge, a: torch.Tensor, b: torch.Tensor, prompt: str) -> float:
    """P(a better) by hand, float64: the chat of two images and the default pair question built here, the processor
    called directly on 8-bit pixels at the judge's size (56×84 for 64×96 images within 56·84 pixels), the model's
    full logits at the last position, the softmax over the tokens "1" and "2" only."""
    from tpflow.rewards._vlm import DEFAULT_PAIR_TEMPLATE

    processor = judge._processor
    question = DEFAULT_PAIR_TEMPLATE.replace("{prompt}", prompt)
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": question}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    pixels = judge_pixels(torch.stack([a, b]), (56, 84))  # [2, 3, 56, 84] uint8: a first
    batch = processor(text=[chat + "Image "], images=list(pixels), do_resize=False, return_tensors="pt")
    with torch.no_grad():
        logits = judge._model(**batch).logits[0, -1].double()  # [V]
    ids = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("1", "2")]
    return float(logits[ids].softmax(-1)[0])


def test_compare_is_the_first_answers_share_under_the_judges_own_logits(judge):
    """compare(a, b) = softmax(logit "1", logit "2")[0] after "Image ", both images in one chat, a shown first;
    [N] float64 in [0, 1]; the order shown matters (the pairwise reward averages both)."""
    a, b = images(3, seed=4), images(3, seed=5)
    p = judge.compare(a, b, PROMPTS[:3], [{}] * 3)
    assert p.shape == (3,) and p.dtype == torch.float64 and p.device.type == "cpu"
    assert ((p >= 0) & (p <= 1)).all()
    tokenizer = judge._processor.tokenizer
    batch = judge.pair_inputs(a[:1], b[:1], PROMPTS[:1])
    text = tokenizer.decode(batch["input_ids"][0])
    assert text.count("<|vision_start|>") == 2
    assert text.endswith("[a red cube]<|im_end|>\n<|im_start|>assistant\nImage ")
    for i in range(3):
        assert abs(float(p[i]) - pair_probability(judge, a[i], b[i], PROMPTS[i])) < 1e-6
    swapped = judge.compare(b, a, PROMPTS[:3], [{}] * 3)
    assert abs(float(swapped[0]) - pair_probability(judge, b[0], a[0], PROMPTS[0])) < 1e-6
    assert not torch.allclose(p, swapped, rtol=0, atol=1e-7)  # the hand computation above tells a from b
    assert judge.compare(a[:0], b[:0], [], []).shape == (0,)


def test_compare_does_not_depend_on_the_batch(judge):
    """Left padding (prompts of different lengths) in forwards of 2 pairs (batch_size 4) or 1 gives each pair the
    probability it has alone."""
    a, b = images(4, seed=6), images(4, seed=7)
    together = judge.compare(a, b, PROMPTS, [{}] * 4)
    judge.options.batch_size = 1
    try:
        alone = judge.compare(a, b, PROMPTS, [{}] * 4)
    finally:
        judge.options.batch_size = 4
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_pairwise_asks_the_vlm_judge_about_both_orders_of_every_pair(judge_folder, judge, monkeypatch):
    """``judge = { name = "vlm-judge" }`` in ``pairwise``: a PairwiseJudge, asked about the 4 pairs of a group of 3
    and a group of 2 in both orders, ``judge_batch`` 3 pairs per call; each win rate is the mean over its siblings
    of ½ (p(i, j) + 1 − p(j, i)) with p from compare pair by pair, in [0, 1], summing to G/2 in a group of G."""
    from tpflow.rewards.pairwise import PairwiseJudge

    options = {"model": str(judge_folder), "device": "cpu", "dtype": "float32", "max_pixels": 56 * 84}
    reward = registry.build("reward", "pairwise", judge={"name": "vlm-judge", "options": options}, judge_batch=3)
    assert isinstance(reward.judge, PairwiseJudge) and type(reward.judge) is type(judge)
    reward.judge = judge  # the module's loaded judge, the same options but for batch_size
    calls: list[int] = []
    original = judge.compare

    def counted(images_a, images_b, prompts, metadata):
        calls.append(len(prompts))
        return original(images_a, images_b, prompts, metadata)

    monkeypatch.setattr(judge, "compare", counted)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0]]  # groups: rows 0, 2, 4 and rows 1, 3
    x = images(5, seed=8)
    out = reward(x, prompts, [{}] * 5)
    assert calls == [3, 1, 3, 1]  # 4 unordered pairs, 3 per call, once in each order
    assert out.details["pairs"].tolist() == [2, 1, 2, 1, 2]
    rates = out.scores.double()
    assert ((rates >= 0) & (rates <= 1)).all()
    for group in ([0, 2, 4], [1, 3]):
        for i in group:
            siblings = [j for j in group if j != i]
            expected = sum(
                (float(original(x[i : i + 1], x[j : j + 1], prompts[i : i + 1], [{}]))
                 + 1 - float(original(x[j : j + 1], x[i : i + 1], prompts[i : i + 1], [{}]))) / 2
                for j in siblings
            ) / len(siblings)  # fmt: skip
            assert abs(float(rates[i]) - expected) < 1e-5
        assert abs(float(rates[group].sum()) - len(group) / 2) < 1e-5
