"""Shared/exclusive lock with Apache Curator's ``InterProcessReadWriteLock`` layout."""

from __future__ import annotations

from kazoo.client import KazooClient

from celery_zklock.locks.contenders import READ, WRITE
from celery_zklock.locks.mutex import Mutex


class ReadWriteLock:
    """Readers share the lock, a writer excludes everyone; grants follow the queue order.

    Contender nodes are ``<path>/_c_<uuid>-__READ__<seq>`` and ``_c_<uuid>-__WRIT__<seq>``, as
    Curator's ``InterProcessReadWriteLock`` writes them. A reader is granted when no write
    contender is ahead of it, and waits on the nearest such writer; a writer is granted when it is
    first, and waits on the node just ahead of it. Readers queued behind a waiting writer wait too
    (no writer starvation).

    ``read`` and ``write`` are :class:`Mutex` objects of another kind on the same queue (as in
    Curator), with the same ``acquire`` contract. A thread holding the write side may also take
    the read side (reentrant); a thread holding only the read side asking for the write side gets
    an error instead of a deadlock.
    """

    def __init__(self, client: KazooClient, path: str) -> None:
        self.read = Mutex(client, path, kind=READ)
        self.write = Mutex(client, path, kind=WRITE)
        self.path = self.read.path
