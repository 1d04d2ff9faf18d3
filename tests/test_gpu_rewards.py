"""Rewards on the device, for the rewards without a model of their own (image-stat, shapes-geneval, geneval with the
shapes detector, weighted, remote), and where a reward's own model is placed.

The rewards with models are tested on the device next to their CPU tests, on the same tiny random models
(``test_reward_clip.py``, ``test_reward_geneval.py``, ``test_reward_ocr.py``). Here the images are given on the
device (the backbone's VAE decodes on the GPU), in float32, float16 or bfloat16, and every reward must return
``scores`` [N] float32 and ``details`` on the CPU, equal to the scores of the same values given on the CPU in float32.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import tpflow
from tpflow.serving.client import decode_images, encode_images
from tpflow.serving.lifecycle import make_server
from tpflow.shapes.prompts import prompts as shape_prompts
from tpflow.shapes.render import render_batch
from tpflow.train.scoring import ScoringWorker

from .test_device_rules import FactoryWatch

DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"]
)
REWARDS = {  # name -> (registered reward, options)
    "brightness": ("image-stat", {"statistic": "brightness"}),
    "saturation": ("image-stat", {"statistic": "saturation", "maximize": False}),
    "contrast": ("image-stat", {"statistic": "contrast"}),
    "shapes-geneval": ("shapes-geneval", {}),
    "geneval-shapes": ("geneval", {"detector": "shapes", "score": "strict"}),
    "weighted": (
        "weighted",
        {"rewards": [{"name": "shapes-geneval", "weight": 2.0}, {"name": "image-stat", "weight": -0.5}]},
    ),
}
# image-stat reduces 3·32·32 values in [0, 1] in float32: the CPU and CUDA sum in different orders, each within
# about log2(3072)·2^-24 ≈ 1e-6 of the exact mean. The GenEval verdicts are computed on the CPU from the same
# uint8-exact values, hence equal.
ATOL = 1e-5


def scenes(n: int = 12) -> tuple[torch.Tensor, list[str], list[dict]]:
    """Rendered shapes images [n, 3, 32, 32] on the CPU; the second half is paired with the wrong metadata."""
    items = shape_prompts("test", n, seed=3)
    images = render_batch([item.metadata for item in items], np.random.default_rng(0))
    order = list(range(n // 2)) + [n // 2 + (k + 1) % (n - n // 2) for k in range(n - n // 2)]
    return images, [items[k].prompt for k in order], [items[k].metadata for k in order]


def assert_host_output(out, n: int) -> None:
    """The house convention: scores [n] float32, finite, and every detail on the CPU."""
    assert out.scores.shape == (n,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert torch.isfinite(out.scores).all()
    assert all(v.device.type == "cpu" and v.shape == (n,) for v in out.details.values())


@DTYPES
@pytest.mark.parametrize("name", list(REWARDS))
def test_rewards_score_images_on_the_device_as_on_the_cpu(name, device, dtype):
    reward = tpflow.build("reward", REWARDS[name][0], **REWARDS[name][1])
    images, prompts, metadata = scenes()
    images = images.to(dtype)  # the values the device gets; the CPU reference scores the same values in float32
    out = reward(images.to(device), prompts, metadata)
    want = reward(images.float(), prompts, metadata)
    assert_host_output(out, len(prompts))
    torch.testing.assert_close(out.scores, want.scores, rtol=0, atol=ATOL)
    assert out.details.keys() == want.details.keys()
    for key, value in out.details.items():
        torch.testing.assert_close(value, want.details[key], rtol=0, atol=ATOL, msg=key)
    if "geneval" in name:
        assert len(set(want.scores.tolist())) >= 2  # right and wrong prompts: equality proves something


@DTYPES
def test_remote_sends_images_from_the_device(device, dtype):
    """The client quantises on the device and sends the same PNGs as from the CPU; the scores come back on the CPU."""
    images, prompts, metadata = scenes(6)
    images = images.to(dtype)
    assert encode_images(images.to(device)) == encode_images(images.float())
    httpd = make_server("shapes-geneval", {}, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        remote = tpflow.build("reward", "remote", url=httpd.url, retries=0)
        out = remote(images.to(device), prompts, metadata)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert_host_output(out, len(prompts))
    local = tpflow.build("reward", "shapes-geneval")(images.float(), prompts, metadata)  # uint8-exact renderings
    assert torch.equal(out.scores, local.scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_scoring_worker_thread_with_images_decoded_on_the_device(device, dtype):
    """As in training: the worker thread decodes onto the device (here: a cast) and calls the reward there."""
    images, prompts, metadata = scenes()
    reward = tpflow.build("reward", "weighted", **REWARDS["weighted"][1])
    worker = ScoringWorker(lambda latents: latents.to(device=device, dtype=dtype), reward, chunk=5)
    try:
        scored = worker.submit(images, None, prompts, metadata, window=0).result(timeout=60)
    finally:
        worker.close()
    assert scored.trace.device.type == "cpu" and scored.trace.shape == (len(prompts), 1)
    want = reward(images.to(dtype).float(), prompts, metadata)
    torch.testing.assert_close(scored.trace[:, 0], want.scores, rtol=0, atol=ATOL)
    assert all(v.device.type == "cpu" for v in scored.details.values())


@pytest.mark.parametrize("option", ["auto", "cuda"])
def test_rewards_resolve_their_device_when_built(monkeypatch: pytest.MonkeyPatch, option):
    """A reward loads on its first call, usually in the scoring worker thread: its device is resolved when it is
    built, by the thread that selected the process's GPU, to that indexed GPU (here a pretend cuda:3 of 4)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # this process's GPU, selected by accelerate
    gpu = torch.device("cuda", 3)
    for name in ("clipscore", "pickscore"):
        assert tpflow.build("reward", name, device=option).device == gpu, name  # builds without loading anything
    assert tpflow.build("reward", "aesthetic", head="head.pth", device=option).device == gpu
    assert tpflow.build("reward", "geneval", device=option).detector.device == gpu


class _Engine:
    """A stand-in rapidocr engine that reads "hi" everywhere."""

    def __call__(self, image):
        return [[[[0, 0]] * 4, "hi", 0.9]], [0.0]


def test_rewards_state_every_device():
    """Every tensor these rewards make says where it lives (tpflow.devices): none falls back to the default device."""
    images, prompts, metadata = scenes()
    with FactoryWatch() as watch:
        for name, options in REWARDS.values():
            tpflow.build("reward", name, **options)(images, prompts, metadata)
        ocr = tpflow.build("reward", "ocr")
        ocr._engine = _Engine()
        ocr(images, prompts, metadata)
        decode_images(encode_images(images))
        decode_images([])
    assert not watch.calls, "\n".join(sorted(set(watch.calls)))
