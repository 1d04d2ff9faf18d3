"""The ``remote`` reward against a real ``tpflow serve-reward`` subprocess, and against stub servers for failures.

The subprocess serves ``shapes-geneval`` (strict score, so the --set option is exercised) on a free port and is
started once for the module; the last test that uses it stops it with Ctrl-C (SIGINT), so keep that test after
every other one that uses it.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tpflow
from tpflow.errors import RewardError, UserError
from tpflow.rewards.shapes_geneval import ShapesGenevalOptions, ShapesGenevalReward
from tpflow.serving.client import decode_images, encode_images
from tpflow.serving.lifecycle import make_server
from tpflow.shapes.prompts import prompts as shape_prompts
from tpflow.shapes.render import render_batch
from tpflow.types import RewardOutput

from .conftest import SESSION_ENV


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    lines: queue.Queue[str]
    reader: threading.Thread


# The server runs as a terminal would run it: Ctrl-C raises KeyboardInterrupt. A child inherits an ignored SIGINT
# (bash ignores it in every command started with `&` when job control is off, as in CI scripts), and Python then
# keeps it ignored: that, not the server, is why the Ctrl-C test once timed out in full-suite runs only.
_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('tpflow.cli', run_name='__main__')"
)


def _spawn(*args: str) -> Served:
    """``tpflow serve-reward ARGS --port 0`` in a subprocess; returns once it has printed its URL."""
    process = subprocess.Popen(
        [sys.executable, "-c", _TERMINAL, "serve-reward", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**SESSION_ENV, "COLUMNS": "200"},  # not what libraries wrote into this process's environment
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)
    reader.start()
    url, seen, deadline = "", [], time.monotonic() + 90
    while not url and time.monotonic() < deadline and process.poll() is None:
        try:
            seen.append(lines.get(timeout=0.5))
        except queue.Empty:
            continue
        url = next((word for word in seen[-1].split() if word.startswith("http://")), "")
    if not url:
        process.kill()
        pytest.fail(f"serve-reward did not print its URL: {''.join(seen)}")
    return Served(process, url, lines, reader)


def _stopped(served: Served, sig: int) -> str:
    """Send ``sig``; the server must exit 0 within 20 s. Returns everything it printed after its URL."""
    served.process.send_signal(sig)
    assert served.process.wait(timeout=20) == 0
    served.reader.join(timeout=5)
    output = ""
    while not served.lines.empty():
        output += served.lines.get()
    return output


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = _spawn("--reward", "shapes-geneval", "--set", "score=strict")
    yield served
    if served.process.poll() is None:
        served.process.kill()
        served.process.wait(timeout=10)


def _batch(n: int = 12) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """Rendered shapes images [n, 3, 32, 32] on the 8-bit grid; the second half is paired with wrong metadata."""
    items = shape_prompts("test", n, seed=3)
    images = render_batch([item.metadata for item in items], np.random.default_rng(0))
    images = (images * 255).round() / 255  # what PNG carries exactly
    order = list(range(n // 2)) + [n // 2 + (k + 1) % (n - n // 2) for k in range(n - n // 2)]
    return images, [items[k].prompt for k in order], [items[k].metadata for k in order]


def test_remote_is_a_built_in_reward_of_the_serving_package():
    """The client lives in tpflow/serving/, beside its server, not among the reward models; the registry still loads
    it with the built-in rewards (``_BUILTIN_MODULES``), so a recipe naming ``remote`` needs no import of its own."""
    import tpflow.rewards
    from tpflow import registry

    assert not hasattr(tpflow.rewards, "remote")  # the reward models' package neither holds nor imports it
    entry = registry.get("reward", "remote")
    assert entry.source == "tpflow" and entry.origin.split(":")[0].endswith("tpflow/serving/client.py")


def test_remote_scores_equal_in_process_scores(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health == {
        "tpflow": tpflow.__version__,
        "protocol": 1,
        "reward": "shapes-geneval",
        "options": {"score": "strict", "strict_count": True},
        "token": False,
        "limits": {"max_request_bytes": 64 << 20, "max_images": 256, "max_side": 2048, "max_pixels": 64_000_000},
    }
    images, prompts, metadata = _batch()
    local = ShapesGenevalReward(ShapesGenevalOptions(score="strict"))(images, prompts, metadata)
    # The batch must tell the options apart and hold both verdicts, or equality would prove little.
    assert set(local.scores.tolist()) == {0.0, 1.0}
    assert not torch.equal(local.details["partial"], local.details["strict"])
    remote = tpflow.build("reward", "remote", url=server.url + "/", timeout_s=30)
    out = remote(images, prompts, metadata)
    assert out.scores.dtype == torch.float32 and torch.equal(out.scores, local.scores)
    assert out.details.keys() == local.details.keys()
    assert all(torch.equal(out.details[k], local.details[k]) for k in local.details)
    # Off-grid pixels are quantised with round(x·255) on the way, exactly as in-process rewards quantise.
    noisy = (images + 0.001 * torch.randn_like(images)).clamp(0, 1)
    assert torch.equal(decode_images(encode_images(noisy)), (noisy * 255).round() / 255)


def test_a_reward_that_reads_the_floats_scores_the_same_remotely_with_quantised_images():
    """image-stat (brightness) does not round to 8-bit itself: remote (PNG) and in-process scores differed by up to
    6e-5. With train.quantise_reward_images the in-process call gets the 8-bit images too, and they are equal."""
    from tpflow.recipe import load_recipe
    from tpflow.scoring.call import RewardPolicy, call_reward, recipe_policy

    httpd = make_server("image-stat", {"statistic": "brightness"}, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # off the 8-bit grid
        prompts, metadata = [""] * 6, [{}] * 6
        remote = call_reward(tpflow.build("reward", "remote", url=httpd.url), images, prompts, metadata)
        local = tpflow.build("reward", "image-stat", statistic="brightness")
        floats = call_reward(local, images, prompts, metadata)
        assert not torch.equal(floats.scores, remote.scores)  # the difference the docs describe
        recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "shapes_tp.toml",
                             ["train.quantise_reward_images=true"])  # fmt: skip
        policy = recipe_policy(recipe.train)
        assert policy == RewardPolicy(quantise=True)
        quantised = call_reward(local, images, prompts, metadata, policy)
        assert torch.equal(quantised.scores, remote.scores)
        assert all(torch.equal(quantised.details[k], remote.details[k]) for k in remote.details)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_concurrent_calls_are_each_answered_with_their_own_scores(server):
    images, prompts, metadata = _batch()
    local = ShapesGenevalReward(ShapesGenevalOptions(score="strict"))(images, prompts, metadata)
    remote = tpflow.build("reward", "remote", url=server.url)
    parts = [slice(0, 3), slice(3, 7), slice(7, 12), slice(2, 10)]
    results: dict[int, torch.Tensor] = {}

    def call(k: int) -> None:
        s = parts[k]
        results[k] = remote(images[s], prompts[s], metadata[s]).scores

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(results[k], local.scores[s]) for k, s in enumerate(parts))


class _Overlap:
    """A reward that records how many calls run at once (and returns each image's mean)."""

    def __init__(self) -> None:
        self.running = self.most = 0
        self.guard = threading.Lock()

    def __call__(self, images, prompts, metadata):
        with self.guard:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.05)
        with self.guard:
            self.running -= 1
        return RewardOutput(scores=images.mean(dim=(1, 2, 3)))


def test_server_scores_one_request_at_a_time():
    httpd = make_server("shapes-geneval", {}, "127.0.0.1", 0)
    httpd.reward = overlap = _Overlap()  # the server's own model, replaced by a probe
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        remote = tpflow.build("reward", "remote", url=httpd.url)
        images = torch.arange(6, dtype=torch.float32).div(255).view(6, 1, 1, 1).expand(6, 3, 4, 4)
        results: dict[int, torch.Tensor] = {}
        threads = [
            threading.Thread(target=lambda k=k: results.__setitem__(k, remote(images[k : k + 1], [""], [{}]).scores))
            for k in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert overlap.most == 1
    assert torch.equal(torch.cat([results[k] for k in range(6)]), torch.arange(6, dtype=torch.float32) / 255)


def _post(url: str, payload: Any) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url + "/score", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_answers_bad_requests_with_a_json_error(server):
    images, prompts, metadata = _batch(2)
    status, body = _post(server.url, {"protocol": 7, "images": encode_images(images), "prompts": prompts})
    assert status == 400 and "protocol 7" in body["error"] and "protocol 1" in body["error"]
    status, body = _post(server.url, {"protocol": 1, "images": ["not png"], "prompts": ["a"], "metadata": [{}]})
    assert status == 400 and "images[0]" in body["error"]
    status, body = _post(server.url, {"protocol": 1, "images": encode_images(images), "prompts": prompts[:1]})
    assert status == 400 and "2 images, 1 prompts" in body["error"]
    # The reward itself rejects this metadata (a TypeError inside it): 422, not retried, the message for the user.
    bad = {"protocol": 1, "images": encode_images(images), "prompts": prompts, "metadata": [{"include": "x"}] * 2}
    status, body = _post(server.url, bad)
    assert status == 422 and "'shapes-geneval' cannot score this request (TypeError" in body["error"]


def test_serve_reward_user_errors(server, capsys):
    from tpflow.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve-reward", "--reward", "shapes-genevall"])
    assert exit_info.value.code == 2 and "Did you mean 'shapes-geneval'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-reward", "--reward", "shapes-geneval", "--set", "scor=strict"])
    assert exit_info.value.code == 2 and "'scor'" in capsys.readouterr().err
    # What train checks before anything loads, serve-reward checks before it listens: every problem, one paragraph.
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-reward", "--reward", "pickscore", "--set", "model=/nonexistent/ps", "--set", "device=cuda:7"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Cannot serve reward 'pickscore' on this machine" in err
    assert "/nonexistent/ps" in err and "cuda:7" in err and "Traceback" not in err
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(UserError, match=f"Cannot listen on 127.0.0.1:{port}"):
        make_server("shapes-geneval", {}, "127.0.0.1", port)
    with pytest.raises(UserError, match="url"):
        tpflow.build("reward", "remote")
    with pytest.raises(UserError, match="http://"):
        tpflow.build("reward", "remote", url="ftp://example.org")


def test_serve_reward_says_where_its_weights_come_from():
    """The server lists the weights it read, as train does (the CLI prints them above the URL)."""
    httpd = make_server("shapes-clip", {}, "127.0.0.1", 0)
    try:
        assert [source.what for source in httpd.weights] == ["reward 'shapes-clip' weights (option weights)"]
        assert httpd.weights[0].where.startswith("shipped file ")
    finally:
        httpd.server_close()


@dataclass
class Stub:
    """What a stub server answers: /health payload, /score status and body, or a /score that never answers."""

    health: dict[str, Any] = field(default_factory=lambda: {"tpflow": "0.1.0", "protocol": 1, "reward": "stub"})
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False
    scored: int = 0  # /score requests received
    release: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    state = Stub()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self._send(200, state.health)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            state.scored += 1
            if state.hang:
                state.release.wait(10)
                return
            self._send(state.status, state.body)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            for key, value in {**state.headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    state.release.set()
    httpd.shutdown()
    httpd.server_close()


def _one_image() -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    return torch.zeros(1, 3, 8, 8), ["a photo of a red circle"], [{}]


def test_protocol_mismatch_is_refused_naming_both_versions(stub):
    state, url = stub
    state.health = {"tpflow": "9.0.0", "protocol": 2, "reward": "stub"}
    remote = tpflow.build("reward", "remote", url=url, retries=0)
    with pytest.raises(RewardError, match="protocol 2") as info:
        remote(*_one_image())
    assert url in str(info.value) and "protocol 1" in str(info.value) and "9.0.0" in str(info.value)
    assert state.scored == 0  # refused before any image was sent
    state.health = {"status": "ok"}
    with pytest.raises(RewardError, match="tpflow serve-reward"):
        tpflow.build("reward", "remote", url=url)(*_one_image())


def test_server_errors_are_retried_then_reported_with_url_and_attempts(stub):
    state, url = stub
    state.status, state.body = 500, {"error": "reward 'x' raised RuntimeError: CUDA out of memory"}
    remote = tpflow.build("reward", "remote", url=url, retries=2, backoff_s=0.01)
    with pytest.raises(RewardError, match="CUDA out of memory") as info:
        remote(*_one_image())
    assert f"{url}/score" in str(info.value) and "3 attempts" in str(info.value) and state.scored == 3


def test_a_server_out_of_memory_is_not_retried_and_reaches_the_trainers_paragraph(stub):
    """The server's OOM was an HTTP 500, retried with the same images; now a 507 the client turns into the error a
    local reward's OOM raises, so the trainer names train.score_batch."""
    from tpflow.scoring.call import RewardOutOfMemoryError

    state, url = stub
    state.status, state.body = 507, {"error": "reward 'x' ran out of GPU memory on the server (CUDA out of memory)"}
    with pytest.raises(RewardOutOfMemoryError, match="ran out of GPU memory") as info:
        tpflow.build("reward", "remote", url=url, retries=3, backoff_s=0.01)(*_one_image())
    assert isinstance(info.value, torch.cuda.OutOfMemoryError) and isinstance(info.value, RewardError)
    assert "not retried" in str(info.value) and state.scored == 1


class _OutOfMemory:
    def __call__(self, images, prompts, metadata):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_server_answers_its_rewards_out_of_memory_with_507():
    httpd = make_server("shapes-geneval", {}, "127.0.0.1", 0)
    httpd.reward = _OutOfMemory()
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        images = encode_images(torch.zeros(1, 3, 4, 4))
        status, reply = _post(httpd.url, {"protocol": 1, "images": images, "prompts": [""], "metadata": [{}]})
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert status == 507, reply
    assert "ran out of GPU memory on the server" in reply["error"] and "Tried to allocate" in reply["error"]


@pytest.mark.parametrize(
    ("status", "body", "headers", "expected"),
    [
        (422, {"error": "weights not found: pass weights=PATH"}, {}, "weights not found"),
        (302, {}, {"Location": "http://example.org/score"}, "redirect to http://example.org/score; redirects are"),
    ],
)
def test_client_errors_and_redirects_are_not_retried(stub, status, body, headers, expected):
    state, url = stub
    state.status, state.body, state.headers = status, body, headers
    with pytest.raises(RewardError, match=expected) as info:
        tpflow.build("reward", "remote", url=url, retries=3, backoff_s=0.01)(*_one_image())
    assert url in str(info.value) and f"HTTP {status}" in str(info.value) and state.scored == 1


def test_a_server_that_never_answers_times_out(stub):
    state, url = stub
    state.hang = True
    remote = tpflow.build("reward", "remote", url=url, timeout_s=0.3, retries=1, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RewardError, match="2 attempts") as info:
        remote(*_one_image())
    assert time.monotonic() - start < 5 and "timed out" in str(info.value) and state.scored == 2


def test_ctrl_c_stops_the_server_and_the_client_fails_fast(server):
    """Keep last: stops the module's server."""
    checked = tpflow.build("reward", "remote", url=server.url, timeout_s=2, retries=2, backoff_s=0.1)
    images, prompts, metadata = _batch(2)
    checked(images, prompts, metadata)  # health checked while the server runs
    output = _stopped(server, signal.SIGINT)
    assert output.rstrip().endswith("stopped.") and "KeyboardInterrupt" not in output
    for remote in (checked, tpflow.build("reward", "remote", url=server.url, timeout_s=2, retries=2, backoff_s=0.1)):
        start = time.monotonic()
        with pytest.raises(RewardError) as info:
            remote(images, prompts, metadata)
        assert time.monotonic() - start < 10
        assert server.url in str(info.value) and "3 attempts" in str(info.value)


def test_sigterm_stops_the_server_cleanly():
    """What a service manager (systemd, docker stop) sends: the same clean stop as Ctrl-C, exit status 0."""
    output = _stopped(_spawn("--reward", "image-stat"), signal.SIGTERM)
    assert output.rstrip().endswith("stopped.") and "Traceback" not in output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_that_lands_while_the_url_is_printed_lets_the_printing_finish(sig):
    """The CI flake this pins: a stop that arrived between the URL line and the next one raised KeyboardInterrupt
    inside rich's print, left its buffer open, and "stopped." was never written. The signal is sent from inside
    ``announce`` itself, so the timing is not left to chance; the stop must wait for ``announce`` to return."""
    previous = signal.getsignal(sig)
    if previous is signal.SIG_IGN:  # e.g. SIGINT in a job started with & without job control: serve keeps it ignored
        pytest.skip(f"{sig.name} is ignored in this process, so serve leaves it ignored and no stop can arrive")
    printed: list[str] = []
    servers: list = []

    def announce(server) -> None:
        servers.append(server)
        printed.append(server.url)
        signal.raise_signal(sig)  # the handler runs here, in the middle of announcing
        time.sleep(0.05)  # bytecode after the handler: where a KeyboardInterrupt would have landed
        printed.append("recipe line")

    from tpflow.serving.lifecycle import serve

    done, fired = threading.Event(), threading.Event()

    def stop_after_all() -> None:  # a stop that never took: end the loop from here (not by a signal) and fail
        if not done.is_set() and servers:
            fired.set()
            servers[0].shutdown()

    watchdog = threading.Timer(30, stop_after_all)
    watchdog.start()
    try:
        serve("image-stat", {}, port=0, announce=announce)
    finally:
        done.set()
        watchdog.cancel()
    assert not fired.is_set(), f"{sig.name} did not stop the server: the watchdog did, after 30 s"
    assert printed[-1] == "recipe line" and printed[0].startswith("http://")
    assert signal.getsignal(sig) is previous  # the handlers are put back
