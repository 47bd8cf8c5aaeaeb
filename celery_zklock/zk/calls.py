"""Waiting on kazoo's asynchronous calls against a deadline.

kazoo's synchronous calls wait without limit while the client is cut off, and its gevent
handler's ``get(timeout=...)`` raises ``gevent.Timeout``, which cannot be told apart from a
time limit the gevent pool throws into a task. So every request the library waits for is sent
with ``*_async`` and awaited here: :func:`wait_result` waits in short slices
(:func:`wait_slice`) until a :class:`Deadline`, raising
:class:`~celery_zklock.errors.ZooKeeperUnavailable` when it passes (or when the deadline's
outage check says that waiting on is pointless); :func:`synced_children` lists a node's
children as the leader has them. Nothing here keeps state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery_zklock.errors import ZooKeeperUnavailable

#: Longest single blocking wait, in seconds: see :func:`wait_slice`.
WAIT_SLICE = 0.1


Outage = Callable[[], "str | None"]
"""Why waiting on for ZooKeeper is pointless now (the client has been without a connection, or
an answer, for too long), or None: see :meth:`ClientContext.outage
<celery_zklock.locks.context.ClientContext.outage>`."""


class Deadline:
    """A point in monotonic time, or none (wait without limit).

    With ``outage``, the deadline also counts as expired as soon as ``outage()`` names a reason
    (:meth:`why` then gives it): every wait bounded by the deadline ends there, whatever time
    is left.
    """

    def __init__(self, seconds: float | None, outage: Outage | None = None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds
        self.outage = outage

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """True once the point in time passed, or the outage check names a reason."""
        return (self.at is not None and time.monotonic() >= self.at) or self.gave_up()

    def gave_up(self) -> bool:
        """True if the outage check names a reason now (whatever time is left)."""
        return self.outage is not None and self.outage() is not None

    def why(self, what: str, late: str = "ZooKeeper did not answer in time") -> str:
        """Why a wait ``what`` (a phrase like "waiting for lock /x") ended at this deadline:
        the outage's reason if there is one, else ``late``."""
        reason = self.outage() if self.outage is not None else None
        return f"{late if reason is None else reason} while {what}"


def wait_slice(deadline: Deadline) -> float:
    """Wait in short slices: an exception thrown into this thread (PyThreadState_SetAsyncExc,
    as Celery's threads pool revocation does) is only delivered between blocking calls."""
    at = deadline.at
    return WAIT_SLICE if at is None else min(WAIT_SLICE, max(0.0, at - time.monotonic()))


def wait_result(result: Any, deadline: Deadline, what: str) -> Any:
    """Wait for a kazoo async result until ``deadline``; ZooKeeperUnavailable when it passes.

    Waits with ``wait`` and never with ``get(timeout=...)``: the gevent handler's ``get``
    raises ``gevent.Timeout`` on its own timeout, which cannot be told apart from a timeout
    the gevent pool throws into the task (its time limit) and must not be swallowed.
    Exceptions the request failed with propagate unchanged. The deadline is looked at after
    each slice (a passed one gives a slice of 0 s), so an answer that comes within the first
    costs no look at it.
    """
    while not result.ready():
        result.wait(wait_slice(deadline))
        if not result.ready() and deadline.expired():
            raise ZooKeeperUnavailable(deadline.why(what))
    return result.get()


def synced_children(client: Any, path: str, io: Deadline, what: str) -> list[str]:
    """The children of ``path`` as the leader had them when we asked: a ``sync`` and the listing
    back to back (the server answers a session's requests in order, so it costs no round trip).
    Raises what either request failed with (ZooKeeperUnavailable past ``io``)."""
    synced = client.sync_async(path)
    listing = client.get_children_async(path)
    wait_result(synced, io, what)
    children: list[str] = wait_result(listing, io, what)
    return children
