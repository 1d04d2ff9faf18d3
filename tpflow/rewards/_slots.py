"""Connection slots of ``tpflow serve-reward`` (``tpflow.rewards.serve``): at most N connections at once, and
room made for a new one by closing the connection that has waited longest for its request line and headers.

Why (issue 24): with a fixed number of slots, a slowloris client that opens N connections and trickles their
headers, reopening each one the server drops, would hold every slot for ever and every honest client would get 503.
Here a new connection closes the oldest of the connections still waiting for their headers instead: an honest
client sends its headers at once, so it is past them a moment after it connects, while a slowloris connection is
always still waiting and always the one closed. To close a new honest connection an attacker must open N
connections within that moment, a flood no slot policy absorbs. A connection past its headers (its body being read,
its request scored) is never closed; when every slot holds one, a new connection is refused (the server's 503).
"""

from __future__ import annotations

import io
import socket
import threading
import time
from typing import Any


class DeadlineReader(io.RawIOBase):
    """The connection's input with a deadline: a client that trickles bytes, or promises more than it sends, gets
    TimeoutError when the deadline passes, whatever the pace of its bytes. The handler moves the deadline: the
    header deadline while the request line and headers arrive, then the request deadline for the body."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock, self.timeout_s, self.deadline = sock, timeout_s, time.monotonic() + timeout_s
        self.evicted = False  # closed by the server to make room (Slots.take)

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
        return got


class Slots:
    """``n`` connection slots; the connections waiting for their headers are registered, and can be closed."""

    def __init__(self, n: int) -> None:
        self.free = threading.BoundedSemaphore(n)
        self.lock = threading.Lock()  # guards the three fields below
        self.connections = 0  # connections holding a slot
        self.waiting: dict[DeadlineReader, float] = {}  # connections waiting for their headers -> since when
        self.headers_in = 0  # requests whose headers arrived, ever: what a test waits on (waiting is empty both
        # before a new connection's thread registers it and after its headers are in)

    def take(self) -> bool:
        """A slot for a new connection: a free one, or the one of the connection that has waited longest for its
        headers, closed to make room (its thread sees the closed socket and ends). False when every connection is
        past its headers."""
        if not self.free.acquire(blocking=False) and not (self._evict() and self.free.acquire(timeout=1.0)):
            return False
        with self.lock:
            self.connections += 1
        return True

    def release(self) -> None:
        """The connection ended."""
        with self.lock:
            self.connections -= 1
        self.free.release()

    def await_headers(self, reader: DeadlineReader) -> None:
        """The connection of ``reader`` waits for a request line and headers: it can be closed until ``settle``."""
        with self.lock:
            self.waiting[reader] = time.monotonic()

    def settle(self, reader: DeadlineReader, headers_in: bool = False) -> bool:
        """The headers are in (``headers_in``) or the connection ends: it can no longer be closed. False if it was
        already."""
        with self.lock:
            was_waiting = self.waiting.pop(reader, None) is not None
            if headers_in and was_waiting and not reader.evicted:
                self.headers_in += 1
            return not reader.evicted

    def _evict(self) -> bool:
        with self.lock:
            if not self.waiting:
                return False
            reader = min(self.waiting, key=self.waiting.__getitem__)
            del self.waiting[reader]
            reader.evicted = True
        try:
            reader.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True
