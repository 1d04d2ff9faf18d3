"""``tpflow serve-reward``: serve any registered reward over HTTP for the ``remote`` reward.

    tpflow serve-reward --reward geneval --port 18085 [--host 0.0.0.0] [--set key=value ...]

Standard library only (``http.server``). The wire format is documented in ``tpflow.rewards.remote``. Requests are
parsed concurrently but scored one at a time under a lock, because reward models are not all thread-safe (and one
model on one GPU gains nothing from interleaving). ``/health`` never waits for the lock.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from tpflow import __version__, registry
from tpflow.errors import UserError
from tpflow.rewards.remote import PROTOCOL, decode_images


class BadRequest(ValueError):
    """A /score request that does not follow the protocol (HTTP 400; the client does not retry)."""


class RewardServer(ThreadingHTTPServer):
    """An HTTP server that owns one built reward model."""

    daemon_threads = True  # Ctrl-C must not wait for a client that keeps its connection open

    def __init__(self, address: tuple[str, int], reward_name: str, options: dict[str, Any]):
        self.reward_name = reward_name
        self.reward = registry.build("reward", reward_name, **options)  # validates the options (UserError)
        self.options = registry.validate_options("reward", reward_name, options).model_dump(mode="json")
        self.lock = threading.Lock()
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def health(self) -> dict[str, Any]:
        return {"tpflow": __version__, "protocol": PROTOCOL, "reward": self.reward_name, "options": self.options}

    def score(self, request: Any) -> dict[str, Any]:
        """Validate a /score request (BadRequest: HTTP 400) and score it (the reward's own errors propagate)."""
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
        metadata = request.get("metadata", [{} for _ in images])
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("'prompts' must be a list of strings.")
        if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
            raise BadRequest("'metadata' must be a list of JSON objects.")
        if not len(images) == len(prompts) == len(metadata):
            raise BadRequest(f"got {len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata entries.")
        try:
            pixels = decode_images(images)  # [N, 3, H, W]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        with self.lock, torch.no_grad():
            out = self.reward(pixels, prompts, metadata)
        scores = out.scores.detach().float().cpu().reshape(-1)
        if scores.shape[0] != len(images):
            raise RuntimeError(
                f"reward {self.reward_name!r} returned {scores.shape[0]} scores for {len(images)} images."
            )
        details = {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in out.details.items()}
        return {"scores": scores.tolist(), "details": details}


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") == "/health":
            self._reply(HTTPStatus.OK, self.server.health())
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use GET /health, POST /score."})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}: use GET /health, POST /score."})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError(f"Content-Length {length}")
            request = json.loads(self.rfile.read(length))
        except ValueError as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"the body must be JSON with a Content-Length ({exc})."})
            return
        try:
            self._reply(HTTPStatus.OK, self.server.score(request))
        except BadRequest as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"bad /score request: {exc}"})
        except UserError as exc:  # the reward's configuration (missing weights...): the client must not retry
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc)})
        except Exception as exc:  # the model raised: report it to the client, keep the traceback here
            traceback.print_exc(file=sys.stderr)
            error = f"reward {self.server.reward_name!r} raised {type(exc).__name__}: {exc}"
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": error})

    def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per request would drown the server's console; errors are printed where they happen


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` (or ``key.sub=value``) command-line items -> reward options; values parse as TOML if they can.

    The same parsing as ``tpflow train --set``, applied under the ``[reward]`` section.
    """
    from tpflow.errors import RecipeError
    from tpflow.recipe import apply_overrides

    data: dict[str, Any] = {}
    for item in items:
        try:
            apply_overrides(data, [f"reward.{item.strip()}"])
        except RecipeError:
            raise UserError(f"Bad reward option {item!r}: expected key=value, e.g. --set score=strict.") from None
    return data.get("reward", {})


def make_server(reward_name: str, options: dict[str, Any], host: str = "127.0.0.1", port: int = 18085) -> RewardServer:
    """Build the reward and bind the server (port 0: any free port; see ``server.url``)."""
    try:
        return RewardServer((host, port), reward_name, options)
    except OSError as exc:
        raise UserError(f"Cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port.") from None


def serve(
    reward_name: str,
    options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 18085,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve until Ctrl-C; ``announce`` receives the URL once the socket listens."""
    server = make_server(reward_name, options, host, port)
    announce(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
