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
(:func:`celery_zklock.zk.adapter.use_direct_socket_io`); TLS sockets keep kazoo's path.
"""

from __future__ import annotations

import select
import ssl
from collections.abc import Sequence
from typing import Any

from kazoo.exceptions import ConnectionDropped
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd
from kazoo.protocol.connection import ConnectionHandler

__all__ = ["DirectSocketConnection", "PollingThreadingHandler", "poll_select"]

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

    select = staticmethod(poll_select)


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
