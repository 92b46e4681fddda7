"""ZMQ control channel: ``ipc://`` socket naming, timeouts and dead-peer detection.

Nothing here blocks without a deadline: every send/receive polls in short slices, checks that
the peer process (same node, so its pid is visible) is still alive, and raises
``RefitTimeoutError`` naming the peer and the step after ``timeout_s``. A peer's ``Error``
message is raised as ``RefitRemoteError`` carrying the peer's text.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from collections import deque
from typing import Callable

import zmq

from rlc.runtime.refit.errors import RefitProtocolError, RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.protocol import Error, Message, decode, encode

#: How often a blocked send/receive wakes up to check the peer's pid.
POLL_SLICE_S = 0.2
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def endpoint(session: str, key: str, *, socket_dir: str = "/tmp", role: str = "") -> str:
    """``ipc://<dir>/rlc-refit-<session>-<key>[-role].sock``, hashed when the path would be too long."""
    name = f"rlc-refit-{_clean(session)}-{_clean(key)}" + (f"-{role}" if role else "")
    path = os.path.join(socket_dir, name + ".sock")
    if len(path) > _MAX_IPC_PATH:
        digest = hashlib.sha1(name.encode()).hexdigest()[:20]
        path = os.path.join(socket_dir, f"rlc-refit-{digest}.sock")
    if len(path) > _MAX_IPC_PATH:
        raise RefitProtocolError(f"refit socket path {path!r} is too long for ipc://; use a shorter socket_dir")
    return "ipc://" + path


def pid_alive(pid: int | None) -> bool:
    """False when ``pid`` is gone or a zombie; True when unknown or alive (same node only)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class Channel:
    """A PAIR (or DEALER) socket with deadlines; ``name`` describes this end for error messages."""

    def __init__(self, sock: zmq.Socket, name: str, timeout_s: float, peer_pid: int | None = None) -> None:
        self.sock = sock
        self.name = name
        self.timeout_s = float(timeout_s)
        self.peer_pid = peer_pid
        self.peer_name = "peer"
        self.inbox: deque[tuple[Message, bytes | None]] = deque()

    def _limit(self, timeout_s: float | None) -> tuple[float, float]:
        """(the timeout in seconds, its deadline on the monotonic clock)."""
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        return limit, time.monotonic() + limit

    def _wait(self, flags: int, what: str, limit: float, deadline: float,
              check: Callable[[], None] | None = None) -> None:
        """Block until ``flags`` (POLLIN/POLLOUT) is ready or ``deadline`` passes (``limit``: the timeout it
        stands for, for the message). While waiting to send, incoming messages are moved to the inbox, so
        a peer's ``Error`` surfaces even when the peer stopped reading."""
        while True:
            if flags == zmq.POLLIN and self.inbox:
                return
            mask = self.sock.poll(int(POLL_SLICE_S * 1000), flags | zmq.POLLIN)
            if mask & zmq.POLLIN and flags == zmq.POLLOUT:
                self._take()
            if mask & flags:
                return
            if not pid_alive(self.peer_pid):
                raise RefitTimeoutError(
                    f"{self.name}: {self.peer_name} (pid {self.peer_pid}) died while waiting for {what}"
                )
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise RefitTimeoutError(
                    f"{self.name}: no progress on {what} within {limit:g} s ({self.peer_name}, pid "
                    f"{self.peer_pid or 'unknown'}). The peer is stuck, dead, or was never started (is the vLLM "
                    "worker / trainer rank on the same GPU running refit?)"
                )

    def _take(self) -> None:
        """Read one message into the inbox; a peer ``Error`` raises right away. A readiness that vanished
        before the read (``zmq.Again``) reads nothing: the caller waits again."""
        try:
            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        msg, payload = decode(frames)
        if isinstance(msg, Error):
            raise RefitRemoteError(f"{self.name}: {self.peer_name} failed ({msg.where}): {msg.message}")
        self.inbox.append((msg, payload))

    def send(self, msg: Message, payload: bytes | None = None, *, timeout_s: float | None = None) -> None:
        """Send within the deadline. The peer can go away between the poll that said "writable" and the
        send (it failed, sent its ``Error`` and closed): the send then raises ``zmq.Again``, and the peer's
        reason, already queued here, is raised instead (``RefitRemoteError``)."""
        limit, deadline = self._limit(timeout_s)
        frames = encode(msg, payload)
        events = int(self.sock.get(zmq.EVENTS))  # no poll (a refit sends a dozen small messages on its critical path)
        if events & zmq.POLLIN:
            self._take()  # what the peer sent first is read first: its Error stops this side before it sends more
        if events & zmq.POLLOUT:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        while True:
            self._wait(zmq.POLLOUT, f"sending {msg.kind!r}", limit, deadline)
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                while self.sock.poll(0, zmq.POLLIN):
                    self._take()  # a peer Error raises here
                if time.monotonic() > deadline:
                    raise RefitTimeoutError(
                        f"{self.name}: could not send {msg.kind!r} within {limit:g} s: {self.peer_name} (pid "
                        f"{self.peer_pid or 'unknown'}) stopped receiving") from None
                time.sleep(POLL_SLICE_S)

    def recv(
        self,
        what: str,
        *,
        timeout_s: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> tuple[Message, bytes | None]:
        """Next message; a peer ``Error`` is raised as ``RefitRemoteError``."""
        if not self.inbox:
            self._take()  # one already queued is read without a poll first
        if self.inbox:
            return self.inbox.popleft()
        limit, deadline = self._limit(timeout_s)
        while True:
            self._wait(zmq.POLLIN, what, limit, deadline, check)
            if not self.inbox:
                self._take()
            if self.inbox:
                return self.inbox.popleft()
            if time.monotonic() > deadline:
                raise RefitTimeoutError(f"{self.name}: nothing to read for {what} within {limit:g} s ({self.peer_name})")

    def try_send_error(self, message: str, where: str) -> None:
        """Best effort: tell the peer why we stop, without blocking."""
        try:
            if self.sock.poll(0, zmq.POLLOUT):
                self.sock.send_multipart(encode(Error(message=message[:20000], where=where)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        close_socket(self.sock, linger_ms=200)


def new_socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


_BOUND_PATHS: dict[int, str] = {}  # id(socket) -> ipc path it is bound to


def bind(sock: zmq.Socket, ep: str) -> None:
    """Bind to an ``ipc://`` endpoint and remember its path so ``close_socket`` removes the file."""
    sock.bind(ep)
    if ep.startswith("ipc://"):
        _BOUND_PATHS[id(sock)] = ep[len("ipc://") :]


def bound_path(sock: zmq.Socket) -> str | None:
    return _BOUND_PATHS.get(id(sock))


def close_socket(sock: zmq.Socket, linger_ms: int = 0) -> None:
    """Close a socket; a bound ``ipc://`` socket also removes its socket file (libzmq leaves it)."""
    path = _BOUND_PATHS.pop(id(sock), None)
    sock.close(linger=linger_ms)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
