"""Shared/exclusive lock with Apache Curator's ``InterProcessReadWriteLock`` layout."""

from __future__ import annotations

from typing import Literal, overload

from kazoo.client import KazooClient

from celery_zklock.locks.contenders import READ_MARKER, WRITE_MARKER, Kind
from celery_zklock.locks.internals import LockInternals
from celery_zklock.locks.lease import Lease


class LockSide:
    """One side (read or write) of a :class:`ReadWriteLock`; same contract as ``Mutex.acquire``."""

    def __init__(self, client: KazooClient, path: str, marker: str, kind: Kind) -> None:
        self._internals = LockInternals(client, path, marker, kind)

    @property
    def kind(self) -> Kind:
        return self._internals.kind

    @overload
    def acquire(
        self, *, blocking: Literal[True] = ..., timeout: float | None = ..., data: bytes = ...
    ) -> Lease: ...
    @overload
    def acquire(
        self, *, blocking: bool, timeout: float | None = ..., data: bytes = ...
    ) -> Lease | None: ...
    def acquire(
        self, *, blocking: bool = True, timeout: float | None = None, data: bytes = b""
    ) -> Lease | None:
        """Acquire this side; see :meth:`celery_zklock.Mutex.acquire` for the full contract."""
        return self._internals.acquire(blocking=blocking, timeout=timeout, data=data)

    @property
    def session_timeout(self) -> float:
        """The session timeout of this lock's client, in seconds (negotiated once known)."""
        return self._internals.watch.session_timeout

    def blocker_data(self, timeout: float = 5.0) -> bytes | None:
        """Data of the node a new acquire would wait on first (the holder), or None."""
        return self._internals.blocker_data(timeout)


class ReadWriteLock:
    """Readers share the lock, a writer excludes everyone; grants follow the queue order.

    Contender nodes are ``<path>/_c_<uuid>-__READ__<seq>`` and ``_c_<uuid>-__WRIT__<seq>``, as
    Curator's ``InterProcessReadWriteLock`` writes them. A reader is granted when no write
    contender is ahead of it, and waits on the nearest such writer; a writer is granted when it is
    first, and waits on the node just ahead of it. Readers queued behind a waiting writer wait too
    (no writer starvation).

    A thread holding the write side may also take the read side (reentrant); a thread holding
    only the read side asking for the write side gets an error instead of a deadlock.
    """

    def __init__(self, client: KazooClient, path: str) -> None:
        self.read = LockSide(client, path, READ_MARKER, "read")
        self.write = LockSide(client, path, WRITE_MARKER, "write")
        self.path = self.read._internals.path
