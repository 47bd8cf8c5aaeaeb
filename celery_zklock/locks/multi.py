"""Several locks at once, all or nothing, without deadlock: :class:`MultiLock`.

Curator's ``InterProcessMultiLock`` takes its locks in the order the caller lists them and gives
each its own timeout; two callers listing the same paths in opposite orders can then wait for
each other until their timeouts, and a caller can wait N times its timeout. :class:`MultiLock`
takes its paths in one canonical order (sorted, a path listed twice counts once), so two
MultiLocks over the same paths never wait for each other in a cycle whatever order their
callers list them in; and the whole acquire has one deadline. Each path is an ordinary lock of
``kind`` (a :class:`~celery_zklock.Mutex` by default, so it excludes ``Mutex`` and Curator's
``InterProcessMutex`` on that path); a timeout or any failure releases what was taken, and no
contender node of the attempt is left (each lock's own guarantee).

Why the leases are confirmed before they are handed out: a path taken early is held for as long
as the later ones are waited for, and it can be lost meanwhile - its session expired (the client
reconnects under a new session and goes on waiting), the lease clock ran out, or its node was
deleted (``celery zklock break --force``, an operator) - and then granted to someone else. A
:class:`~celery_zklock.Lease` learns of a deleted node from its break watch, which the lease
clock sets only once the lease has been held for a renewal interval and which reports on the
clock's next tick: a MultiLock that returned as soon as its last path was granted handed out
leases lost seconds ago, some not even marked lost yet. So once every path is granted, one
round trip (:meth:`LeaseClock.confirm_held <celery_zklock.locks.clock.LeaseClock.confirm_held>`:
a ``sync`` and a read of every node behind it, which also sets the break watches) brings each
lease's verdict up to date; if one was lost, that path and every later one are released and
taken again in the canonical order (never holding a later path while waiting for an earlier
one, so still no cycle), within the same deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    SessionExpiredError,
)

from celery_zklock.errors import LossCode, ZooKeeperUnavailable
from celery_zklock.locks.contenders import MUTEX, Kind, LockKind
from celery_zklock.locks.context import ClientContext, context_for
from celery_zklock.locks.lease import HeldLease, Lease, LostCallback, holds_of
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.queue import validate_lock_path
from celery_zklock.zk.calls import Deadline

logger = logging.getLogger("celery_zklock.locks")

__all__ = ["MultiLease", "MultiLock"]


class MultiLease(HeldLease):
    """The leases of one :class:`MultiLock` acquire, held together: ``tokens`` maps each path
    to its fencing token; ``lost`` as soon as any of them is lost; one :meth:`release`."""

    def __init__(self, leases: list[Lease]) -> None:
        self.leases = leases
        self._told: dict[LostCallback, LostCallback] = {}

    @property
    def token(self) -> int:
        """Not one number: each path has its own fencing token (:attr:`tokens`)."""
        raise AttributeError(
            "a MultiLease has one fencing token per path: fence each resource with "
            f"lease.tokens[path] ({', '.join(self.tokens)})"
        )

    @property
    def tokens(self) -> dict[str, int]:
        """``{path: fencing token}``."""
        return {lease.path: lease.token for lease in self.leases}

    @property
    def held(self) -> bool:
        """True while every lease is held (none released nor lost)."""
        return all(lease.held for lease in self.leases)

    @property
    def lost(self) -> bool:
        return any(lease.lost for lease in self.leases)

    @property
    def lost_reason(self) -> str | None:
        return next((lease.lost_reason for lease in self.leases if lease.lost), None)

    @property
    def lost_code(self) -> LossCode | None:
        return next((lease.lost_code for lease in self.leases if lease.lost), None)

    @property
    def valid_for(self) -> float:
        """The shortest :attr:`Lease.valid_for <celery_zklock.Lease.valid_for>` of its leases."""
        return min(lease.valid_for for lease in self.leases)

    def check(self) -> None:
        """Raise :class:`~celery_zklock.LockLost` if any of the leases was lost."""
        for lease in self.leases:
            lease.check()

    def on_check_raises(self, callback: Callable[[], None] | None) -> None:
        """As :meth:`Lease.on_check_raises <celery_zklock.Lease.on_check_raises>`, for each."""
        for lease in self.leases:
            lease.on_check_raises(callback)

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(reason)`` once, when the first of the leases is lost."""
        told: list[bool] = []

        def once(reason: str) -> None:
            if not told:
                told.append(True)
                callback(reason)

        self._told[callback] = once
        for lease in self.leases:
            lease.on_lost(once)

    def remove_on_lost(self, callback: LostCallback) -> None:
        """Forget a callback given to :meth:`on_lost`."""
        once = self._told.pop(callback, None)
        if once is not None:
            for lease in self.leases:
                lease.remove_on_lost(once)

    def release(self) -> None:
        """Release every lease (in the reverse order of their acquire). Idempotent."""
        _release_all(self.leases)

    def __repr__(self) -> str:
        return f"MultiLease({self.tokens!r}, lost={self.lost})"


class MultiLock:
    """Exclusive on every one of ``paths`` at once; see the module docstring."""

    def __init__(
        self, client: KazooClient, paths: Iterable[str], *, kind: LockKind = MUTEX
    ) -> None:
        ordered = sorted({validate_lock_path(path) for path in paths})
        if not ordered:
            raise ValueError("a MultiLock needs at least one path")
        self.paths = ordered
        self._context: ClientContext = context_for(client)
        self._locks = [Mutex(client, path, kind=kind) for path in ordered]
        self._last = self._locks[0]

    @property
    def path(self) -> str:
        """The path whose lock the last :meth:`acquire` stopped at (granted, busy, timed out or
        failed), the first path before any: where to look for who holds it."""
        return self._last.path

    @property
    def kind(self) -> Kind:
        """The kind of lock taken on every path (``"write"`` by default)."""
        return self._last.kind

    @property
    def dead_holder_bound(self) -> float:
        """:attr:`Mutex.dead_holder_bound <celery_zklock.Mutex.dead_holder_bound>` (one client)."""
        return self._last.dead_holder_bound

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, data: bytes = b""
    ) -> MultiLease | None:
        """Take every lock, in the canonical order, within one ``timeout`` (None: no limit).

        Returns the :class:`MultiLease`, every one of its leases held when it is returned: once
        all paths are granted their leases are confirmed (see the module docstring), and a
        path lost on the way is released with every later one and taken again, in order.
        None only for a try (``blocking=False``) that found a lock busy (also when taking a
        lost path again). Raises LockTimeout when the deadline passes first, ZooKeeperUnavailable
        when ZooKeeper does not answer in time, and whatever a lock's acquire raises; in every
        case but a returned lease, what was taken is released first and no node of the attempt
        is left.
        """
        deadline = Deadline(timeout)
        taken: list[Lease] = []
        try:
            while True:
                for lock in self._locks[len(taken) :]:
                    self._last = lock
                    lease = lock.acquire(blocking=blocking, timeout=deadline.remaining(), data=data)
                    if lease is None:
                        _release_all(taken)
                        return None
                    taken.append(lease)
                lost = self._first_lost(taken, deadline) if len(taken) > 1 else None
                if lost is None:
                    return MultiLease(taken)
                logger.info(
                    "lock %s was lost while %s was awaited (%s): taking it again",
                    taken[lost].path,
                    self._last.path,
                    taken[lost].lost_reason,
                )
                _release_all(taken[lost:])
                del taken[lost:]
        except BaseException:
            _release_all(taken)
            raise

    def _first_lost(self, taken: list[Lease], deadline: Deadline) -> int | None:
        """Confirm the leases of ``taken`` (:meth:`LeaseClock.confirm_held
        <celery_zklock.locks.clock.LeaseClock.confirm_held>`): the index of the first one lost,
        or None. Rides out a lost connection (the same session keeps its leases) up to
        ``deadline``, or a session timeout without ZooKeeper, as a lock's acquire does."""
        context = self._context
        remaining = deadline.remaining()
        io = Deadline(
            None if remaining is None else max(remaining, context.timing.idle_gap),
            partial(context.outage, time.monotonic()),
        )
        what = f"confirming the locks of {', '.join(self.paths)}"
        try:
            while holds := holds_of(lease for lease in taken if not lease.lost):
                try:
                    context.clock.confirm_held(holds, io)
                    break
                except ConnectionClosedError:
                    raise
                except (ConnectionLoss, SessionExpiredError):
                    # A new session ended the old one's leases (kazoo's LOST and CONNECTED);
                    # the same session's are confirmed again.
                    context.await_connected(io, what)
        except ConnectionClosedError as exc:
            raise ZooKeeperUnavailable(f"the kazoo client was stopped while {what}") from exc
        except KazooException as exc:
            raise ZooKeeperUnavailable(f"ZooKeeper failed a request while {what}: {exc!r}") from exc
        return next((i for i, lease in enumerate(taken) if lease.lost), None)


def _release_all(leases: list[Lease]) -> None:
    for lease in reversed(leases):
        lease.release()
