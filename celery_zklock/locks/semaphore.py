"""Counting semaphore with Apache Curator's ``InterProcessSemaphore`` (v1) layout."""

from __future__ import annotations

from kazoo.client import KazooClient

from celery_zklock.locks.contenders import lock_kind
from celery_zklock.locks.mutex import Mutex


class Semaphore(Mutex):
    """At most ``max_leases`` leases on ``path`` at a time, granted in queue order.

    :meth:`acquire` has :meth:`Mutex.acquire`'s contract (``blocking``, ``timeout``, ``data``; a
    :class:`~celery_zklock.Lease` with a fencing token, or ``None`` for a busy try-lock; no
    contender node left behind in any other outcome). It also raises
    :class:`~celery_zklock.locks.contenders.LimitMismatch` (a
    :class:`~celery_zklock.ConfigurationError`) naming both limits when the lock is in use with
    another ``max_leases``.

    The contender queue is a mutex's: nodes ``<path>/_c_<uuid>-lock-<seq>``, as Curator's
    ``InterProcessSemaphore`` (v1) writes them; the first ``max_leases`` contenders hold, and a
    waiter watches only the node ``max_leases`` places ahead of it, so each release wakes at most
    one waiter. That one watch has a price: a waiter is woken when *that* node goes, so a lease
    released out of queue order leaves its slot unused until the older lease ahead of the waiter
    goes too (as with Curator's v1).

    The limit is stored in the data of the lock's node ``path`` (``max_leases=N``), written by
    the first contender that finds it empty, and checked by every acquire. The node is a
    container: once the last lease is gone the server removes it, and with it the stored limit.
    Curator's v1 stores none (it neither writes nor checks one).

    Leases of one semaphore are held at the same time, each with its own token: a token orders a
    lease after every lease granted before its acquire began, not after the ones it runs beside.
    Like :class:`Mutex`, reentrant per thread: a thread that holds a lease and acquires again
    gets another lease on the same node (one of the ``max_leases``, counted once).

    Raises:
        ValueError: ``max_leases`` is not a whole number >= 1, or the path is not a lock path.
    """

    def __init__(self, client: KazooClient, path: str, max_leases: int) -> None:
        super().__init__(client, path, kind=lock_kind("semaphore", max_leases))
        self._max_leases = max_leases

    @property
    def max_leases(self) -> int:
        """How many leases may be held at once."""
        return self._max_leases
