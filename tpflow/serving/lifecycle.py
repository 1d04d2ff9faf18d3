"""The life cycle of ``tpflow serve-reward``: its ``--set`` options parsed, the reward checked on this machine before
anything loads, the server (``tpflow.serving.server``) built and bound, then served until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tpflow.errors import UserError
from tpflow.serving.server import Limits, RewardServer


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


def make_server(
    reward_name: str,
    options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 18085,
    limits: Limits | None = None,
    token: str | None = None,
) -> RewardServer:
    """Build the reward and bind the server (port 0: any free port; see ``server.url``)."""
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise UserError("The token must be printable ASCII without spaces, e.g. the output of `openssl rand -hex 32`.")
    try:
        return RewardServer((host, port), reward_name, options, limits, token)
    except OSError as exc:
        raise UserError(f"Cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port.") from None


def serve(
    reward_name: str,
    options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 18085,
    announce: Callable[[RewardServer], None] = lambda server: print(server.url),
    limits: Limits | None = None,
    token: str | None = None,
) -> None:
    """Serve until Ctrl-C or SIGTERM (what systemd and ``docker stop`` send); ``announce`` receives the server (its
    ``url``, its ``weights``) once the socket listens. An inherited ignored SIGINT (``tpflow serve-reward &`` in a
    script) stays ignored, as a background job's should."""
    server = make_server(reward_name, options, host, port, limits, token)
    main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    # A stop asks the serve loop to end rather than raising where the signal lands: raised inside ``announce``, a
    # KeyboardInterrupt once left rich's console buffer open, and "stopped." was never written (a CI flake). Installed
    # before the URL is printed, since a stop may follow it at once; serve_forever ends at once if asked before it
    # starts. An inherited ignored SIGINT (``tpflow serve-reward &`` in a script) stays ignored.
    previous = {}
    if main:
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, lambda *_: _request_shutdown(server))
    try:
        announce(server)
        server.serve_forever()
    except KeyboardInterrupt:  # a Ctrl-C the handler above did not own (serve called off the main thread)
        pass
    finally:
        server.server_close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _request_shutdown(server: RewardServer) -> None:
    """``shutdown`` waits for the serve loop to end, so it cannot run on the thread that the signal interrupted."""
    threading.Thread(target=server.shutdown, name="tpflow-serve-stop", daemon=True).start()
