"""``tpflow serve-reward`` against hostile clients, and the ``remote`` reward's token, name and preflight.

Each test starts a real server in a thread on a free port, serving ``image-stat`` (no model), with limits shrunk so
that every case answers in well under a second. Raw sockets play the hostile client where ``urllib`` would not
misbehave on purpose.
"""

from __future__ import annotations

import base64
import io
import json
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tpflow
from tpflow import registry
from tpflow.errors import RewardError, UserError
from tpflow.recipe import load_recipe
from tpflow.serving.client import encode_images
from tpflow.serving.lifecycle import make_server
from tpflow.serving.server import Limits, RewardServer

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serving(limits: Limits | None = None, token: str | None = None) -> Iterator[RewardServer]:
    httpd = make_server("image-stat", {}, "127.0.0.1", 0, limits, token)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def _connect(httpd: RewardServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(httpd.server_address[:2], timeout=timeout)


def _response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read one response: (status, JSON body). Raises on a closed connection or a timeout."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed without a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == "application/json", head
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), json.loads(body)


def _send(
    httpd: RewardServer,
    body: bytes,
    content_type: str = "application/json",
    extra: str = "",
    length: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """POST /score over a raw socket (any body, any headers) and read the answer."""
    with _connect(httpd) as sock:
        head = (
            f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra}\r\n"
        )
        sock.sendall(head.encode() + body)
        return _response(sock)


def _payload(encoded: list[str], **fields: Any) -> bytes:
    request = {"protocol": 1, "images": encoded, "prompts": ["a"] * len(encoded), "metadata": [{}] * len(encoded)}
    return json.dumps({**request, **fields}).encode()


def _png(width: int, height: int) -> bytes:
    """A real 1-bit grey PNG of zeros: a few kB that decode to width x height x 3 bytes (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"\0" * (height * (1 + (width + 7) // 8))  # filter byte + packed bits per row
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
    return png


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


SMALL = encode_images(torch.full((1, 3, 8, 8), 0.5))[0]


def test_oversize_content_length_is_refused_before_the_body_is_read():
    with serving(Limits(max_request_bytes=10_000)) as httpd:
        for length in (10_001, 8 << 30):  # nothing of the body is sent: the answer must not wait for it
            start = time.monotonic()
            status, body = _send(httpd, b"", length=length)
            assert status == 413 and f"{length} bytes" in body["error"] and "at most 10000" in body["error"]
            assert time.monotonic() - start < 2
        for length in ("²", "9" * 5000, "-1", ""):  # not a length: 411, not a traceback and a dropped connection
            head = f"POST /score HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            with _connect(httpd) as sock:
                sock.sendall(head.encode())
                assert _response(sock)[0] == 411
        # curl's Expect: 100-continue: refused at once, without inviting the body first.
        status, body = _send(httpd, b"", length=20_000, extra="Expect: 100-continue\r\n")
        assert status == 413


def test_decompression_bombs_are_refused_from_the_png_header():
    bomb = _png(9000, 9000)
    assert len(bomb) < 100_000  # 243 MB of RGB once decoded
    with serving(Limits(max_side=2048)) as httpd:
        start = time.monotonic()
        status, body = _send(httpd, _payload([_b64(bomb)] * 16))
        assert status == 400 and "images[0] is 9000x9000" in body["error"] and "2048" in body["error"]
        assert time.monotonic() - start < 3  # decoding 16 of them would take seconds and gigabytes
    # The per-request pixel budget and the image count are checked before decoding as well.
    with serving(Limits(max_pixels=100_000, max_images=3)) as httpd:
        status, body = _send(httpd, _payload([_b64(_png(300, 300))] * 2))
        assert status == 400 and "180000 pixels" in body["error"] and "at most 100000" in body["error"]
        status, body = _send(httpd, _payload([SMALL] * 4))
        assert status == 413 and "4 images" in body["error"] and "at most 3" in body["error"]
        status, body = _send(httpd, _payload([SMALL] * 3))
        assert status == 200 and body["scores"] == pytest.approx([128 / 255] * 3)


@pytest.mark.parametrize("fmt", ["JPEG", "BMP", "GIF"])
def test_only_png_is_accepted(fmt):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buffer, format=fmt)
    with serving() as httpd:
        status, body = _send(httpd, _payload([_b64(buffer.getvalue())]))
    assert status == 400 and "images[0] is not a base64 PNG" in body["error"] and "signature" in body["error"]


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"]
)
def test_only_json_content_is_accepted(content_type):
    """What a browser's cross-site form can send, with a valid body: refused, not scored."""
    with serving() as httpd:
        status, body = _send(httpd, _payload([SMALL]), content_type=content_type)
        assert status == 415 and "application/json" in body["error"]
        status, _ = _send(httpd, _payload([SMALL]), content_type="application/json; charset=utf-8")
        assert status == 200


def test_malformed_requests_get_a_json_4xx_never_500_or_a_dropped_connection():
    deep = b'{"protocol": 1, "images": [], "prompts": [], "metadata": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    nested: Any = {}
    for _ in range(40):
        nested = {"a": nested}
    cases = [
        (deep, 400, "RecursionError"),
        (_payload([SMALL], metadata=[nested]), 400, "deeper than 32"),
        (_payload([SMALL], metadata="x"), 400, "'metadata' must be a list"),
        (_payload([SMALL], metadata=[1]), 400, "'metadata' must be a list"),
        (_payload([SMALL], metadata=[{}, {}]), 400, "1 images, 1 prompts and 2 metadata"),
        (_payload([SMALL], prompts=[3]), 400, "'prompts' must be a list of strings"),
        (_payload([SMALL], images=[7]), 400, "'images' must be a list"),
        (b"[1, 2]", 400, "JSON object"),
        (b"\xff\xfe{", 400, "must be JSON"),
    ]
    with serving(Limits(max_request_bytes=1 << 20)) as httpd:
        for raw, status, words in cases:
            got, body = _send(httpd, raw)
            assert (got, words in body["error"]) == (status, True), (raw[:80], body)
        # The standard library's own errors (a garbage request line, an unknown method) are JSON with a status line.
        for line in (
            b"garbage garbage garbage\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\r\n\r\n",
            b"DELETE / HTTP/1.1\r\n\r\n",
        ):
            with _connect(httpd) as sock:
                sock.sendall(line)
                status, body = _response(sock)
            assert status in (400, 501) and "error" in body, line


def test_a_client_that_lies_or_trickles_is_dropped_after_the_timeout():
    with serving(Limits(timeout_s=0.5)) as httpd:
        # Content-Length larger than the body: 408 and closed once the deadline passes, not a hang.
        with _connect(httpd) as sock:
            start = time.monotonic()
            head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            sock.sendall(head.encode() + b'{"protocol": 1')
            status, body = _response(sock)
            assert status == 408 and "0.5 s" in body["error"] and time.monotonic() - start < 2
            assert sock.recv(10) == b""
        # One header byte every 0.1 s keeps each read under the timeout, but not the request: dropped all the same.
        with _connect(httpd) as sock:
            start, dropped = time.monotonic(), False
            sock.sendall(b"POST /score HTTP/1.1\r\n")
            while time.monotonic() - start < 3 and not dropped:
                try:
                    sock.sendall(b"X")
                    time.sleep(0.1)
                except OSError:
                    dropped = True
            assert dropped and time.monotonic() - start < 2


def test_idle_connections_beyond_the_bound_make_room():
    """Connections that have sent nothing hold every slot: a new one closes the oldest of them and is served (a 503
    only when every connection is past its headers: test_a_request_whose_headers_are_in_is_never_evicted)."""
    with serving(Limits(max_connections=2, timeout_s=10)) as httpd:
        idle = [_connect(httpd) for _ in range(2)]
        _until(lambda: len(httpd.slots.waiting) == 2)
        status, _ = _send(httpd, _payload([SMALL]))
        assert status == 200
        closed = [sock for sock in idle if select.select([sock], [], [], 0)[0] and sock.recv(10) == b""]
        assert len(closed) == 1  # one (the one that has waited longest) was closed to make room
        for sock in idle:
            sock.close()


def test_token_is_required_and_sent_by_the_remote_reward(monkeypatch):
    images = torch.rand(4, 3, 8, 8)
    expected = (images * 255).round().div(255).mean(dim=(1, 2, 3))
    with serving(token="s3cret-token") as httpd:
        monkeypatch.delenv("TPFLOW_REWARD_TOKEN", raising=False)
        with pytest.raises(RewardError, match="HTTP 401") as info:
            tpflow.build("reward", "remote", url=httpd.url)(images, [""] * 4, [{}] * 4)
        assert "TPFLOW_REWARD_TOKEN" in str(info.value)
        monkeypatch.setenv("MY_TOKEN", "wrong")
        with pytest.raises(RewardError, match="HTTP 401"):
            tpflow.build("reward", "remote", url=httpd.url, token_env="MY_TOKEN")(images, [""] * 4, [{}] * 4)
        monkeypatch.setenv("TPFLOW_REWARD_TOKEN", "s3cret-token")
        out = tpflow.build("reward", "remote", url=httpd.url)(images, [""] * 4, [{}] * 4)
        assert torch.allclose(out.scores, expected)
        # /health is open but shows the reward's options only to a client with the token; never the token.
        with _connect(httpd) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, health = _response(sock)
        assert status == 200 and health["token"] is True and health["reward"] == "image-stat"
        assert "options" not in health and "s3cret" not in json.dumps(health)
        status, body = _send(httpd, _payload([SMALL]), extra="Authorization: Bearer s3cret-tokeN\r\n")
        assert status == 401 and "token" in body["error"]
    with pytest.raises(UserError, match="printable ASCII"):
        make_server("image-stat", {}, "127.0.0.1", 0, token="two words")


@pytest.mark.parametrize(
    ("limits", "parts"), [(Limits(max_images=3), [3, 3, 2]), (Limits(max_pixels=5 * 64), [5, 3]), (None, [8])]
)
def test_remote_splits_a_call_to_fit_the_server_limits(limits, parts):
    images = torch.rand(8, 3, 8, 8)
    expected = (images * 255).round().div(255).mean(dim=(1, 2, 3))
    with serving(limits) as httpd:
        calls = []
        scorer = httpd.reward
        httpd.reward = lambda x, p, m: calls.append(len(x)) or scorer(x, p, m)
        out = tpflow.build("reward", "remote", url=httpd.url)(images, [""] * 8, [{}] * 8)
    assert calls == parts and torch.allclose(out.scores, expected)
    assert torch.allclose(out.details["brightness"], expected)


def test_remote_splits_by_bytes_and_refuses_what_no_request_can_carry():
    images = torch.rand(8, 3, 16, 16)  # noise: about 1 kB of base64 each
    size = len(encode_images(images[:1])[0])
    with serving(Limits(max_request_bytes=1024 + 3 * size + 200)) as httpd:
        calls = []
        scorer = httpd.reward
        httpd.reward = lambda x, p, m: calls.append(len(x)) or scorer(x, p, m)
        out = tpflow.build("reward", "remote", url=httpd.url)(images, [""] * 8, [{}] * 8)
        assert len(calls) >= 3 and sum(calls) == 8 and max(calls) <= 3 and out.scores.shape == (8,)
        with pytest.raises(RewardError, match="--max-request-mb"):
            tpflow.build("reward", "remote", url=httpd.url)(torch.rand(1, 3, 64, 64), [""], [{}])
    with serving(Limits(max_side=8)) as httpd:
        with pytest.raises(RewardError, match="at most 8 pixels per side.*16x16.*--max-side"):
            tpflow.build("reward", "remote", url=httpd.url)(images, [""] * 8, [{}] * 8)


def test_remote_refuses_a_server_that_serves_another_reward():
    with serving() as httpd:
        options = registry.validate_options("reward", "remote", {"url": httpd.url, "reward": "geneval"})
        with pytest.raises(UserError, match="serves reward 'image-stat', but the recipe expects 'geneval'"):
            registry.preflight("reward", "remote", options)
        with pytest.raises(RewardError, match="tpflow serve-reward --reward geneval"):
            tpflow.build("reward", "remote", url=httpd.url, reward="geneval")(torch.rand(1, 3, 8, 8), [""], [{}])
        registry.preflight("reward", "remote", options.model_copy(update={"reward": "image-stat"}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_validate_and_train_stop_at_an_unreachable_reward_server(tmp_path, capsys):
    from tpflow.cli import main

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    text = (ROOT / "recipes" / "tiny_smoke.toml").read_text()
    text = text.replace('name = "image-stat"\nstatistic = "brightness"', f'name = "remote"\nurl = "{url}"')
    path = tmp_path / "remote.toml"
    path.write_text(text)
    load_recipe(path)  # parsing a recipe contacts nothing (export and inspect re-validate stored recipes)
    for argv in (["validate", str(path)], ["train", str(path), "--run-dir", str(tmp_path / "run")]):
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2 and time.monotonic() - start < 10, err
        assert f"{url} is not reachable" in err and f"tpflow serve-reward --reward NAME --port {port}" in err
        assert not (tmp_path / "run").exists()  # stopped before the run started
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(path), "--offline"])
    assert exit_info.value.code == 0
    # A weighted reward checks its remote parts too.
    weighted = {"rewards": [{"name": "image-stat"}, {"name": "remote", "options": {"url": url, "reward": "ocr"}}]}
    with pytest.raises(UserError, match="--reward ocr --port"):
        registry.preflight("reward", "weighted", registry.validate_options("reward", "weighted", weighted))


def _trickler(httpd: RewardServer) -> socket.socket:
    """A slowloris connection: a request line, then (as far as the server knows) headers still to come."""
    sock = _connect(httpd)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
    return sock


def _until(condition: Callable[[], bool]) -> None:
    """Poll the server's state until ``condition`` holds (no sleep of a guessed length); fail after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the server did not reach the expected state"
        time.sleep(0.01)


def test_request_line_and_headers_have_their_own_short_deadline():
    """A connection that trickles its headers is dropped at --header-timeout-s, not held for the whole request
    deadline (30 s); once the tricklers are gone an honest request is answered."""
    with serving(Limits(max_connections=3, header_timeout_s=0.3, timeout_s=30)) as httpd:
        slow = [_trickler(httpd) for _ in range(3)]
        for sock in slow:
            sock.settimeout(10)  # far below the 30 s request deadline, far above the 0.3 s header deadline
            try:
                for _ in range(200):  # one header byte every 0.05 s: each read is quick, the headers never end
                    sock.sendall(b"X")
                    time.sleep(0.05)
                closed = sock.recv(100) == b""
            except OSError:  # reset: the server closed it while bytes were in flight
                closed = True
            assert closed
            sock.close()
        status, body = _send(httpd, _payload([SMALL]))
        assert status == 200 and body["scores"] == pytest.approx([128 / 255])
        # An honest client's headers arrive within the deadline and its body has the whole request deadline.
        with _connect(httpd) as sock:
            raw = _payload([SMALL])
            head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}"
            sock.sendall(head.encode() + b"\r\n\r\n" + raw[:10])
            time.sleep(0.6)  # twice the header deadline, mid-body
            sock.sendall(raw[10:])
            assert _response(sock)[0] == 200
    with pytest.raises(UserError, match="--header-timeout-s"):
        Limits(header_timeout_s=0)


def test_slowloris_cannot_lock_out_an_honest_client():
    """Connections still sending their headers hold every slot; an honest request is answered at once
    (the connection that has waited longest for its headers makes room), however often the attacker reconnects."""
    with serving(Limits(max_connections=4, timeout_s=30)) as httpd:
        slow = [_trickler(httpd) for _ in range(4)]

        def every_slot_held() -> bool:
            for k, sock in enumerate(slow):  # the attacker reopens what the server closed
                if select.select([sock], [], [], 0)[0]:  # readable: closed (the server never answers a trickler)
                    sock.close()
                    slow[k] = _trickler(httpd)
            return httpd.slots.connections == len(httpd.slots.waiting) == 4

        for _ in range(5):
            _until(every_slot_held)
            status, body = _send(httpd, _payload([SMALL]))
            assert status == 200 and body["scores"] == pytest.approx([128 / 255])
        for sock in slow:
            sock.close()


def _upload(httpd: RewardServer, head: str, body: bytes) -> socket.socket:
    """A connection past its headers, with its body under way. It sends ``Expect: 100-continue`` and waits for the
    server's "100 Continue": its thread has registered it and parsed its headers, so it no longer waits for them once
    nothing does (waited on after the 100, since before its thread registers it nothing waits either)."""
    sock = _connect(httpd)
    sock.sendall(head.replace("\r\n\r\n", "\r\nExpect: 100-continue\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1)  # byte by byte: the final response must stay in the socket for _response
    assert data.startswith(b"HTTP/1.1 100"), data
    _until(lambda: not httpd.slots.waiting)
    sock.sendall(body)
    return sock


def test_a_request_whose_headers_are_in_is_never_evicted():
    """Only connections still waiting for their headers make room: a slow upload in progress is not cut off."""
    raw = _payload([SMALL])
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    with serving(Limits(max_connections=2, timeout_s=30)) as httpd:
        with _upload(httpd, head, raw[:10]) as upload:  # headers in, the body under way
            assert httpd.slots.connections == 1
            with _trickler(httpd) as slow:
                _until(lambda: httpd.slots.connections == 2 and len(httpd.slots.waiting) == 1)
                assert _send(httpd, _payload([SMALL]))[0] == 200  # the trickler made room
                assert slow.recv(10) == b""
            upload.sendall(raw[10:])
            assert _response(upload)[0] == 200
        # Every connection past its headers: a further one is refused (503), none is cut off.
        _until(lambda: httpd.slots.connections == 0)
        uploads = [_upload(httpd, head, raw[:10]) for _ in range(2)]
        assert httpd.slots.connections == 2
        with _connect(httpd, timeout=3) as extra:
            status, body = _response(extra)
            assert status == 503 and "2 requests are in progress (--max-connections)" in body["error"]
        for sock in uploads:
            sock.sendall(raw[10:])
            assert _response(sock)[0] == 200
            sock.close()


def test_health_is_answered_at_once_while_tricklers_hold_every_slot(monkeypatch):
    """The accept loop never waits for a slot: with every slot held by a connection still sending its headers,
    /health closes one of them and is answered at once, even when the closed connection's thread runs late (under
    load): its slot is /health's there and then, not once that thread has ended."""
    from tpflow.serving import server

    finish = server._Handler.finish

    def late_finish(self) -> None:  # a closed connection's thread that takes 1.5 s to end
        if self._input.evicted:
            time.sleep(1.5)
        finish(self)

    monkeypatch.setattr(server._Handler, "finish", late_finish)
    with serving(Limits(max_connections=2, timeout_s=10)) as httpd:
        slow = [_trickler(httpd) for _ in range(2)]
        _until(lambda: httpd.slots.connections == len(httpd.slots.waiting) == 2)
        with _connect(httpd) as sock:
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, health = _response(sock)
            assert status == 200 and health["reward"] == "image-stat" and time.monotonic() - start < 1.0
        for sock in slow:
            sock.close()
