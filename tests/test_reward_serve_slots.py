"""Connection slots of ``tpflow serve-reward`` (``tpflow.serving.slots``) on socket pairs, without a server: which
connection makes room for a new one is decided here, and must never be an honest client whose thread runs late."""

from __future__ import annotations

import socket
import threading
import time

from tpflow.serving.slots import DeadlineReader, Slots


def test_a_connection_whose_headers_arrived_unparsed_is_not_evicted():
    """Under load a connection's thread may run late: its headers have arrived (in the kernel's buffer, or read but
    not yet parsed) while it is still registered as waiting. It is an honest client, not a slowloris: a new
    connection closes the trickler instead, and when only such connections wait, the new one is refused (503)."""
    slots = Slots(3)
    pairs = [socket.socketpair() for _ in range(3)]
    readers = [DeadlineReader(server_end, timeout_s=10) for server_end, _ in pairs]
    for reader in readers:  # oldest first: registered in this order
        assert slots.take()
        slots.await_headers(reader)
        time.sleep(0.01)
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    pairs[0][1].sendall(head)  # the oldest: every header byte in the kernel's buffer, none read
    split = head.index(b"\r\n\r\n") + 2  # the blank line straddles what its thread read and what is still to come
    pairs[1][1].sendall(head[:split])
    assert readers[1].readinto(bytearray(8192)) == split and not readers[1].headers_arrived()
    pairs[1][1].sendall(head[split:])
    assert readers[1].headers_arrived()  # from the bytes read and the bytes in the kernel's buffer
    assert readers[1].readinto(bytearray(8192)) == len(head) - split and readers[1].headers_arrived()  # all read
    pairs[2][1].sendall(head[:32])  # the youngest: still trickling its headers

    def trickler_thread() -> None:  # what the handler does: read until closed, then give the slot back
        try:
            while readers[2].readinto(bytearray(8192)):
                pass
        except ConnectionAbortedError:
            pass
        finally:
            slots.release(readers[2].sock)

    thread = threading.Thread(target=trickler_thread, daemon=True)
    thread.start()
    assert slots.take()  # room made by closing the trickler, though the other two have waited longer
    thread.join(timeout=5)
    assert readers[2].evicted and not readers[0].evicted and not readers[1].evicted
    assert pairs[0][0].recv(len(head), socket.MSG_PEEK) == head  # looking consumed nothing
    assert not slots.take()  # only connections whose headers arrived wait: refused, none closed
    assert not readers[0].evicted and not readers[1].evicted
    for pair in pairs:
        for sock in pair:
            sock.close()


def test_take_never_waits_and_hands_the_closed_connections_slot_to_the_new_one():
    """``take`` runs in the accept loop, which also accepts /health: it returns at once. When the connection closed
    to make room has a thread that runs late (it has not ended, so has given nothing back), the new connection gets
    that slot all the same; at most ``n`` closed connections may be still ending, beyond which a new one is refused at
    once, and none is closed."""
    slots = Slots(1)
    a, a_client = socket.socketpair()
    c, c_client = socket.socketpair()
    reader_a, reader_c = DeadlineReader(a, timeout_s=10), DeadlineReader(c, timeout_s=10)
    assert slots.take()
    slots.await_headers(reader_a)  # A: a trickler; its thread never gets to run before the end of this test
    start = time.monotonic()
    assert slots.take()  # C: A is closed and its slot is C's, without waiting for A's thread
    assert time.monotonic() - start < 0.2 and reader_a.evicted and a_client.recv(10) == b""
    slots.await_headers(reader_c)
    start = time.monotonic()
    assert not slots.take()  # A's thread is still ending: refused at once, C kept
    assert time.monotonic() - start < 0.2 and not reader_c.evicted
    slots.release(a)  # A's thread ends: it had no slot to give back
    assert slots.connections == 1
    assert slots.take() and reader_c.evicted  # D: C made room
    slots.release(c)
    assert slots.connections == 1
    slots.release(socket.socket())  # D ends (it never registered)
    assert slots.connections == 0 and slots.take() and slots.connections == 1
    for sock in (a, a_client, c, c_client):
        sock.close()
