"""Reward ``remote``: score images with a reward served over HTTP by ``tpflow serve-reward``.

    # on the machine that holds the reward model (a GPU box, another container, another environment):
    tpflow serve-reward --reward geneval --port 18085

    [reward]                       # in the training recipe
    name = "remote"
    url = "http://rewards.example:18085"

Why: a reward model may need another GPU, another Python environment or simply its own process; the trainer then
only needs the URL. Wire format (protocol 1, JSON over HTTP; ``tpflow.rewards.serve`` is the server):

    GET  /health -> {"tpflow": "0.1.0", "protocol": 1, "reward": "geneval", "options": {...}}
    POST /score  <- {"protocol": 1, "images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}, ...]}
                 -> {"scores": [N floats], "details": {"name": [N floats], ...}}
    errors       -> {"error": "message"} with status 4xx (the request or the reward's configuration is wrong: not
                    retried) or 5xx (the reward raised: retried)

Images travel as 8-bit PNG, lossless, after the same quantisation every reward applies (round(x·255), clipped), so
remote scores equal in-process scores exactly. Only the recipe's URL is contacted: no proxy from the environment, no
redirect is followed. Every socket operation has a timeout and failures are retried a bounded number of times, so a
stopped server ends the run with a RewardError naming the URL instead of a hang.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from tpflow.errors import RewardError
from tpflow.registry import register
from tpflow.rewards._images import to_uint8_hwc
from tpflow.types import RewardOutput

PROTOCOL = 1  # bump when the wire format changes; client and server refuse each other's other numbers


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
    first retry (doubling). The server's protocol is checked on the first call, not when the recipe is built, so
    ``tpflow validate`` works without the server. Safe to call from several threads (each call is one request).
    """

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.url = options.url
        # No proxies from the environment and no redirects: only the recipe's URL is ever contacted.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
        self._checked = False
        self._check_lock = threading.Lock()

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Send images [N, 3, H, W] in [0, 1] with their prompts and metadata; ``scores`` [N] float32."""
        n = images.shape[0]
        if not len(prompts) == len(metadata) == n:
            raise ValueError(f"Got {n} images, {len(prompts)} prompts and {len(metadata)} metadata entries.")
        self._check_server()
        try:
            body = json.dumps(
                {
                    "protocol": PROTOCOL,
                    "images": encode_images(images),
                    "prompts": list(prompts),
                    "metadata": list(metadata),
                }
            )
        except (TypeError, ValueError) as exc:  # a tensor or a circular structure in the metadata
            raise RewardError(f"Reward 'remote' ({self.url}) cannot send this metadata as JSON: {exc}.") from None
        reply = self._request("/score", body.encode())
        scores = _column(reply.get("scores"), n, "scores", self.url)
        details = reply.get("details") or {}
        if not isinstance(details, dict):
            raise RewardError(f"Reward server {self.url} sent details that are not a JSON object.")
        return RewardOutput(
            scores=scores, details={k: _column(v, n, f"details[{k!r}]", self.url) for k, v in details.items()}
        )

    def _check_server(self) -> None:
        """Verify once that the URL serves tpflow's reward protocol (lazily: the server may start after the recipe)."""
        if self._checked:
            return
        with self._check_lock:
            if self._checked:
                return
            health = self._request("/health")
            if "tpflow" not in health or "protocol" not in health:
                raise RewardError(f"{self.url} answered /health without tpflow's fields: is it `tpflow serve-reward`?")
            if health["protocol"] != PROTOCOL:
                raise RewardError(
                    f"Reward server {self.url} (tpflow {health['tpflow']}) speaks reward protocol "
                    f"{health['protocol']}, this client speaks protocol {PROTOCOL}: install the same tpflow version "
                    "on both sides."
                )
            self._checked = True

    def _request(self, path: str, body: bytes | None = None) -> dict[str, Any]:
        """GET (no body) or POST one JSON request; retries connection errors, timeouts and HTTP 5xx, bounded."""
        url = self.url + path
        attempts = self.options.retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(request, timeout=self.options.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code < 500:  # the request or the server's reward configuration is wrong: retrying cannot help
                    raise RewardError(
                        f"Reward server {url} rejected the request (HTTP {exc.code}, attempt {attempt + 1} of "
                        f"{attempts}, not retried): {message}"
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


def decode_images(encoded: Sequence[str]) -> Tensor:
    """Base64 PNG strings of one size -> images [N, 3, H, W] float32 in [0, 1] (exactly k/255)."""
    from PIL import Image

    arrays = []
    for k, text in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        except Exception as exc:  # binascii.Error, PIL.UnidentifiedImageError, truncated files...
            raise ValueError(f"images[{k}] is not a base64 PNG ({type(exc).__name__}: {exc}).") from None
    if len({a.shape for a in arrays}) > 1:
        raise ValueError(f"images differ in size: {sorted({a.shape[:2] for a in arrays})}; send one size per request.")
    if not arrays:
        return torch.empty(0, 3, 0, 0, device="cpu")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255  # [N, 3, H, W]
