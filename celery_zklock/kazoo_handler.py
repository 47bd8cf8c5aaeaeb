"""A kazoo threading handler whose ``select`` costs one ``poll`` system call.

kazoo's :class:`~kazoo.handlers.threading.SequentialThreadingHandler` waits on its socket with a
new ``epoll`` selector per call (create, register, wait, close), and its connection thread waits
about five times per request (for the wake-up byte, a writable socket, the reply's length and its
body). That churn is most of the CPU a request costs the client. :class:`PollingThreadingHandler`
answers the same ``select(rlist, wlist, xlist, timeout)`` contract with one ``poll(2)`` call, which
has no file-descriptor limit either; everything else is kazoo's own handler. The clients the
library makes use it; pass it to your own ``KazooClient(handler=PollingThreadingHandler())`` for
the same saving. Measured effect: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

__all__ = ["PollingThreadingHandler", "poll_select"]

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
