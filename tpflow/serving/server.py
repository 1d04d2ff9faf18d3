"""The server of ``tpflow serve-reward``: any registered reward over HTTP for the ``remote`` reward, its requests
handled under ``Limits``. Its life cycle (the options parsed, the reward checked, the port bound, served until a
signal) is ``tpflow.serving.lifecycle``.

    tpflow serve-reward --reward geneval --port 18085 [--host 0.0.0.0] [--set key=value ...]
        [--max-request-mb 64] [--max-images 256] [--max-side 2048] [--max-megapixels 64]
        [--max-connections 16] [--header-timeout-s 5] [--timeout-s 30] [--token TOKEN | env TPFLOW_REWARD_TOKEN]

The wire format is documented in ``tpflow.serving.client``. Requests are parsed concurrently but scored one at a
time under a lock, because reward models are not all thread-safe (and one model on one GPU gains nothing from
interleaving). ``/health`` never waits for the lock.

The server assumes hostile clients (``Limits``): a body larger than ``max_request_bytes`` is refused (413) from its
Content-Length, before it is read; only PNG is accepted and every image's size is read from its IHDR header and
checked before any pixel is decoded (no decompression bomb); images and pixels per request are capped; only
``Content-Type: application/json`` is accepted (415: a browser's cross-site form post cannot reach the model); the
request line and headers must arrive within ``header_timeout_s`` and the whole request within ``timeout_s`` (a slow
client or a Content-Length larger than the body is dropped); at most ``max_connections`` connections are served at
once. When they are all taken, a new connection closes the one that has waited longest for its request line and
headers (a slowloris client, or an idle keep-alive connection) and takes its place; only when every connection is
past its headers (they have arrived, parsed or not: ``tpflow.serving.slots``) does it get 503, closed at once. So
trickling headers cannot lock an honest client out, however often the attacker reconnects, from however many
addresses. Every error, including a garbage request line, is a JSON ``{"error": ...}``, never an HTML
page or a dropped connection.
With a token (``--token`` or ``TPFLOW_REWARD_TOKEN``) /score needs ``Authorization: Bearer TOKEN`` (401 otherwise,
compared in constant time) and /health shows the reward's options only to a client that sends it. The token is not
encryption: across untrusted networks put the server behind TLS (an SSH tunnel or a reverse proxy). Before it
listens the server runs the reward's machine checks, as ``tpflow train`` does (``check_reward``).

Why the standard library (``http.server``) and not an ASGI stack: the service has two routes and one model, the
limits above fit in a subclass of ``ThreadingHTTPServer``, and the server then runs in any environment that can
import the reward, with nothing more to install or keep compatible.
"""

from __future__ import annotations

import hmac
import io
import json
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from pydantic import BaseModel

from tpflow import __version__, registry
from tpflow.errors import UserError
from tpflow.scoring.call import OUT_OF_MEMORY, one_line
from tpflow.serving.client import PROTOCOL, decode_images
from tpflow.serving.slots import DeadlineReader, Slots
from tpflow.weights import WeightSource

MAX_JSON_DEPTH = 32  # metadata nests a few levels; deeper is an attack on some recursive consumer


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server. The defaults fit one scoring batch of the trainer (256 images of
    512x512, or 64 of 1024x1024; the ``remote`` client splits larger calls to fit) and bound memory to about
    ``max_connections`` x 3 x ``max_request_bytes`` for bodies plus 2 x 18 B x ``max_pixels`` for decoded images."""

    max_request_bytes: int = 64 << 20
    max_images: int = 256
    max_side: int = 2048
    max_pixels: int = 64_000_000
    max_connections: int = 16
    header_timeout_s: float = 5.0  # request line and headers: a few hundred bytes, sent at once by any real client
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_request_bytes, self.max_images, self.max_side, self.max_pixels, self.max_connections) < 1:
            raise UserError(f"Every serve-reward limit must be positive, got {self}.")
        if not self.timeout_s > 0:
            raise UserError(f"--timeout-s must be positive, got {self.timeout_s}.")
        if not self.header_timeout_s > 0:
            raise UserError(f"--header-timeout-s must be positive, got {self.header_timeout_s}.")


class BadRequest(ValueError):
    """A /score request that does not follow the protocol or the limits (HTTP 400 or ``status``; not retried)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


class RewardServer(ThreadingHTTPServer):
    """An HTTP server that owns one built reward model and enforces ``Limits`` and the optional token."""

    daemon_threads = True  # Ctrl-C must not wait for a client that keeps its connection open
    block_on_close = False
    request_queue_size = 128  # the listen backlog; connections beyond max_connections are refused after accept

    def __init__(
        self,
        address: tuple[str, int],
        reward_name: str,
        options: dict[str, Any],
        limits: Limits | None = None,
        token: str | None = None,
    ):
        self.reward_name = reward_name
        validated = registry.checked_options("reward", reward_name, options)  # UserError naming each bad field
        self.weights = check_reward(reward_name, validated)  # before the reward is built and the port bound
        self.reward = registry.get("reward", reward_name).factory(validated)
        self.options = validated.model_dump(mode="json")
        self.limits = limits or Limits()
        self.token = token.encode() if token else None
        self.lock = threading.Lock()  # one scoring call at a time
        self.decoding = threading.BoundedSemaphore(2)  # decoded requests in memory: one scored, one waiting
        self.slots = Slots(self.limits.max_connections)
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def authorized(self, header: str | None) -> bool:
        """No token configured, or ``Authorization: Bearer TOKEN`` with the right one (constant-time compare)."""
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token)

    def health(self, authorized: bool) -> dict[str, Any]:
        private = ("max_connections", "header_timeout_s", "timeout_s")
        limits = {k: v for k, v in asdict(self.limits).items() if k not in private}
        reply = {"tpflow": __version__, "protocol": PROTOCOL, "reward": self.reward_name, "token": bool(self.token)}
        if authorized:  # the options may name paths and devices: only for clients holding the token
            reply["options"] = self.options
        return {**reply, "limits": limits}

    def score(self, request: Any) -> dict[str, Any]:
        """Validate a /score request (BadRequest: HTTP 4xx) and score it (the reward's own errors propagate)."""
        if not isinstance(request, dict):
            raise BadRequest("the body must be a JSON object.")
        if request.get("protocol") != PROTOCOL:
            raise BadRequest(
                f"the client speaks reward protocol {request.get('protocol')!r}, this server (tpflow {__version__}) "
                f"speaks protocol {PROTOCOL}: install the same tpflow version on both sides."
            )
        images, prompts = request.get("images"), request.get("prompts")
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise BadRequest("'images' must be a list of base64 PNG strings.")
        if len(images) > self.limits.max_images:
            raise BadRequest(
                f"{len(images)} images in one request; this server accepts at most {self.limits.max_images}.",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        metadata = request.get("metadata", [{} for _ in images])
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("'prompts' must be a list of strings.")
        if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
            raise BadRequest("'metadata' must be a list of JSON objects.")
        if not len(images) == len(prompts) == len(metadata):
            raise BadRequest(f"got {len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata entries.")
        if _depth(metadata) > MAX_JSON_DEPTH:
            raise BadRequest(f"'metadata' nests deeper than {MAX_JSON_DEPTH} levels.")
        with self.decoding:
            try:
                pixels = decode_images(images, self.limits.max_side, self.limits.max_pixels)  # [N, 3, H, W]
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            with self.lock, torch.no_grad():
                out = self.reward(pixels, prompts, metadata)
            del pixels
        scores = out.scores.detach().float().cpu().reshape(-1)
        if scores.shape[0] != len(images):
            raise RuntimeError(
                f"reward {self.reward_name!r} returned {scores.shape[0]} scores for {len(images)} images."
            )
        details = {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in out.details.items()}
        return {"scores": scores.tolist(), "details": details}

    # Connection bound: the accept loop hands a connection to a thread only while a slot is free, or can be freed at
    # once; otherwise it refuses it at once. It never waits, so /health (accepted here too) is answered at once.
    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.take():
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts process_request_thread
        except BaseException:
            self.slots.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release(request)

    def _refuse(self, sock: socket.socket) -> None:
        """503 without reading the request, then close: a full server costs an excess client one write."""
        busy = f"busy: {self.limits.max_connections} requests are in progress (--max-connections); retry later."
        body = json.dumps({"error": busy}).encode()
        head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        try:
            sock.settimeout(1.0)
            sock.sendall(f"{head}Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        except OSError:
            pass
        self.shutdown_request(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up or timed out is not news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"
    server_version = "tpflow-serve-reward"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the stdlib's reader, without a deadline (closing it leaves the socket open)
        self._input = DeadlineReader(self.connection, self.server.limits.timeout_s)
        self.rfile = io.BufferedReader(self._input)

    def handle_one_request(self) -> None:
        limits = self.server.limits
        self._started = time.monotonic()
        self._input.deadline = self._started + min(limits.header_timeout_s, limits.timeout_s)  # line and headers
        self.server.slots.await_headers(self._input)
        try:
            super().handle_one_request()
        finally:
            self.server.slots.settle(self._input)

    def parse_request(self) -> bool:
        """Read the headers (under the header deadline); then the body has the rest of the request deadline and
        the connection can no longer be evicted."""
        parsed = super().parse_request()
        if not self.server.slots.settle(self._input):  # evicted as its last header bytes came
            self.close_connection = True
            return False
        self._input.deadline = self._started + self.server.limits.timeout_s
        return parsed

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") == "/health":
            self._reply(HTTPStatus.OK, self.server.health(self.server.authorized(self.headers.get("Authorization"))))
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use GET /health, POST /score."})

    def do_POST(self) -> None:  # noqa: N802
        refused = self._refusal()
        if refused is not None:  # answered before reading the body, so the connection cannot be reused
            self.close_connection = True
            self._reply(*refused)
            return
        length = int(self.headers["Content-Length"])
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            error = f"the request did not arrive whole within {self.server.limits.timeout_s:g} s (--timeout-s)."
            self._reply(HTTPStatus.REQUEST_TIMEOUT, {"error": error})
            return
        try:
            request = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            error = f"the body must be JSON ({type(exc).__name__}: {str(exc)[:200]})."
            self._reply(HTTPStatus.BAD_REQUEST, {"error": error})
            return
        try:
            self._reply(HTTPStatus.OK, self.server.score(request))
        except BadRequest as exc:
            self._reply(exc.status, {"error": f"bad /score request: {exc}"})
        except UserError as exc:  # the reward's configuration (missing weights...): the client must not retry
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc)})
        except (TypeError, ValueError, LookupError) as exc:  # the reward rejects these prompts or metadata
            error = (
                f"reward {self.server.reward_name!r} cannot score this request ({type(exc).__name__}: {exc}): "
                "check the prompts and metadata the recipe's dataset sends."
            )
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": error})
        except OUT_OF_MEMORY as exc:  # the same images would run out again: 507, which the client does not retry
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next, smaller request starts from the memory this one held
            error = (
                f"reward {self.server.reward_name!r} ran out of GPU memory on the server ({one_line(str(exc))}); send "
                "fewer images per request (train.score_batch, eval.batch_size) or give the server more memory."
            )
            self._reply(HTTPStatus.INSUFFICIENT_STORAGE, {"error": error})
        except Exception as exc:  # the model failed (a flaky dependency...): report it to the client, which retries
            traceback.print_exc(file=sys.stderr)
            error = f"reward {self.server.reward_name!r} raised {type(exc).__name__}: {exc}"
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": error})

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` (curl's habit for large bodies): refuse before the client sends the body."""
        refused = self._refusal() if self.command == "POST" else None
        if refused is None:
            return super().handle_expect_100()
        self.close_connection = True
        self._reply(*refused)
        return False

    def _refusal(self) -> tuple[HTTPStatus, dict[str, str]] | None:
        """Why this POST is refused from its request line and headers alone, or None."""
        if self.path.rstrip("/") != "/score":
            return HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use GET /health, POST /score."}
        if not self.server.authorized(self.headers.get("Authorization")):
            return HTTPStatus.UNAUTHORIZED, {"error": "this server needs its token: Authorization: Bearer TOKEN."}
        if self.headers.get_content_type() != "application/json":
            error = f"the body must be Content-Type: application/json, got {self.headers.get('Content-Type')!r}."
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": error}
        if "Transfer-Encoding" in self.headers:
            return HTTPStatus.LENGTH_REQUIRED, {"error": "send the body with a Content-Length, not chunked."}
        text = self.headers.get("Content-Length", "").strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 18):  # int() of "²" or of 5,000 digits raises
            return HTTPStatus.LENGTH_REQUIRED, {"error": f"a Content-Length is required, got {text!r}."}
        if int(text) > self.server.limits.max_request_bytes:
            error = (
                f"the body is {int(text)} bytes; this server accepts at most {self.server.limits.max_request_bytes} "
                "(--max-request-mb): send fewer images per request."
            )
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": error}
        return None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's errors (a garbage request line, an unknown method, oversized headers) as JSON."""
        if self.request_version == "HTTP/0.9":  # unparsable line: answer HTTP/1.1, not a bare HTML body
            self.request_version = "HTTP/1.1"
        self.close_connection = True
        short = self.responses.get(code, ("error", ""))[0]
        self._reply(code, {"error": f"{short}: {message}" if message else short})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.connection.settimeout(self.server.limits.timeout_s)  # the reader's deadline does not bound writes
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per request would drown the server's console; errors are printed where they happen


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (iterative: a deep value must not exhaust the stack here either)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH and isinstance(item, (list, dict)):
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_reward(reward_name: str, options: BaseModel) -> list[WeightSource]:
    """What ``tpflow train`` checks of a recipe's reward before anything loads (``tpflow.preflight``): ``device``
    options this machine has, the reward's own machine check, every weight on disk, then the services it needs (its
    ``preflight`` hook). One UserError lists the problems (exit status 2), so a server missing a weight stops at once
    instead of answering every client's first request with the error. Returns where each weight is read from."""
    from tpflow.preflight import check_component

    problems, weights = check_component("reward", reward_name, options, {})
    if problems:
        raise UserError(f"Cannot serve reward {reward_name!r} on this machine: " + " ".join(problems))
    registry.preflight("reward", reward_name, options)
    return weights
