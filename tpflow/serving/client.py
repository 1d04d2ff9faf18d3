"""Reward ``remote``: score images with a reward served over HTTP by ``tpflow serve-reward``.

    # on the machine that holds the reward model (a GPU box, another container, another environment):
    tpflow serve-reward --reward geneval --port 18085

    [reward]                       # in the training recipe
    name = "remote"
    url = "http://rewards.example:18085"

Why: a reward model may need another GPU, another Python environment or simply its own process; the trainer then
only needs the URL. Wire format (protocol 1, JSON over HTTP; ``tpflow.serving.server`` is the server):

    GET  /health -> {"tpflow": "0.1.0", "protocol": 1, "reward": "geneval", "options": {...}, "token": false,
                     "limits": {"max_request_bytes": ..., "max_images": ..., "max_side": ..., "max_pixels": ...}}
    POST /score  <- {"protocol": 1, "images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...]}
                    Content-Type: application/json; Authorization: Bearer TOKEN when the server requires a token
                 -> {"scores": [N floats], "details": {"name": [N floats], ...}}
    errors       -> {"error": "message"} with status 4xx (the request or the reward's configuration is wrong: not
                    retried) or 5xx (the reward raised, or the server is busy: retried)

The client splits one call into as many requests as the server's ``limits`` need (images per request, pixels per
request, bytes per request). With ``reward = "NAME"`` in its options it refuses a server that serves another reward.
The token, when the server wants one, comes from the environment variable ``TPFLOW_REWARD_TOKEN`` (``token_env``
names another), never from the recipe: recipes are copied into run dirs and checkpoints.

Images travel as 8-bit PNG, lossless, after the quantisation round(x·255), clipped. Remote scores equal in-process
scores exactly for a reward that quantises so itself (the CLIP-based ones, geneval's Mask2Former, ocr), and for any
reward when ``train.quantise_reward_images = true`` gives in-process calls the same 8-bit images; otherwise a reward
that reads the floats (shapes-geneval, image-stat, most plugins) scores slightly different pixels remotely
(docs/rewards.md). Only the recipe's URL is contacted: no proxy from the environment, no
redirect is followed. Every socket operation has a timeout and failures are retried a bounded number of times, so a
stopped server ends the run with a RewardError naming the URL instead of a hang.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from tpflow.errors import RewardError, UserError
from tpflow.images import to_uint8_hwc
from tpflow.registry import register
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource

PROTOCOL = 1  # bump when the wire format changes; client and server refuse each other's other numbers
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKEN_ENV = "TPFLOW_REWARD_TOKEN"


class RemoteOptions(BaseModel):
    """Options of the remote reward."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        ...,
        description="Base URL of a `tpflow serve-reward` server, e.g. http://127.0.0.1:18085. The only address "
        "contacted.",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="Socket timeout of one request in seconds (a scoring request includes the model)."
    )
    retries: int = Field(
        2, ge=0, le=10, description="Further attempts after a failed request (connection error, timeout, HTTP 5xx)."
    )
    backoff_s: float = Field(
        1.0, ge=0, le=60, description="Wait before the first retry in seconds; doubled before each further one."
    )
    reward: str | None = Field(
        None,
        description="Name of the reward the server must serve, e.g. 'geneval' (checked against its /health by "
        "`tpflow validate`, at the start of `tpflow train` and on the first call). Unset: any reward.",
    )
    token_env: str = Field(
        TOKEN_ENV,
        min_length=1,
        description="Environment variable holding the server's token (sent as Authorization: Bearer), when it was "
        "started with --token. The token itself never goes in a recipe.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")) or "://" == value[-3:]:
            raise ValueError("expected an http:// or https:// URL such as http://127.0.0.1:18085")
        return value


@register("reward", "remote", options=RemoteOptions)
class RemoteReward:
    """RewardModel: the client of a ``tpflow serve-reward`` server (module docstring).

    Options: ``url`` (required), ``timeout_s`` per request, ``retries`` after a failure, ``backoff_s`` before the
    first retry (doubling), ``reward`` (the name the server must serve), ``token_env`` (where the token is). The
    server is checked (protocol, reward name, limits) on the first call; ``preflight`` checks it before a run starts,
    and building the reward contacts nothing. Safe to call from several threads (each request is its own).
    """

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.url = options.url
        # No proxies from the environment and no redirects: only the recipe's URL is ever contacted.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
        self._token = os.environ.get(options.token_env, "").strip() or None
        self._limits: dict[str, int] = {}
        self.last_problem = ""  # why the last request failed after its retries ("" when it was answered)
        self._checked = False
        self._check_lock = threading.Lock()

    @staticmethod
    def weight_sources(options: RemoteOptions, settings: dict) -> list[WeightSource]:
        """No weights here: the server holds them (``tpflow.weights``; ``preflight`` checks it is up)."""
        what = f"reward 'remote' {options.reward or 'reward'} (option url)"
        return [WeightSource(what, options.url, f"the reward server {options.url} (its own weights)")]

    @staticmethod
    def preflight(options: RemoteOptions) -> None:
        """Is the server up, and does it serve ``options.reward``? One GET /health, a short timeout, no retry.

        Run by ``tpflow validate`` and at the start of ``tpflow train`` (before any weights load), not when a recipe
        is merely parsed: ``tpflow export`` of a finished run must not need the reward server.
        """
        quick = options.model_copy(update={"timeout_s": min(options.timeout_s, 5.0), "retries": 0})
        client = RemoteReward(quick)
        try:
            health = client._request("/health")
        except RewardError:
            if not client.last_problem:  # it answered, but not as expected (a wrong token, not a tpflow server)
                raise
            parts = urlsplit(options.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            raise UserError(
                f"The reward server {options.url} is not reachable ({client.last_problem}). Start "
                f"it first, on the machine of reward.url: `tpflow serve-reward --reward {options.reward or 'NAME'} "
                f"--port {port}` (add --host 0.0.0.0 when the trainer runs on another machine), or change "
                "reward.url."
            ) from None
        client._check_health(health)

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Send images [N, 3, H, W] in [0, 1] with their prompts and metadata; ``scores`` [N] float32."""
        n = images.shape[0]
        if not len(prompts) == len(metadata) == n:
            raise ValueError(f"Got {n} images, {len(prompts)} prompts and {len(metadata)} metadata entries.")
        self._check_server()
        encoded = encode_images(images)
        try:
            extra = [len(json.dumps(p)) + len(json.dumps(m)) + 8 for p, m in zip(prompts, metadata, strict=True)]
        except (TypeError, ValueError) as exc:  # a tensor or a circular structure in the metadata
            raise RewardError(f"Reward 'remote' ({self.url}) cannot send this metadata as JSON: {exc}.") from None
        replies = []
        for part in self._split([len(e) + x for e, x in zip(encoded, extra, strict=True)], images.shape[-2:]):
            body = {"protocol": PROTOCOL, "images": encoded[part], "prompts": list(prompts[part])}
            body["metadata"] = list(metadata[part])
            reply = self._request("/score", json.dumps(body).encode())
            count = part.stop - part.start
            details = reply.get("details") or {}
            if not isinstance(details, dict):
                raise RewardError(f"Reward server {self.url} sent details that are not a JSON object.")
            replies.append(
                (
                    _column(reply.get("scores"), count, "scores", self.url),
                    {k: _column(v, count, f"details[{k!r}]", self.url) for k, v in details.items()},
                )
            )
        if not replies:
            return RewardOutput(scores=torch.zeros(0, dtype=torch.float32, device="cpu"))
        keys = replies[0][1].keys()
        if any(d.keys() != keys for _, d in replies):
            raise RewardError(f"Reward server {self.url} sent different details for parts of one batch.")
        return RewardOutput(
            scores=torch.cat([s for s, _ in replies]), details={k: torch.cat([d[k] for _, d in replies]) for k in keys}
        )

    def _split(self, sizes: list[int], hw: Sequence[int]) -> list[slice]:
        """Consecutive parts of the batch, each within the server's limits (images, pixels and bytes per request)."""
        if not sizes:
            return []
        limits = self._limits
        per_image = max(1, int(hw[0]) * int(hw[1]))
        most = min(limits.get("max_images", len(sizes)), limits.get("max_pixels", per_image * len(sizes)) // per_image)
        budget = limits.get("max_request_bytes", sum(sizes) + 1024) - 1024  # the JSON around the images
        if max(int(hw[0]), int(hw[1])) > limits.get("max_side", 1 << 30) or most < 1:
            raise RewardError(
                f"Reward server {self.url} accepts images of at most {limits.get('max_side')} pixels per side and "
                f"{limits.get('max_pixels')} pixels per request; these are {hw[1]}x{hw[0]}: start it with larger "
                "--max-side / --max-megapixels."
            )
        parts, start, used = [], 0, 0
        for k, size in enumerate(sizes):
            if size > budget:
                raise RewardError(
                    f"One image takes {size / 1e6:.1f} MB as PNG, more than reward server {self.url} accepts per "
                    f"request ({(budget + 1024) / 1e6:.1f} MB): start it with a larger --max-request-mb."
                )
            if k > start and (k - start >= most or used + size > budget):
                parts.append(slice(start, k))
                start, used = k, 0
            used += size
        return [*parts, slice(start, len(sizes))]

    def _check_server(self) -> None:
        """Verify once that the URL serves tpflow's reward protocol (lazily: the server may start after the recipe)."""
        if self._checked:
            return
        with self._check_lock:
            if not self._checked:
                self._check_health(self._request("/health"))
                self._checked = True

    def _check_health(self, health: dict[str, Any]) -> None:
        """The server's /health: tpflow's, the same protocol, the recipe's reward; keeps its limits."""
        if "tpflow" not in health or "protocol" not in health:
            raise RewardError(f"{self.url} answered /health without tpflow's fields: is it `tpflow serve-reward`?")
        if health["protocol"] != PROTOCOL:
            raise RewardError(
                f"Reward server {self.url} (tpflow {health['tpflow']}) speaks reward protocol "
                f"{health['protocol']}, this client speaks protocol {PROTOCOL}: install the same tpflow version "
                "on both sides."
            )
        expected = self.options.reward
        if expected is not None and health.get("reward") != expected:
            raise RewardError(
                f"Reward server {self.url} serves reward {health.get('reward')!r}, but the recipe expects "
                f"{expected!r} (reward.reward): training against it would optimise the wrong objective. Point "
                f"reward.url at a server started with `tpflow serve-reward --reward {expected}`, or change "
                "reward.reward."
            )
        limits = health.get("limits")
        if isinstance(limits, dict):
            self._limits = {k: v for k, v in limits.items() if isinstance(v, int) and v > 0}

    def _request(self, path: str, body: bytes | None = None) -> dict[str, Any]:
        """GET (no body) or POST one JSON request; retries connection errors, timeouts and HTTP 5xx, bounded, but not
        507 (the server ran out of memory: the same images would again)."""
        url = self.url + path
        attempts = self.options.retries + 1
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        problem = self.last_problem = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers=headers)
            try:
                with self._opener.open(request, timeout=self.options.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code == HTTPStatus.INSUFFICIENT_STORAGE:  # the server's reward ran out of GPU memory
                    from tpflow.scoring.call import RewardOutOfMemoryError

                    raise RewardOutOfMemoryError(  # the trainer's out-of-memory paragraph names train.score_batch
                        f"Reward server {url} ran out of GPU memory (HTTP 507, attempt {attempt + 1} of {attempts}, "
                        f"not retried: the same images would run out again): {message}"
                    ) from None
                if exc.code < 500:  # the request or the server's reward configuration is wrong: retrying cannot help
                    hint = ""
                    if exc.code == 401:
                        hint = f" Set {self.options.token_env} to the server's token (its --token) before starting."
                    raise RewardError(
                        f"Reward server {url} rejected the request (HTTP {exc.code}, attempt {attempt + 1} of "
                        f"{attempts}, not retried): {message}{hint}"
                    ) from None
                problem = f"HTTP {exc.code}: {message}"
                continue
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # refused, reset, timeout
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                problem = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
                continue
            try:
                reply = json.loads(raw)
            except ValueError:
                raise RewardError(f"{url} did not answer JSON: is it `tpflow serve-reward`?") from None
            if not isinstance(reply, dict):
                raise RewardError(f"{url} answered {type(reply).__name__}, not a JSON object.")
            return reply
        self.last_problem = problem
        raise RewardError(
            f"Reward server {url} failed after {attempts} attempt{'s' if attempts > 1 else ''} (last: {problem}). "
            "Check that `tpflow serve-reward` runs there and is reachable, or change reward.url."
        )


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: a reward server never sends one, and following it would contact another address."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        raise RewardError(
            f"Reward server {req.full_url} answered HTTP {code}, a redirect to {newurl}; redirects are refused (only "
            "reward.url is contacted, once per attempt): set reward.url to the reward server's own address."
        )


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's {"error": ...} text, or the raw body when it is not tpflow's JSON."""
    try:
        raw = exc.read()
    except OSError:
        raw = b""
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500].strip() or str(exc.reason)


def _column(values: Any, n: int, what: str, url: str) -> Tensor:
    """A JSON list of n numbers as a float32 tensor [n]."""
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise RewardError(f"Reward server {url} sent {what} for {got} images, expected {n}.")
    try:
        return torch.tensor(values, dtype=torch.float32, device="cpu")
    except (TypeError, ValueError):
        raise RewardError(f"Reward server {url} sent non-numeric {what}.") from None


def encode_images(images: Tensor) -> list[str]:
    """Images [N, 3, H, W] in [0, 1] -> base64 PNG strings (8 bit RGB, lossless)."""
    from PIL import Image

    out = []
    for array in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(array, mode="RGB").save(buffer, format="PNG", compress_level=1)  # speed over size
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk, read before any pixel is decoded."""
    if data[:8] != PNG_SIGNATURE:
        raise ValueError("not a PNG (the PNG signature is missing)")
    if len(data) < 33 or data[8:16] != b"\x00\x00\x00\x0dIHDR":
        raise ValueError("a PNG without its IHDR header")
    if zlib.crc32(data[12:29]) != int.from_bytes(data[29:33], "big"):
        raise ValueError("a PNG whose IHDR header is corrupt (CRC mismatch)")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def decode_images(encoded: Sequence[str], max_side: int | None = None, max_pixels: int | None = None) -> Tensor:
    """Base64 PNG strings of one size -> images [N, 3, H, W] float32 in [0, 1] (exactly k/255).

    Only PNG is accepted. Every image's size is read from its header and checked against ``max_side`` (pixels per
    side) and the sum against ``max_pixels`` *before* any is decoded, so a decompression bomb (a few kB claiming
    9000x9000) costs nothing. Raises ValueError naming the offending image.
    """
    from PIL import Image

    blobs, sizes = [], []
    for k, text in enumerate(encoded):
        try:
            blobs.append(base64.b64decode(text, validate=True))
            sizes.append(png_size(blobs[-1]))
        except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
            raise ValueError(f"images[{k}] is not a base64 PNG ({exc}).") from None
        width, height = sizes[-1]
        if max_side is not None and not (0 < width <= max_side and 0 < height <= max_side):
            raise ValueError(f"images[{k}] is {width}x{height}; this server accepts at most {max_side} per side.")
    total = sum(w * h for w, h in sizes)
    if max_pixels is not None and total > max_pixels:
        raise ValueError(f"the images hold {total} pixels; this server accepts at most {max_pixels} per request.")
    if len(set(sizes)) > 1:
        raise ValueError(f"images differ in size: {sorted(set(sizes))}; send one size per request.")
    arrays = []
    for k, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob), formats=["PNG"]) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        except Exception as exc:  # PIL.UnidentifiedImageError, truncated files...
            raise ValueError(f"images[{k}] is not a valid PNG ({type(exc).__name__}: {exc}).") from None
    if not arrays:
        return torch.empty(0, 3, 0, 0, device="cpu")
    # Contiguous [N, 3, H, W], the layout of in-process images: a reduction's float rounding follows the memory layout
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous().float() / 255
