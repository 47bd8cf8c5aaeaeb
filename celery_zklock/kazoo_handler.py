"""A kazoo threading handler whose ``select`` costs one ``poll`` system call.

kazoo's :class:`~kazoo.handlers.threading.SequentialThreadingHandler` waits on its socket with a
new ``epoll`` selector per call (create, register, wait, close), and its connection thread waits
about five times per request (for the wake-up byte, a writable socket, the reply's length and its
body). That churn is most of the CPU a request costs the client. :class:`PollingThreadingHandler`
answers the same ``select(rlist, wlist, xlist, timeout)`` contract with one ``poll(2)`` call, which
has no file-descriptor limit either; everything else is kazoo's own handler. The clients the
library makes use it; pass it to your own ``KazooClient(handler=PollingThreadingHandler())`` for
the same saving. Measured effect: ``docs/benchmarks.md``.

:class:`DirectSocketConnection` cuts the waits themselves: kazoo's connection thread polls its
socket before every ``send`` and ``recv``, although the main loop's poll has just said the reply is
there and a request almost always fits the send buffer. Its ``_read`` and ``_write`` call ``recv``
and ``send`` on the non-blocking socket first and poll only when the socket would block (5 polls
per request become 2). The library installs it on its own threading clients
(:func:`celery_zklock.locks.adapter.use_direct_socket_io`); TLS sockets keep kazoo's path.

:class:`DirectSendClient` cuts a thread hand-off per request: kazoo's ``_call`` queues a request
and wakes the connection thread, which writes it; ours writes it on the calling thread (under a
lock the connection thread's own writes also take) whenever the connection is up and nothing
waits in kazoo's queue. The connection thread still reads every answer, in order, and fails
every request in flight when the connection drops, so a request sent this way is answered,
ordered and failed exactly as a queued one.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Final

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionDropped
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Auth, Close
from kazoo.protocol.states import KeeperState

__all__ = [
    "DirectSendClient",
    "DirectSocketConnection",
    "PollingThreadingHandler",
    "hook_differs",
    "kazoo_version",
    "poll_select",
]

_log = logging.getLogger(__name__)

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT
# As the selectors module does: an error or hang-up makes a descriptor ready both ways, so the
# caller's read or write finds the failure.
_ANY_ERROR = select.POLLERR | select.POLLHUP | select.POLLNVAL


def poll_select(
    rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any], timeout: float | None = None
) -> tuple[list[Any], list[Any], list[Any]]:
    """``select.select``'s contract (as kazoo's ``selector_select`` gives it) with one ``poll``.

    Objects are file descriptors or have ``fileno()``; ``xlist`` is accepted and never reported
    (kazoo passes none). ``timeout`` is in seconds, None to wait without limit.
    """
    if timeout is not None:
        if not isinstance(timeout, (int, float)):
            raise TypeError("timeout must be a number")
        if timeout < 0:
            raise ValueError("timeout must be non-negative")
    masks: dict[int, int] = {}
    readers: dict[int, list[Any]] = {}
    writers: dict[int, list[Any]] = {}
    for objects, mask, by_fd in ((rlist, _READ, readers), (wlist, _WRITE, writers)):
        for fileobj in objects:
            fd = fileobj_to_fd(fileobj)
            masks[fd] = masks.get(fd, 0) | mask
            by_fd.setdefault(fd, []).append(fileobj)
    poller = select.poll()
    for fd, mask in masks.items():
        poller.register(fd, mask)
    ready = poller.poll(None if timeout is None else timeout * 1000.0)
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, events in ready:
        if events & (_READ | _ANY_ERROR):
            readable.extend(readers.get(fd, ()))
        if events & (_WRITE | _ANY_ERROR):
            writable.extend(writers.get(fd, ()))
    return readable, writable, []


class PollingThreadingHandler(SequentialThreadingHandler):  # type: ignore[misc]
    """kazoo's threading handler with :func:`poll_select` as its ``select``."""

    def select(self, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any], list[Any]]:
        return poll_select(*args, **kwargs)


class DirectSocketConnection(ConnectionHandler):  # type: ignore[misc]
    """kazoo's connection handler whose socket reads and writes try the socket before polling.

    Same contract as kazoo's ``_read``/``_write``: all ``length`` bytes (all of ``msg``) or
    ``ConnectionDropped`` when the peer closed the connection or the socket failed, and the
    handler's timeout exception when the socket stays not ready for ``timeout`` seconds. A TLS
    socket takes kazoo's own path (its records need ``pending()`` and the want-read/write
    retries that path has).
    """

    def _read(self, length: int, timeout: float) -> bytes:
        sock = self._socket
        if isinstance(sock, ssl.SSLSocket):
            return super()._read(length, timeout)  # type: ignore[no-any-return]
        parts: list[bytes] = []
        remaining = length
        try:
            while remaining > 0:
                try:
                    chunk = sock.recv(remaining)
                except BlockingIOError:
                    if not self.handler.select([sock], [], [], timeout)[0]:
                        raise self.handler.timeout_exception(
                            "socket time-out during read"
                        ) from None
                    continue
                if not chunk:
                    raise ConnectionDropped("socket connection broken")
                parts.append(chunk)
                remaining -= len(chunk)
        except (OSError, ValueError) as exc:  # ValueError: select on a closed socket (fd -1)
            raise ConnectionDropped(f"socket connection error: {exc}") from exc
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _write(self, msg: bytes, timeout: float) -> None:
        sock = self._socket
        if isinstance(sock, ssl.SSLSocket):
            super()._write(msg, timeout)
            return
        view = memoryview(msg)
        try:
            while view:
                try:
                    sent = sock.send(view)
                except BlockingIOError:
                    if not self.handler.select([], [sock], [], timeout)[1]:
                        raise self.handler.timeout_exception(
                            "socket time-out during write"
                        ) from None
                    continue
                if not sent:
                    raise ConnectionDropped("socket connection broken")
                view = view[sent:]
        except (OSError, ValueError) as exc:
            raise ConnectionDropped(f"socket connection error: {exc}") from exc

    # --- Requests written by the calling thread (DirectSendClient) ---------------------------
    #
    # The lock orders every write of a request on this connection (ours and the connection
    # thread's) with its xid and its place in kazoo's ``_pending``, so the answers, which the
    # connection thread alone reads, come back in the order ``_pending`` expects. ``_direct_sends``
    # is True only between the end of a handshake (auth sent) and the first sign that the
    # connection is going: a Close sent, or any state but CONNECTED reported. The class
    # defaults keep a connection without ``enable_direct_sends`` on kazoo's own path.
    _xid: int  # kazoo's: the last xid sent on this connection (reset by each handshake)
    _send_lock: threading.Lock | None = None
    _direct_sends: bool = False
    _send_timeout: float = 10.0

    def enable_direct_sends(self) -> None:
        """Let :meth:`send_now` write requests (call before the client starts)."""
        if self._send_lock is None:
            self._send_lock = threading.Lock()

    def send_now(self, request: Any, async_object: Any) -> bool:
        """Write ``request`` on this thread and put it among those awaiting an answer; False
        (nothing done) if it must go through kazoo's queue instead: the connection is not up,
        requests wait in the queue (they go first), or the request is one only the connection
        thread sends. A failed write drops the connection, and the connection thread then fails
        this request as it fails every one in flight; an error of the request's own
        serialisation is raised here, with nothing sent. An exception thrown into this thread
        during the write (an interruption) drops the connection too, and is raised."""
        lock = self._send_lock
        opcode = getattr(request, "type", None)  # kazoo's test sentinels have none
        if lock is None or not self._direct_sends or opcode is None or opcode in _QUEUED_ONLY:
            return False
        body = request.serialize()
        with lock:
            client = self.client
            if not self._direct_sends or client._queue:
                return False
            self._xid = xid = (self._xid % 2147483647) + 1
            if self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug("Sending request(xid=%s): %s", xid, request)
            try:
                client._pending.append((request, async_object, xid))
                self._write(
                    DIRECT_HEADER.pack(len(body) + 8, xid, opcode) + body, self._send_timeout
                )
            except BaseException as exc:
                # The stream may now hold part of a request, or an answer be awaited for one
                # never sent: end this connection (the connection thread fails all in flight).
                self._direct_sends = False
                _shut(self._socket)
                if not isinstance(exc, Exception):
                    raise  # thrown into this thread (a task's interruption): not ours to keep
        return True

    def stop_direct_sends(self) -> None:
        """Send nothing more on this thread until the next handshake (waits for a write in
        progress, so every request written so far is in kazoo's ``_pending``)."""
        with self._writes_locked():
            self._direct_sends = False

    def _writes_locked(self) -> contextlib.AbstractContextManager[Any]:
        """The send lock held, or nothing for a connection without direct sends."""
        lock = self._send_lock
        return lock if lock is not None else contextlib.nullcontext()

    def _connect(self, host: str, hostip: str, port: int) -> Any:
        timeouts = super()._connect(host, hostip, port)
        if self._send_lock is None:
            return timeouts
        if not _are_timeouts(timeouts):
            hook_differs("ConnectionHandler._connect", f"it returned {timeouts!r}")
        with self._writes_locked():
            if _differing_hook is None:
                self._send_timeout = timeouts[1] / 1000.0
            # OpenSSL does not allow one thread to write while another reads
            self._direct_sends = _differing_hook is None and not isinstance(
                self._socket, ssl.SSLSocket
            )
        return timeouts

    def _send_request(self, read_timeout: float, connect_timeout: float) -> None:
        with self._writes_locked():
            queue = self.client._queue
            if queue and isinstance(queue[0][0], Close):
                self._direct_sends = False
            super()._send_request(read_timeout, connect_timeout)

    def _send_ping(self, connect_timeout: float) -> None:
        with self._writes_locked():
            super()._send_ping(connect_timeout)


class DirectSendClient(KazooClient):  # type: ignore[misc]
    """kazoo's client whose requests are written by the thread that makes them, when its
    connection is a :class:`DirectSocketConnection` with direct sends enabled (else kazoo's
    own path). Everything else, answers, watches, reconnects and the failure of requests in
    flight, is kazoo's. Made by :func:`celery_zklock.locks.adapter.use_direct_socket_io`."""

    def _call(self, request: Any, async_object: Any) -> Any:
        connection = self._connection
        if isinstance(connection, DirectSocketConnection) and connection.send_now(
            request, async_object
        ):
            return None
        return super()._call(request, async_object)

    def _session_callback(self, state: str) -> None:
        if state not in _UP_STATES:
            connection = self._connection
            if isinstance(connection, DirectSocketConnection):
                # before kazoo fails the requests in flight, so none is added after that
                connection.stop_direct_sends()
        super()._session_callback(state)


#: length, xid, opcode: the header of every request after the handshake (as kazoo writes it).
DIRECT_HEADER: Final = struct.Struct("!iii")
#: Requests kazoo's connection thread must send itself (auth takes its own xid; Close ends).
_QUEUED_ONLY: Final = frozenset({Auth.type, Close.type})
_UP_STATES: Final = frozenset({KeeperState.CONNECTED, KeeperState.CONNECTED_RO})


_differing_hook: str | None = None
_differs_lock = threading.Lock()


def hook_differs(hook: str, detail: str) -> None:
    """Record that kazoo's private ``hook`` is not what :class:`DirectSendClient` relies on:
    from now on no connection of this process writes a request on its caller's thread (each
    goes through kazoo's own queue from its next handshake, and at once after
    :meth:`DirectSocketConnection.stop_direct_sends`). Logs one warning per process, naming
    the first hook found to differ and the installed kazoo version."""
    global _differing_hook
    with _differs_lock:
        if _differing_hook is not None:
            return
        _differing_hook = hook
    _log.warning(
        "kazoo %s: %s differs from what celery-zklock expects (%s); requests take kazoo's own "
        "write path in this process",
        kazoo_version(),
        hook,
        detail,
    )


def differing_hook() -> str | None:
    """The private kazoo hook found to differ in this process (:func:`hook_differs`), if any."""
    return _differing_hook


def kazoo_version() -> str:
    try:
        return metadata.version("kazoo")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "(unknown version)"


def _are_timeouts(value: Any) -> bool:
    """kazoo's ``_connect`` answers ``(read_timeout, connect_timeout)`` in milliseconds."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in value)
    )


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed or never connected
            sock.shutdown(socket.SHUT_RDWR)
