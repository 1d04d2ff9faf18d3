"""Connection slots of ``tpflow serve-reward`` (``tpflow.serving.server``): at most N connections at once, and
room made for a new one by closing the connection that has waited longest for its request line and headers.

Why: with a fixed number of slots, a slowloris client that opens N connections and trickles their
headers, reopening each one the server drops, would hold every slot for ever and every honest client would get 503.
Here a new connection closes the oldest of the connections still waiting for their headers instead: an honest
client sends its headers at once, so it is past them a moment after it connects, while a slowloris connection is
always still waiting and always the one closed. To close a new honest connection an attacker must open N
connections within that moment, a flood no slot policy absorbs. A connection past its headers (its body being read,
its request scored) is never closed; when every slot holds one, a new connection is refused (the server's 503).

None of this waits: ``Slots.take`` runs in the accept loop, which accepts /health too. The slot of a connection
closed to make room passes to the new connection there and then, rather than being awaited from the closed one's
thread (a wait of up to 1 s per accept stalled every connection behind it, /health included, and still refused the
new one when that thread ran late).

"Past its headers" is what has arrived, not what its thread has parsed: under load a connection's thread may run
late, and a connection whose blank line ending the headers is already in the kernel's buffer, or already read by its
thread, is an honest client whose request is about to be parsed, never the one closed. The kernel's buffer is
peeked at (``MSG_PEEK | MSG_DONTWAIT``: nothing consumed, no wait); a slowloris never has that blank line in it.
"""

from __future__ import annotations

import io
import os
import re
import socket
import threading
import time
from typing import Any

END_OF_HEADERS = re.compile(rb"\n\r?\n")  # the blank line after the headers (http.server also takes bare LF)
PEEK_BYTES = 65536  # a header block longer than this (no real client's) is judged from its first 64 KiB


class DeadlineReader(io.RawIOBase):
    """The connection's input with a deadline: a client that trickles bytes, or promises more than it sends, gets
    TimeoutError when the deadline passes, whatever the pace of its bytes. The handler moves the deadline: the
    header deadline while the request line and headers arrive, then the request deadline for the body."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock, self.timeout_s, self.deadline = sock, timeout_s, time.monotonic() + timeout_s
        self.evicted = False  # closed by the server to make room (Slots.take)
        self.watching = False  # waiting for headers (Slots.await_headers): look for the blank line that ends them
        self.headers_read = False  # that blank line has been read from the socket (its thread parses it next)
        self._tail = b""  # the last bytes read while watching: a blank line may straddle two reads

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.timeout_s:g} s")
        self.sock.settimeout(left)
        got = self.sock.recv_into(buffer)
        if self.evicted:  # its socket was shut down: end the connection quietly, not as a truncated request
            raise ConnectionAbortedError("closed to make room for a new connection")
        if self.watching and got:
            seen = self._tail + bytes(buffer[:got])
            self.headers_read = self.headers_read or END_OF_HEADERS.search(seen) is not None
            self._tail = seen[-2:]
        return got

    def watch(self, on: bool) -> None:
        """Start (a request's line and headers are awaited) or stop looking for the end of the headers."""
        self.watching, self.headers_read, self._tail = on, False, b""

    def headers_arrived(self) -> bool:
        """Whether the blank line ending the headers has arrived: read by the connection's thread, or waiting in the
        kernel's buffer (peeked at without consuming or waiting). Safe from another thread."""
        return self.headers_read or END_OF_HEADERS.search(self._tail + self._pending()) is not None

    def _pending(self) -> bytes:
        """The bytes the kernel holds for this connection, unread; b"" where they cannot be peeked at. Through a
        duplicate descriptor: a peek through ``self.sock`` would wait up to its timeout, which its thread sets."""
        flags = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
        if flags == socket.MSG_PEEK:  # no MSG_DONTWAIT (Windows): judged from what its thread read
            return b""
        try:
            with socket.socket(fileno=os.dup(self.sock.fileno())) as view:
                if view.gettimeout() is not None:  # socket.setdefaulttimeout was called: Python would poll first
                    view.settimeout(0.0)  # the descriptor is non-blocking already (init did it for that timeout)
                return view.recv(PEEK_BYTES, flags)
        except OSError:  # BlockingIOError: nothing pending; or the connection is already closed
            return b""


class Slots:
    """``n`` connection slots; the connections waiting for their headers are registered, and can be closed.

    ``take`` runs in the server's accept loop, which also accepts /health: it never waits. A slot is free at once,
    or the connection that has waited longest for its headers is closed and its slot passes to the new connection
    there and then (its thread, seeing the closed socket, ends without giving a slot back), or the new connection is
    refused. Closed connections whose threads have not ended yet are bounded too (at most ``n``), so the server never
    runs more than 2n connection threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Lock()  # guards the three fields below
        self.connections = 0  # connections holding a slot
        self.waiting: dict[DeadlineReader, float] = {}  # connections waiting for their headers -> since when
        self.closing: set[socket.socket] = set()  # closed to make room, their threads not yet ended: no slot

    def take(self) -> bool:
        """A slot for a new connection, at once: a free one, or the one of the connection that has waited longest for
        headers that have not arrived, closed to make room. False when every connection is past its headers (or
        ``n`` closed ones have not ended yet)."""
        with self.lock:
            if self.connections < self.n:
                self.connections += 1
                return True
            oldest_first = sorted(self.waiting, key=self.waiting.__getitem__)
            reader = next((r for r in oldest_first if not r.headers_arrived()), None)
            if reader is None or len(self.closing) >= self.n:
                return False
            del self.waiting[reader]
            reader.evicted = True
            self.closing.add(reader.sock)  # its slot is the new connection's now
        try:
            reader.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def release(self, sock: socket.socket) -> None:
        """The connection of ``sock`` ended: its slot is free again, unless it was closed to make room (its slot
        went to the connection that closed it)."""
        with self.lock:
            if sock in self.closing:
                self.closing.discard(sock)
            else:
                self.connections -= 1

    def await_headers(self, reader: DeadlineReader) -> None:
        """The connection of ``reader`` waits for a request line and headers: it can be closed until ``settle``."""
        reader.watch(True)
        with self.lock:
            self.waiting[reader] = time.monotonic()

    def settle(self, reader: DeadlineReader) -> bool:
        """The headers are in or the connection ends: it can no longer be closed. False if it was already."""
        with self.lock:
            self.waiting.pop(reader, None)
            reader.watch(False)  # under the lock: take never sees it registered with what it read forgotten
            return not reader.evicted
