"""Peak memory and threads of ``tpflow serve-reward`` under hostile clients: decompression bombs, slowloris, a huge
Content-Length, a connection flood; an honest request must be answered during the slowloris and after it all.

    .venv/bin/python benchmarks/serve_hostile.py [--rounds 5] [--flood 300] [--json docs/results/serve_hostile.json]

The server runs as its own process (``python -m tpflow.cli serve-reward --reward image-stat``); its peak resident set
(VmHWM) and thread count are read from /proc after each attack (Linux). Before the server was hardened against such
clients, 16 bombs of 9000x9000 in one request drove it to 12 GB and the kernel killed it.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path


def png_bomb(side: int) -> bytes:
    """A valid 1-bit grey PNG of zeros: tens of kB that decode to side x side x 3 bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"\0" * (side * (1 + (side + 7) // 8))
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def small_png() -> bytes:
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def request(port: int, body: bytes, length: int | None = None, timeout: float = 30) -> int:
    """POST /score; the HTTP status (0 when the connection was closed without one)."""
    head = (
        f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(head + body)
        except OSError:
            pass  # refused before the body was read: the status is still there
        data = b""
        try:
            while b"\r\n" not in data:
                part = sock.recv(4096)
                if not part:
                    break
                data += part
        except OSError:
            return 0
    match = re.match(rb"HTTP/1\.[01] (\d+)", data)
    return int(match.group(1)) if match else 0


def payload(images: list[bytes]) -> bytes:
    encoded = [base64.b64encode(i).decode() for i in images]
    return json.dumps(
        {"protocol": 1, "images": encoded, "prompts": ["a"] * len(encoded), "metadata": [{}] * len(encoded)}
    ).encode()


def status_of(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads of a process."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+)", text, re.M).group(1)) for key in ("VmRSS", "VmHWM", "Threads")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="Bomb requests (16 bombs of 9000x9000 each).")
    parser.add_argument("--flood", type=int, default=300, help="Idle connections opened at once.")
    parser.add_argument(
        "--slowloris",
        type=int,
        default=50,
        help="Connections trickling a header byte a second, reopened when dropped.",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="The server's per-request deadline (--timeout-s).")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    server = subprocess.Popen(
        [sys.executable, "-m", "tpflow.cli", "serve-reward", "--reward", "image-stat", "--port", "0",
         "--timeout-s", str(args.timeout)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        port = int(re.search(r":(\d+)", line.split(" at ", 1)[1]).group(1))
        results: dict[str, object] = {"start": status_of(server.pid)}
        honest = payload([small_png()] * 8)
        results["honest_before"] = request(port, honest)

        bomb_body = payload([png_bomb(9000)] * 16)
        statuses = [request(port, bomb_body) for _ in range(args.rounds)]
        results["bombs"] = {"request_kB": len(bomb_body) // 1024, "statuses": statuses, **status_of(server.pid)}

        results["content_length_8GB"] = {"status": request(port, b"", length=8 << 30), **status_of(server.pid)}

        # Slowloris by an attacker that reopens every connection the server drops, while an honest client sends
        # one request a second: before connections still sending headers could be dropped to make room, the trickling
        # connections held every slot and each honest request got 503.
        def trickler() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /score HTTP/1.1\r\n")
            sock.setblocking(False)
            return sock

        def dropped(sock: socket.socket) -> bool:
            """The server closed it (EOF), reset it, or answered it (a 503): a hostile client never reads on."""
            try:
                sock.recv(1)  # EOF or the start of a response
            except BlockingIOError:
                return False  # open, still waiting for the rest of the headers
            except OSError:
                pass
            return True

        slow = [trickler() for _ in range(args.slowloris)]
        start, drops, honest_statuses = time.monotonic(), 0, []
        for _second in range(int(args.timeout) + 3):
            time.sleep(1)
            for k, sock in enumerate(slow):
                try:
                    if not dropped(sock):
                        sock.send(b"X")
                        continue
                except OSError:
                    pass
                drops += 1
                sock.close()
                slow[k] = trickler()
            try:
                honest_statuses.append(request(port, honest, timeout=5))
            except OSError:
                honest_statuses.append(0)
        during = status_of(server.pid)
        results["slowloris"] = {
            "connections": args.slowloris, "dropped_by_server": drops, "seconds": round(time.monotonic() - start, 1),
            "honest_statuses": honest_statuses, **during,
        }  # fmt: skip
        for sock in slow:
            sock.close()

        flood = []
        for _ in range(args.flood):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1)
        results["flood"] = {"opened": len(flood), **status_of(server.pid)}
        for sock in flood:
            sock.close()

        deadline, status = time.monotonic() + args.timeout + 10, 0
        while status != 200 and time.monotonic() < deadline:  # slots free as their deadlines pass
            try:
                status = request(port, honest, timeout=5)
            except OSError:
                status = 0
            if status != 200:
                time.sleep(0.2)
        results["honest_after"] = status
        results["end"] = status_of(server.pid)
        results["alive"] = server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
