"""Reward ``imagereward`` on a tiny BLIP of ImageReward's architecture built here, offline.

The tiny checkpoint is written in the published ImageReward.pt layout (``original_state_dict``), so loading it
exercises the key renaming onto transformers' modules; the expected scores come from a forward written here by hand
from BLIP's vit.py and med.py on that original state dict, not from transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tpflow import registry
from tpflow.errors import UserError
from tpflow.rewards import imagereward as ir

from .test_reward_clip import ATOL, assert_batch_independent, uint8_images

WORDS = ["a", "red", "cube", "two", "blue", "spheres", "on", "table", "cat", "green", "frog", "the", "of"]
PROMPTS = ["a red cube", "Two BLUE spheres on a table", "a cat " * 30, "a green frog"]  # [2] is > 35 tokens
MED = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, patch_size=8)
SIZE = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint, tokenizer folder, med_config file, the original-layout state dict) of a tiny random ImageReward."""
    root = tmp_path_factory.mktemp("imagereward")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    med = {**ir.MED_CONFIG, **MED, "vocab_size": len(vocab) + 2, "max_position_embeddings": 40}  # + [DEC], [ENC]
    med.update(encoder_width=768, add_cross_attention=True, type_vocab_size=2)  # as in med_config.json, unused
    (root / "med_config.json").write_text(json.dumps(med))
    vision, text, head = ir.make_modules(med, {**ir.VIT_LARGE, **VISION}, SIZE)
    g = torch.Generator().manual_seed(0)
    state = {}
    for key, value in ir.original_state_dict(vision, text, head).items():  # random, away from the inits
        noise = torch.randn(value.shape, generator=g)
        norm = "norm" in key.lower() and key.endswith("weight")
        scale = 1 / math.sqrt(value.shape[-1]) if key.startswith(ir.HEAD) else 0.2  # the head: scores of order 1
        state[key] = 1 + 0.1 * noise if norm else noise * scale
    state["blip.vision_proj.weight"] = torch.zeros(4, 48)  # in the published file, unused by the score
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]
    torch.save(state, root / "ImageReward.pt")
    return root / "ImageReward.pt", root / "tokenizer", root / "med_config.json", state


def build(tiny, **options):
    path, tokenizer, med, _ = tiny
    defaults = dict(checkpoint=str(path), tokenizer=str(tokenizer), med_config=str(med), image_size=SIZE)
    return registry.build("reward", "imagereward", **{**defaults, "vision": VISION, **options})


@pytest.fixture(scope="module")
def reward(tiny):
    return build(tiny, device="cpu")


def hand_scores(state: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ImageReward's score from the original state dict: BLIP's ViT, BERT with cross-attention, the linear MLP."""

    def v(k):
        return state["blip.visual_encoder." + k]

    def t(k):
        return state["blip.text_encoder." + k]

    def heads(x, n):  # [B, L, D] -> [B, n, L, D/n]
        return x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)

    def attend(q, k, val, bias, n):
        q, k, val = heads(q, n), heads(k, n), heads(val, n)
        probs = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias).softmax(-1)
        return (probs @ val).transpose(1, 2).flatten(2)

    d = VISION["hidden_size"]
    x = F.conv2d(pixels, v("patch_embed.proj.weight"), v("patch_embed.proj.bias"), stride=VISION["patch_size"])
    x = torch.cat([v("cls_token").expand(len(x), 1, d), x.flatten(2).transpose(1, 2)], 1) + v("pos_embed")
    for i in range(VISION["num_hidden_layers"]):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (d,), v(b + "norm1.weight"), v(b + "norm1.bias"), 1e-6)
        q, k, val = F.linear(h, v(b + "attn.qkv.weight"), v(b + "attn.qkv.bias")).chunk(3, -1)
        x = x + F.linear(
            attend(q, k, val, 0.0, VISION["num_attention_heads"]), v(b + "attn.proj.weight"), v(b + "attn.proj.bias")
        )
        h = F.layer_norm(x, (d,), v(b + "norm2.weight"), v(b + "norm2.bias"), 1e-6)
        h = F.linear(F.gelu(F.linear(h, v(b + "mlp.fc1.weight"), v(b + "mlp.fc1.bias"))), v(b + "mlp.fc2.weight"))
        x = x + h + v(b + "mlp.fc2.bias")
    image = F.layer_norm(x, (d,), v("norm.weight"), v("norm.bias"), 1e-6)

    w, n = MED["hidden_size"], MED["num_attention_heads"]

    def ln(x, p):
        return F.layer_norm(x, (w,), t(p + ".weight"), t(p + ".bias"), 1e-12)

    def lin(x, p):
        return F.linear(x, t(p + ".weight"), t(p + ".bias"))

    def block(p, h, kv, bias):
        ctx = attend(lin(h, p + ".self.query"), lin(kv, p + ".self.key"), lin(kv, p + ".self.value"), bias, n)
        return ln(lin(ctx, p + ".output.dense") + h, p + ".output.LayerNorm")

    h = t("embeddings.word_embeddings.weight")[ids] + t("embeddings.position_embeddings.weight")[: ids.shape[1]]
    h = ln(h, "embeddings.LayerNorm")
    pad = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for i in range(MED["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        h = block(p + "crossattention", block(p + "attention", h, h, pad), image, 0.0)
        h = ln(lin(F.gelu(lin(h, p + "intermediate.dense")), p + "output.dense") + h, p + "output.LayerNorm")
    out = h[:, 0]
    for layer in (0, 2, 4, 6, 7):  # linear layers only: the package's ReLUs are commented out
        out = F.linear(out, state[f"mlp.layers.{layer}.weight"], state[f"mlp.layers.{layer}.bias"])
    return (out[:, 0] - 0.16717362830052426) / 1.0333394966054072


def test_imagereward_equals_blips_forward_on_the_published_layout(tiny, reward):
    """The checkpoint in ImageReward.pt's layout, loaded through the reward's path, scores as a forward written
    from BLIP's code on that layout; prompts are lower-cased, padded and truncated to 35 tokens."""
    images = uint8_images(4, SIZE, SIZE, seed=1)
    images[3] = images[0]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    out = reward(images, prompts, [{}] * 4)
    tokens = reward.load().tokenizer(
        prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    assert tokens["input_ids"][0, :6].tolist() == [2, 5, 6, 7, 3, 0]  # [CLS] a red cube [SEP] [PAD]
    assert tokens["input_ids"][1, 1] == 5 + WORDS.index("two")  # lower-cased
    assert tokens["input_ids"].shape == (4, 35) and tokens["attention_mask"][2].all()  # truncated
    mean = torch.tensor(ir.CLIP_MEAN)[:, None, None]
    std = torch.tensor(ir.CLIP_STD)[:, None, None]
    with torch.no_grad():
        expected = hand_scores(tiny[3], (images - mean) / std, tokens["input_ids"], tokens["attention_mask"])
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=ATOL)
    assert out.scores.std() > 0.1 and out.scores[0] != out.scores[3]  # the image and the prompt both count
    assert_batch_independent(reward, uint8_images(4, 40, 48, seed=2), PROMPTS)


@pytest.mark.parametrize(("h", "w"), [(40, 56), (57, 45)])
def test_imagereward_preprocessing_is_the_packages_transform(reward, h: int, w: int):
    """ImageReward's _transform(n_px): Resize(n_px, bicubic) and CenterCrop(n_px) on the PIL image, ToTensor,
    CLIP's Normalize; here at n_px = 32 through the image_size option."""
    from PIL import Image
    from torchvision import transforms as T

    transform = T.Compose(
        [
            T.Resize(SIZE, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(SIZE),
            T.ToTensor(),
            T.Normalize(ir.CLIP_MEAN, ir.CLIP_STD),
        ]
    )
    images = uint8_images(2, h, w, seed=w)
    arrays = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    expected = torch.stack([transform(Image.fromarray(a)) for a in arrays])
    got = reward.preprocess(images)
    assert got.shape == expected.shape == (2, 3, SIZE, SIZE)
    assert (got - expected).abs().max() < 1.5 / 255 / min(ir.CLIP_STD)


def test_imagereward_refuses_other_checkpoints(tiny, tmp_path: Path):
    path, _, _, state = tiny
    wrong = {k: v for k, v in state.items() if not k.startswith(ir.HEAD)}
    torch.save(wrong, tmp_path / "nohead.pt")
    with pytest.raises(UserError, match="not an ImageReward checkpoint"):
        build(tiny, device="cpu", checkpoint=str(tmp_path / "nohead.pt")).load()
    with pytest.raises(UserError, match="does not fit"):
        build(tiny, device="cpu", image_size=48).load()  # more position embeddings than the checkpoint has
    torch.save({"x": torch.nn.Linear(2, 2)}, tmp_path / "pickle.pt")  # a module, not tensors: refused unread
    with pytest.raises(UserError, match="cannot read"):
        build(tiny, device="cpu", checkpoint=str(tmp_path / "pickle.pt")).load()


def test_imagereward_without_its_weights_is_one_paragraph_before_any_weights_load(tiny, tmp_path, monkeypatch):
    from tests.cli_run import tpflow
    from tests.test_train import tiny_recipe

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    reward = registry.build("reward", "imagereward")
    with pytest.raises(UserError, match="THUDM/ImageReward"):
        reward.load()
    with pytest.raises(UserError, match="bert-base-uncased"):  # the checkpoint there, the tokenizer not
        build(tiny, tokenizer="google-bert/bert-base-uncased").load()
    sources = registry.get("reward", "imagereward").factory.weight_sources(reward.options, {})
    assert [bool(s.problem) for s in sources] == [True, True] and "never downloads" in sources[0].problem
    recipe = tiny_recipe(tmp_path, None, reward="imagereward", backbone='name = "tiny-sd3"\nseed = 0')
    out = tpflow("validate", str(recipe))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "ImageReward.pt of THUDM/ImageReward is not in the Hugging Face cache" in err
    assert "Traceback" not in err
    described = tpflow("components", "reward", "imagereward", columns="80")
    assert described.returncode == 0 and "checkpoint" in described.stdout and "tokenizer" in described.stdout
    assert max(len(line) for line in described.stdout.splitlines()) <= 80


def test_imagereward_first_calls_from_two_threads_share_one_model(tiny):
    from concurrent.futures import ThreadPoolExecutor

    reward = build(tiny, device="cpu")
    images = uint8_images(2, SIZE, SIZE, seed=3)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: reward(images, PROMPTS[:2], [{}, {}]).scores, range(2)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert reward.load() is reward.load()
