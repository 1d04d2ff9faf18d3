"""Reward ``hpsv3`` on a tiny Qwen2-VL built here (random weights, two text layers, a one-block vision tower) with a
byte-level tokenizer, its checkpoint written in the published layout (transformers 4.45's names, the head's
``rm_head.*``) and loaded through the reward's own path, offline.

The expected scores come from the tiny model object itself (the weights before they were renamed and saved), one
image at a time, with the head applied by hand: a check of the renaming, the reward token's position, the
sequential positions the package's forward uses, the head, and batching with right padding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tpflow import registry
from tpflow.errors import UserError
from tpflow.rewards import hpsv3

from .test_reward_vlm_judge import CHAT_TEMPLATE

PROMPTS = ["a red cube", "two blue spheres on a table", "a green frog", "a cat"]
SIDE = 56  # the tiny processor's budget: 56x56 pixels, 2x2 merged image tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(base folder, checkpoint, the tiny Qwen2VLForConditionalGeneration, the original-layout state dict)."""
    from safetensors.torch import save_file
    from transformers import (
        Qwen2Tokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    from tpflow.backbones.tiny_tokenizers import _bytes_to_unicode

    root = tmp_path_factory.mktemp("hpsv3")
    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")  # fmt: skip
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials), strict=True))
    text = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "rope_theta": 1e6, "vocab_size": len(tokenizer) + 1,  # + <|Reward|>
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}}  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(root / "base")
    config.save_pretrained(root / "base")  # the base's config.json; its weights are never read
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(config).eval()
        head = hpsv3.make_head(32)
        with torch.no_grad():  # weights far from the init's 0.02, so that attention (and position) matters
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    state = {}
    for key, value in model.state_dict().items():  # transformers 4.45's names, as HPSv3.safetensors has them
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        elif key.startswith("model.visual."):
            key = key[len("model.") :]
        state[key] = value.clone().contiguous()
    state.update({f"rm_head.{k}": v.clone().contiguous() for k, v in head.state_dict().items()})
    save_file(state, str(root / "HPSv3.safetensors"))
    return root / "base", root / "HPSv3.safetensors", model, state


def build(tiny, **options):
    base, checkpoint, _, _ = tiny
    defaults = dict(checkpoint=str(checkpoint), base=str(base), dtype="float32", min_pixels=SIDE * SIDE)
    return registry.build("reward", "hpsv3", **{**defaults, "max_pixels": SIDE * SIDE, **options})


@pytest.fixture(scope="module")
def reward(tiny):
    reward = build(tiny, device="cpu", batch_size=3)
    reward.load()
    return reward


def images(n: int, seed: int = 0, h: int = 64, w: int = 80) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g, device="cpu")


def hand_score(tiny, reward, image: torch.Tensor, prompt: str, sequential: bool = True) -> torch.Tensor:
    """(μ, σ) of one image from the tiny model object and the head's weights, applied by hand."""
    _, _, model, state = tiny
    batch = reward.inputs(image[None], [prompt])
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1])[None] if sequential else None
    with torch.no_grad():
        hidden = model.model(**batch, position_ids=positions).last_hidden_state[0]  # [L, D]
    at = (ids[0] == reward.load().reward_id).nonzero()[0, 0]
    x = F.relu(F.linear(hidden[at], state["rm_head.0.weight"], state["rm_head.0.bias"]))
    x = F.relu(F.linear(x, state["rm_head.3.weight"], state["rm_head.3.bias"]))
    return F.linear(x, state["rm_head.5.weight"], state["rm_head.5.bias"])


def test_hpsv3_is_the_heads_mean_at_the_reward_token(tiny, reward):
    """The checkpoint in the published layout, loaded through the reward, scores as the tiny model itself with the
    head by hand, image by image; the batch (right-padded prompts of different lengths, chunks of 3) changes
    nothing; the positions are the package's 0..L-1, not Qwen2-VL's 3D ones."""
    x = images(4, seed=1)
    out = reward(x, PROMPTS, [{}] * 4)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    expected = torch.stack([hand_score(tiny, reward, x[i], PROMPTS[i]) for i in range(4)])  # [4, 2]
    torch.testing.assert_close(out.scores, expected[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.details["hpsv3_sigma"], expected[:, 1], rtol=1e-4, atol=1e-5)
    mrope = hand_score(tiny, reward, x[0], PROMPTS[0], sequential=False)
    assert abs(float(mrope[0] - expected[0, 0])) > 1e-4  # the positions matter, and these are the package's


def test_hpsv3_input_is_the_packages_question_and_pixel_budget(reward):
    (text,) = reward.texts(["a red cube"])
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nYou are tasked with")
    assert (
        "Textual prompt - a red cube\n\n\n\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
        in text
    )
    batch = reward.inputs(images(1, h=64, w=64), ["a red cube"])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56x56: 4x4 patches of 14
    batch = reward.inputs(images(1, h=64, w=80), ["a red cube"])
    assert batch["image_grid_thw"].tolist() == [[1, 2, 4]]  # 28x56: the aspect kept within the budget
    # The package's budget, 256·28·28 pixels: a square image becomes 448x448 (1024 patches, 256 merged tokens).
    assert hpsv3.budget_size(720, 720, 28, hpsv3.PIXELS, hpsv3.PIXELS) == (448, 448)


def test_hpsv3_refuses_other_checkpoints_and_says_what_is_missing(tiny, tmp_path: Path, monkeypatch):
    from safetensors.torch import save_file

    from tests.cli_run import tpflow
    from tests.test_train import tiny_recipe

    _, _, _, state = tiny
    save_file({k: v for k, v in state.items() if not k.startswith("rm_head.")}, str(tmp_path / "nohead.safetensors"))
    with pytest.raises(UserError, match="not an HPSv3 checkpoint"):
        build(tiny, device="cpu", checkpoint=str(tmp_path / "nohead.safetensors")).load()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError, match="MizzenAI/HPSv3"):
        registry.build("reward", "hpsv3").load()
    with pytest.raises(UserError, match="Qwen/Qwen2-VL-7B-Instruct"):
        build(tiny, base="Qwen/Qwen2-VL-7B-Instruct").load()
    recipe = tiny_recipe(tmp_path, None, reward="hpsv3", backbone='name = "tiny-sd3"\nseed = 0')
    out = tpflow("validate", str(recipe))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "HPSv3.safetensors of MizzenAI/HPSv3 is not in the Hugging Face cache" in err
    assert "Traceback" not in err
    described = tpflow("components", "reward", "hpsv3", columns="80")
    assert described.returncode == 0 and "checkpoint" in described.stdout and "base" in described.stdout
    assert max(len(line) for line in described.stdout.splitlines()) <= 80
