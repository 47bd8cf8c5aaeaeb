"""Exclusive lock with Apache Curator's ``InterProcessMutex`` layout."""

from __future__ import annotations

from typing import Literal, overload

from kazoo.client import KazooClient

from celery_zklock.locks.contenders import MUTEX_MARKER
from celery_zklock.locks.internals import LockInternals
from celery_zklock.locks.lease import Lease


class Mutex:
    """A distributed exclusive lock on ``path``: at most one :class:`Lease` exists at a time.

    Contender nodes are ``<path>/_c_<uuid>-lock-<seq>``, as Curator's ``InterProcessMutex``
    writes them, so Java services using Curator and Python processes using this class exclude
    each other on the same path. The parent ``path`` and its missing ancestors are created as
    container nodes, which ZooKeeper removes once empty.

    Reentrant per thread: a thread that holds the lock and acquires it again (through any
    ``Mutex`` on the same client and path) gets another lease on the same node; the node is
    deleted when every such lease is released.
    """

    def __init__(self, client: KazooClient, path: str) -> None:
        self._internals = LockInternals(client, path, MUTEX_MARKER, "write")

    @property
    def path(self) -> str:
        return self._internals.path

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
        """Acquire the lock.

        Args:
            blocking: wait for the lock (default). With ``False`` it is a try-lock: one look at
                the queue, then a :class:`Lease` or ``None`` if someone else holds it.
            data: bytes stored in our contender node (who we are, for operators and for
                :meth:`blocker_data`); Curator stores the client's IP there.
            timeout: one total deadline in seconds over every wait, retry and network call of
                this acquire; ``None`` waits without limit (a try-lock then still bounds its
                network calls by the session timeout).

        Returns:
            A :class:`Lease`; ``None`` only for a try-lock that found the lock busy.

        Raises:
            LockTimeout: the deadline passed first (also for a try-lock that could not reach
                ZooKeeper in time).
            ValueError: a negative timeout.

        In every outcome other than a returned lease - busy, timeout, connection loss, any
        exception including ones thrown asynchronously into the waiting thread - no contender
        node of this acquire is left behind (if ZooKeeper is unreachable at that moment, the
        node is removed on reconnect, or goes with its session).
        """
        return self._internals.acquire(blocking=blocking, timeout=timeout, data=data)

    def participant_nodes(self) -> list[str]:
        """Names of the current contender nodes on this path, in grant order."""
        return self._internals.participant_nodes()

    def blocker_data(self, timeout: float = 5.0) -> bytes | None:
        """Data of the node a new acquire would wait on first (the holder), or None."""
        return self._internals.blocker_data(timeout)
