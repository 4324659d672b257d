"""The control path: one msgpack step plan per step from the engine to every worker loop, small
results back, as length-prefixed frames over a Unix socket (workers on the engine's node) or TCP
(``TCP_NODELAY``). Tensors never travel here.

Workers block in ``recv`` (no busy polling). The engine waits for a reply while watching every
worker's socket: a worker that dies closes its socket, and one whose step fails sends its traceback,
so either surfaces at once as :class:`WorkerFailure` instead of a hang.
"""
from __future__ import annotations

import os
import selectors
import shutil
import socket
import struct
import tempfile
import time
from collections import deque
from collections.abc import Callable

import msgpack

from kdray.engine.engine import RunnerFailure

HEADER = struct.Struct("<I")  # payload length
POLL_S = 1.0  # how often a long wait also runs the caller's liveness check
GRACE_S = 0.2  # after a first failure, how long to collect the others (a crash often takes peers with it)
RECV_BYTES = 1 << 18


class WorkerFailure(RunnerFailure):
    """A shard or drafter actor died or failed mid-step; ``request_ids`` lists the requests that failed."""


def pack(obj) -> bytes:
    return msgpack.packb(obj)


class _Conn:
    """One TCP connection carrying length-prefixed msgpack frames; a small frame arrives in one ``recv``."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._buf, self._chunk = sock, bytearray(), bytearray(RECV_BYTES)

    def send(self, payload: bytes):
        self.sock.sendall(HEADER.pack(len(payload)) + payload)

    def has_frame(self) -> bool:
        """Whether a whole frame is already buffered (read along with an earlier one)."""
        return len(self._buf) >= HEADER.size and len(self._buf) >= HEADER.size + HEADER.unpack_from(self._buf)[0]

    def recv(self):
        """The next frame, decoded; ``ConnectionError`` once the peer has closed the connection."""
        while True:
            if len(self._buf) >= HEADER.size:
                end = HEADER.size + HEADER.unpack_from(self._buf)[0]
                if len(self._buf) >= end:
                    msg = msgpack.unpackb(self._buf[HEADER.size:end], strict_map_key=False)
                    del self._buf[:end]
                    return msg
            n = self.sock.recv_into(self._chunk)
            if n == 0:
                raise ConnectionError("the peer closed the channel")
            self._buf += memoryview(self._chunk)[:n]

    def close(self):
        self.sock.close()


class PlanServer:
    """Engine side: accepts one connection per named worker, broadcasts plans, awaits replies."""

    def __init__(self, host: str | None):
        """Listen over TCP on ``host``, or (None) on a Unix socket, about twice as fast, for workers on
        this node."""
        self._dir = None
        if host is None:
            self._dir = tempfile.mkdtemp(prefix="kdray-plan-")
            self.address: tuple[str, int] | str = os.path.join(self._dir, "sock")
            self._listener = socket.socket(socket.AF_UNIX)
            self._listener.bind(self.address)
            self._listener.listen()
        else:
            self._listener = socket.create_server((host, 0))
            self.address = (host, self._listener.getsockname()[1])
        self._peers: dict[str, _Conn] = {}
        self._inbox: dict[str, deque] = {}  # replies read but not yet asked for, per worker
        self._selector = selectors.DefaultSelector()

    def accept(self, names: list[str], timeout_s: float, check: Callable[[], None]):
        """Wait until every worker in ``names`` has connected and said its name; ``check`` runs meanwhile
        and raises if a worker is already gone."""
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(POLL_S)
        while set(names) - set(self._peers):
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker loop(s) {sorted(set(names) - set(self._peers))} did not connect to the "
                                    f"engine at {self.address} within {timeout_s:.0f} s")
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                check()
                continue
            conn = _Conn(sock)
            name = conn.recv()["hello"]
            self._peers[name] = conn
            self._selector.register(sock, selectors.EVENT_READ, (name, conn))

    def broadcast(self, payload: bytes, names: tuple[str, ...] | None = None):
        """Send one encoded plan to every worker (or those in ``names``)."""
        frame = HEADER.pack(len(payload)) + payload
        for name, conn in self._peers.items():
            if names is not None and name not in names:
                continue
            try:
                conn.sock.sendall(frame)
            except OSError:
                raise WorkerFailure(f"{name} died: its channel is closed") from None

    def wait(self, names: tuple[str, ...], timeout_s: float, check: Callable[[], None]) -> list[dict]:
        """The next reply of each worker in ``names``, in the order of ``names``. Replies that arrive meanwhile from
        others (or a worker's next reply) wait in its inbox. Any worker's death or error raises
        :class:`WorkerFailure`; ``check`` runs whenever ``POLL_S`` passes without news."""
        deadline = time.monotonic() + timeout_s
        while missing := [n for n in names if not self._inbox.get(n)]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailure(f"no reply from {', '.join(missing)} within {timeout_s:.0f} s; a collective is "
                                    "probably stuck (raise step_timeout_s if steps are legitimately this slow)")
            # a frame may already be buffered (read along with an earlier one); else wait for a socket
            ready = [(p, c) for p, c in self._peers.items() if c.has_frame()] or [
                key.data for key, _ in self._selector.select(min(left, POLL_S))]
            if not ready:
                check()
            for peer, conn in ready:
                reply, problem = self._read(conn)
                if problem is not None:
                    raise WorkerFailure(self._collect({peer: problem}))
                self._inbox.setdefault(peer, deque()).append(reply)
        return [self._inbox[n].popleft() for n in names]

    def _read(self, conn: _Conn) -> tuple[dict | None, str | None]:
        """One frame: (the message, None), or (None, what went wrong)."""
        try:
            msg = conn.recv()
        except (ConnectionError, OSError):
            self._selector.unregister(conn.sock)
            return None, "died (its channel closed)"
        return (None, f"failed:\n{msg['error']}") if "error" in msg else (msg, None)

    def _collect(self, problems: dict[str, str]) -> str:
        """Gather what other workers report within ``GRACE_S``; deaths first (they usually caused the rest)."""
        deadline = time.monotonic() + GRACE_S
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in self._selector.select(left):
                peer, conn = key.data
                problems.setdefault(peer, self._read(conn)[1] or "sent a reply after a failure")
        died = [n for n, what in problems.items() if what.startswith("died")]
        if not died:
            return "; ".join(f"{n} {what}" for n, what in problems.items())
        # the deaths explain the rest: show only how the survivors' steps ended
        rest = [f"{n} then failed: {what.strip().splitlines()[-1]}" for n, what in problems.items() if n not in died]
        return "; ".join([f"{n} {problems[n]}" for n in died] + rest)

    def close(self):
        for conn in self._peers.values():
            conn.close()
        self._peers.clear()
        self._selector.close()
        self._listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class PlanClient:
    """Worker side: one connection to the engine, read in the worker's long-running loop."""

    def __init__(self, address: tuple[str, int] | str, name: str, timeout_s: float):
        """``address``: the server's ``(host, port)``, or its Unix socket path."""
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(timeout_s)
            sock.connect(address)
        else:
            sock = socket.create_connection(tuple(address), timeout=timeout_s)
        self._conn = _Conn(sock)
        self.send({"hello": name})

    def recv(self) -> dict:
        """The next plan; ``ConnectionError`` once the engine has closed the channel."""
        return self._conn.recv()

    def send(self, obj):
        self._conn.send(pack(obj))

    def close(self):
        self._conn.close()
