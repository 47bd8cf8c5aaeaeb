"""A granted lock: :class:`Lease`, and the contender node behind it, :class:`Hold`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from celery_zklock.errors import LockLost
from celery_zklock.locks.contenders import Kind

if TYPE_CHECKING:
    from celery_zklock.locks.internals import LockInternals

logger = logging.getLogger("celery_zklock.locks")

LostCallback = Callable[[str], None]


class Hold:
    """Our contender node while it holds the lock; shared by the leases of reentrant acquires.

    Knows the session that created the node, and is told by the session policy when that
    session is lost (:meth:`mark_lost`). The node is deleted when the last lease on it is released.
    """

    def __init__(
        self,
        internals: LockInternals,
        node: str,
        token: int,
        session_id: int,
        thread_id: int,
    ) -> None:
        self.internals = internals
        self.node = node
        self.token = token
        self.session_id = session_id
        self.thread_id = thread_id
        self.count = 1
        self.lost_reason: str | None = None
        self._callbacks: list[LostCallback] = []
        self._lock = threading.Lock()

    @property
    def kind(self) -> Kind:
        return self.internals.kind

    def mark_lost(self, reason: str) -> None:
        """Record that the lock may be held by someone else now; run the lost callbacks once."""
        with self._lock:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
        logger.warning("lock %s lost (token %d): %s", self.node, self.token, reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("lock-lost callback failed for %s", self.node)

    def on_lost(self, callback: LostCallback) -> None:
        with self._lock:
            if self.lost_reason is None:
                self._callbacks.append(callback)
                return
            reason = self.lost_reason
        callback(reason)

    def remove_callback(self, callback: LostCallback) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class Lease:
    """A lock granted by :meth:`Mutex.acquire` or a read/write side of :class:`ReadWriteLock`.

    Attributes:
        token: fencing token, the ``czxid`` of the lease's own znode: a 64-bit id that strictly
            rises with every create in the ensemble, so successive exclusive grants of one lock
            carry rising tokens. Pass it to the resource you protect and have the resource refuse
            a token lower than one it already accepted.
        node: full path of the lease's own contender znode.
        path: the lock's path.

    A lease is *held* until it is released or lost. It is lost when the session policy of
    :mod:`celery_zklock.session` decides the ZooKeeper session behind its node may be gone; from
    then on another process may hold the lock. Use :meth:`check` at safe points and
    :meth:`on_lost` to be told.

    Used as a context manager the lease is released on exit; if it was lost while the block ran
    and no other exception is propagating, ``__exit__`` raises :class:`LockLost`, because the
    block did not run under the lock.
    """

    def __init__(self, hold: Hold) -> None:
        self._hold = hold
        self._released = False

    @property
    def token(self) -> int:
        return self._hold.token

    @property
    def node(self) -> str:
        return self._hold.node

    @property
    def path(self) -> str:
        return self._hold.internals.path

    @property
    def kind(self) -> Kind:
        return self._hold.kind

    @property
    def released(self) -> bool:
        return self._released

    @property
    def lost(self) -> bool:
        """True once the session behind the lease was declared lost (stays true)."""
        return self._hold.lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        return self._hold.lost_reason

    @property
    def held(self) -> bool:
        """True while neither released nor lost."""
        return not self._released and not self.lost

    def check(self) -> None:
        """Raise :class:`LockLost` if the lease was lost; for code that checks at safe points."""
        reason = self._hold.lost_reason
        if reason is not None:
            raise LockLost(f"lock {self.path} lost (token {self.token}): {reason}")

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(reason)`` once when the lease is lost (now, if it already is).

        Callbacks run on the thread that detects the loss (kazoo's or the policy timer's): keep
        them short and non-blocking.
        """
        self._hold.on_lost(callback)

    def remove_on_lost(self, callback: LostCallback) -> None:
        self._hold.remove_callback(callback)

    def release(self) -> None:
        """Release the lease. Idempotent; never deletes another contender's node.

        The node is deleted when the last reentrant lease on it is released. If the session
        that created the node is no longer the client's session, nothing is deleted (the node went
        with its session) and the lease is marked lost. While the connection is suspended the
        delete is retried until the session policy would declare the lease lost; after that the
        delete is left to run when the client reconnects, if the session survived.
        """
        if self._released:
            return
        self._released = True
        self._hold.internals.release(self._hold)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
        if exc_type is None:
            self.check()

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<Lease {self.node} token={self.token} {state}>"
