"""Proof that a KV sender is gone, for the receiver's fence (fence.py).

UCX, with peer error handling off (ucx.py), never reports a dead sender: a message it was
half-way through receiving when the sender died never completes, and its blocks stayed fenced
until ``fence_timeout_s``. A stopped sender (SIGSTOP, a paused VM) looks the same to UCX but may
write the rest of its message later, so the receiver cannot free those blocks on a guess.

Each sending transport therefore keeps one plain TCP connection open to each receiver it sends
to (``LivenessLinks``), and says who it is on it: a random 16-byte sender id, which it also
stamps into every direct transfer's plan (``stamp_sender``). The connection is closed only when
the sending transport has closed (its UCX endpoints aborted first) or by the kernel when its
process exits, however it exits; it stays open while the process is only stopped. When the last
connection of a sender id ends (``LivenessListener``), the receiver knows that sender will never
write again, and gives up the fences its failed transfers held (after ``GONE_GRACE_S``, for data
that left the sender before it died and is still on its way).

While a sender's connection is open the receiver holds its failed transfers' fences for as long
as their receives are under way, with no timeout: a stopped sender keeps its blocks until it
resumes (its write lands in blocks nobody else has) or dies. A connection that ends without word
from the sender's kernel (keepalive timeout: power loss, a partition) is no proof, and neither is
a sender the receiver never heard from (a firewall, or a framed transfer, which names no sender):
those fall back to ``fence_timeout_s``.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from pdserve import telemetry
from pdserve.transfer.header import HEADER_NBYTES

SENDER_ID_NBYTES = 16
SENDER_OFFSET = HEADER_NBYTES - SENDER_ID_NBYTES  # in a plan's header: past every header field
NO_SENDER = bytes(SENDER_ID_NBYTES)
GONE_GRACE_S = 1.0  # after a sender's connection ends, for its data still in flight
CONNECT_TIMEOUT_S = 2.0
KEEPALIVE = (10, 5, 3)  # idle s, interval s, probes: a silent sender host is given up in ~25 s
RETRY_AFTER_S = 30.0  # a receiver whose liveness port refused: try again after this long
REMEMBER_GONE_S = 600.0  # how long a gone sender is remembered (for its failed transfers)
_ENDPOINT = struct.Struct("<HH")  # port, length of the host name that follows

log = telemetry.logger()


def new_sender_id() -> bytes:
    return os.urandom(SENDER_ID_NBYTES)


def stamp_sender(message: bytes, sender_id: bytes) -> bytes:
    """``message`` (a plan: a header first) with ``sender_id`` in its header's spare bytes."""
    return message[:SENDER_OFFSET] + sender_id + message[SENDER_OFFSET + SENDER_ID_NBYTES :]


def read_sender(raw: memoryview | bytes) -> bytes | None:
    """The sender id stamped into a received plan, None if none was."""
    sid = bytes(raw[SENDER_OFFSET : SENDER_OFFSET + SENDER_ID_NBYTES])
    return None if sid == NO_SENDER else sid


def pack_endpoint(host: str, port: int) -> bytes:
    """Where a receiver's liveness listener is, in front of its transport address."""
    name = host.encode()
    return _ENDPOINT.pack(port, len(name)) + name


def unpack_endpoint(raw: bytes) -> tuple[str, int, bytes]:
    """``(host, port, rest)``: port 0 when the receiver has no listener."""
    port, n = _ENDPOINT.unpack_from(raw)
    start = _ENDPOINT.size
    return raw[start : start + n].decode(), port, raw[start + n :]


class LivenessListener:
    """The receiver's side: accepts senders' connections on ``host`` (an ephemeral port) and
    calls ``on_gone(sender_id, proven)`` from its own thread when the last connection of a sender
    id has ended: ``proven`` when the sender's kernel closed or reset it (the process is gone),
    not when keepalive gave up on it. ``port`` is where it listens."""

    def __init__(self, host: str, on_gone: Callable[[bytes, bool], None]) -> None:
        self._on_gone = on_gone
        self._sock = socket.create_server((host, 0), backlog=64)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._ids: dict[socket.socket, bytearray] = {}  # connection -> its id, as far as read
        self._count: dict[bytes, int] = {}  # sender id -> its open connections
        self._gone: dict[bytes, tuple[float, bool]] = {}  # sender id -> (when, proven)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-liveness", daemon=True)
        self._thread.start()

    @property
    def senders(self) -> int:
        """How many sender ids have a connection open."""
        return len(self._count)

    def alive(self, sender_id: bytes) -> bool:
        """Whether ``sender_id`` has a connection open (safe from any thread)."""
        return sender_id in self._count

    def gone(self, sender_id: bytes) -> tuple[float, bool] | None:
        """``(when, proven)`` if ``sender_id``'s last connection has ended, else None (safe from
        any thread). A sender is recorded gone before it stops being ``alive``: asked in that
        order, a sender this listener has heard from is always one or the other, even while
        ``on_gone`` has not run yet."""
        return self._gone.get(sender_id)

    def close(self) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for conn in list(self._ids):
            conn.close()
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select():
                sock = key.fileobj
                if sock is self._sock:
                    self._accept()
                elif sock is not self._wake_r:
                    self._read(sock)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            for opt, value in zip(
                (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT),
                KEEPALIVE,
                strict=True,
            ):
                conn.setsockopt(socket.IPPROTO_TCP, opt, value)
        self._ids[conn] = bytearray()
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _read(self, conn: socket.socket) -> None:
        seen = self._ids[conn]
        proven = True  # end of stream, or reset: the sender's kernel closed it
        try:
            data = conn.recv(SENDER_ID_NBYTES)
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            data = b""
        except OSError:  # keepalive timed out, host unreachable: no word from the sender
            data, proven = b"", False
        if data and len(seen) < SENDER_ID_NBYTES:
            seen += data[: SENDER_ID_NBYTES - len(seen)]
            if len(seen) == SENDER_ID_NBYTES:
                sid = bytes(seen)
                self._count[sid] = self._count.get(sid, 0) + 1
                self._gone.pop(sid, None)
            return
        if data:
            return  # a sender says nothing after its id; ignore anything else
        self._selector.unregister(conn)
        del self._ids[conn]
        conn.close()
        if len(seen) < SENDER_ID_NBYTES:
            return  # never said who it was
        sid = bytes(seen)
        self._count[sid] -= 1
        if self._count[sid] == 0:
            now = time.monotonic()
            gone = {s: g for s, g in self._gone.items() if g[0] > now - REMEMBER_GONE_S}
            gone[sid] = (now, proven)
            self._gone = gone  # first: see gone()
            del self._count[sid]
            self._on_gone(sid, proven)


class LivenessLinks:
    """The sender's side: one connection to each receiver's listener, kept open until ``close``
    (after the transport's UCX endpoints are closed) or until this process exits."""

    def __init__(self, sender_id: bytes) -> None:
        self.sender_id = sender_id
        self._lock = threading.Lock()
        self._links: dict[tuple[str, int], socket.socket] = {}
        self._refused: dict[tuple[str, int], float] = {}  # -> when to try again

    def link(self, host: str, port: int) -> bool:
        """Make sure a connection to ``host:port`` is open; False if it cannot be (the receiver
        then holds the fences of this sender's failed transfers until its fence timeout)."""
        if port == 0:
            return False
        key = (host, port)
        with self._lock:
            if key in self._links:
                return True
            if self._refused.get(key, 0.0) > time.monotonic():
                return False
            try:
                conn = socket.create_connection(key, timeout=CONNECT_TIMEOUT_S)
                conn.sendall(self.sender_id)
            except OSError as exc:
                self._refused[key] = time.monotonic() + RETRY_AFTER_S
                log.warning(
                    "kv.liveness_unreachable",
                    receiver=f"{host}:{port}",
                    error=str(exc),
                    consequence="a transfer of this worker that fails half-way keeps its "
                    "receiver's blocks until the receiver's fence timeout",
                )
                return False
            self._links[key] = conn
            return True

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for conn in links:
            conn.close()
