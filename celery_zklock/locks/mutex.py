"""The lock front end: :class:`Mutex`, one class for every lock kind (Curator's
``InterProcessMutex``, whose read and write locks are mutexes with another driver).

The front end owns the caller's side of a lock: arguments and deadlines, reentrancy per thread
(Curator's ``threadData``), handing out a :class:`Lease` only under a fresh lease clock, and the
release's verdict. The queue (:mod:`celery_zklock.locks.queue`) does the ZooKeeper I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Literal, overload
from uuid import uuid4

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    KazooException,
    NoNodeError,
    SessionExpiredError,
)

from celery_zklock.errors import LossCode, ZkLockError, ZooKeeperUnavailable
from celery_zklock.locks.breaks import DELETED
from celery_zklock.locks.contenders import MUTEX, PROTECTED_PREFIX, Kind, LockKind
from celery_zklock.locks.context import ClientContext
from celery_zklock.locks.lease import Hold, Lease
from celery_zklock.locks.queue import ContenderQueue, SessionGone
from celery_zklock.zk.calls import Deadline, Outage


def _or_cancelled(outage: Outage | None, cancel: Callable[[], bool] | None) -> Outage | None:
    """``outage`` (a deadline's check, or None) that also names a reason once ``cancel()``
    is true."""
    if cancel is None:
        return outage

    def check() -> str | None:
        if cancel():
            return "the acquire was cancelled"
        return None if outage is None else outage()

    return check


class Mutex:
    """A distributed exclusive lock on ``path``: at most one :class:`Lease` exists at a time.

    Contender nodes are ``<path>/_c_<uuid>-lock-<seq>``, as Curator's ``InterProcessMutex``
    writes them, so Java services using Curator and Python processes using this class exclude
    each other on the same path. The parent ``path`` and its missing ancestors are created as
    container nodes, which ZooKeeper removes once empty. ``kind`` selects another lock kind on
    the same queue (the sides of :class:`ReadWriteLock` are mutexes of kind ``READ``/``WRITE``).

    Reentrant per thread: a thread that holds the lock and acquires it again (through any lock
    object on the same client and path) gets another lease on the same node; the node is
    deleted when every such lease is released.
    """

    def __init__(self, client: KazooClient, path: str, *, kind: LockKind = MUTEX) -> None:
        self._queue = ContenderQueue(client, path, kind)
        self._context: ClientContext = self._queue.context
        #: The lock's path.
        self.path: str = self._queue.path
        #: The access its contenders ask for (:data:`~celery_zklock.locks.contenders.Kind`).
        self.kind: Kind = kind.kind

    @property
    def session_timeout(self) -> float:
        """The negotiated session timeout of this lock's client, in seconds."""
        return self._context.session_timeout

    @property
    def dead_holder_bound(self) -> float:
        """Upper bound, in seconds, on how long the node of a holder whose process died can
        outlive it (see :attr:`LeaseTiming.dead_node_lifetime
        <celery_zklock.locks.clock.LeaseTiming.dead_node_lifetime>`)."""
        return self._context.timing.dead_node_lifetime

    @overload
    def acquire(
        self,
        *,
        blocking: Literal[True] = ...,
        timeout: float | None = ...,
        data: bytes = ...,
        cancel: Callable[[], bool] | None = ...,
    ) -> Lease: ...
    @overload
    def acquire(
        self,
        *,
        blocking: bool,
        timeout: float | None = ...,
        data: bytes = ...,
        cancel: Callable[[], bool] | None = ...,
    ) -> Lease | None: ...
    def acquire(
        self,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        data: bytes = b"",
        cancel: Callable[[], bool] | None = None,
    ) -> Lease | None:
        """Acquire the lock.

        Args:
            blocking: wait for the lock (default). With ``False`` it is a try-lock: one look at
                the queue, then a :class:`Lease` or ``None`` if someone else holds it.
            timeout: seconds to wait for other holders; ``None`` waits without limit. Requests
                already sent are awaited a little longer (a third of the session timeout), so
                ``timeout=0`` is granted a free lock; a try-lock bounds its requests by the
                session timeout.
            data: bytes stored in our contender node (who we are, for operators); Curator
                stores the client's IP there.
            cancel: asked while the acquire waits (for other holders or for an answer), at
                least every :data:`~celery_zklock.zk.calls.WAIT_SLICE` seconds: once it returns
                true the acquire gives up, as at a passed deadline (LockTimeout, or
                ZooKeeperUnavailable while it waited for an answer), leaving no node behind.
                For a thread that must stop waiting when its owner stops
                (:class:`~celery_zklock.LeaderLatch`).

        Returns:
            A :class:`Lease`; ``None`` only for a try-lock that found the lock busy.

        Raises:
            LockTimeout: other holders kept the lock until the deadline.
            ZooKeeperUnavailable: ZooKeeper did not answer in time, or the client has been
                without a connection or an answer for a session timeout during this acquire
                (whatever ``timeout`` is left, even ``None``: see :meth:`ClientContext.outage
                <celery_zklock.locks.context.ClientContext.outage>`), or the client is not
                started (raised at once), or ZooKeeper failed the request.
            ConfigurationError: the negotiated session timeout is below 1 s (see
                :data:`~celery_zklock.locks.clock.MIN_SESSION_TIMEOUT`).
            ValueError: a negative timeout.

        The lease is handed out only under a known negotiated session timeout and a fresh
        lease clock (see :mod:`celery_zklock.locks.clock`). In every outcome other than a
        returned lease - busy, timeout, connection loss, any exception including ones thrown
        asynchronously into the waiting thread - no contender node of this acquire is left
        behind (if ZooKeeper is unreachable at that moment, the node is removed in the
        background, or goes with its session).
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        context = self._context
        context.check_usable()
        thread_id = threading.get_ident()
        # Only this thread adds its own key: if it is not there, no look under the lock can
        # find it.
        if (self.path, thread_id) in context.owned:
            reentered = self._reenter(thread_id)
            if reentered is not None:
                return Lease(reentered, self._release)
        # Two deadlines: ``wait`` for other holders, ``io`` for each request's answer. ``io``
        # also gives up once the client has been without a connection or an answer for a
        # session timeout during this acquire (ClientContext.outage), whatever ``timeout`` is
        # left: every wait of the acquire is bounded by it (a lost connection wakes the wait
        # for other holders, which then waits for answers). A ``cancel`` that returns true
        # ends both.
        outage: Outage | None = partial(context.outage, time.monotonic())
        if cancel is not None:
            outage = _or_cancelled(outage, cancel)
        if timeout is not None:
            wait = Deadline(timeout, _or_cancelled(None, cancel))
            io = Deadline(max(timeout, context.timing.idle_gap), outage)
        elif blocking:
            wait = io = Deadline(None, outage)
        else:  # a try-lock never waits for other holders: one deadline
            wait = io = Deadline(context.timing.session_timeout, outage)
        try:
            if not context.lease_ready:
                context.ensure_timeout_known(io)
            hold = self._acquire_node(blocking, wait, io, thread_id, data)
        except ConnectionClosedError as exc:
            raise ZooKeeperUnavailable(
                f"the kazoo client was stopped while acquiring {self.path}"
            ) from exc
        except KazooException as exc:
            raise ZooKeeperUnavailable(
                f"ZooKeeper failed a request while acquiring {self.path}: {exc!r}"
            ) from exc
        if hold is None:
            return None
        with context.lock:
            context.owned[(self.path, thread_id)] = hold
        context.clock.track(hold)
        return Lease(hold, self._release)

    def _reenter(self, thread_id: int) -> Hold | None:
        context = self._context
        with context.lock:
            hold: Hold | None = context.owned.get((self.path, thread_id))
            if hold is None or hold.lost_reason is not None:
                return None
            held = hold.ours.kind
            if held == "read" and self.kind == "write":
                raise ZkLockError(
                    f"this thread holds a read lock on {self.path} and asked for the write lock: "
                    "upgrading would deadlock; release the read lock first"
                )
            if (held == "lease") != (self.kind == "lease"):
                raise ZkLockError(
                    f"this thread holds a {held} lock on {self.path} and asked for a "
                    f"{self.kind} lock on the same path: a semaphore's path is not a mutex's"
                )
            hold.count += 1
            return hold

    def _acquire_node(
        self, blocking: bool, wait: Deadline, io: Deadline, thread_id: int, data: bytes
    ) -> Hold | None:
        queue, context = self._queue, self._context
        while True:
            prefix = f"{PROTECTED_PREFIX}{uuid4()}-"  # Curator's protected name (protected_prefix)
            try:
                created = queue.enqueue(prefix, io, data)
                granted = queue.await_grant(created, blocking, wait, io)
                if granted:
                    # Handed out only under a clock with a renewal's worth left.
                    context.clock.ensure_fresh(io, self.path)
            except SessionGone:
                continue
            except BaseException:
                # Whether or not the create ran (or is still queued), our node is the one child
                # with this attempt's uuid: remove it before the exception goes on.
                queue.abandon(prefix)
                raise
            if not granted:
                queue.discard(f"{self.path}/{created.ours.name}")
                return None
            ours = created.ours
            if ours.kind != self.kind:  # a semaphore's: "lease", not "write"
                ours = replace(ours, kind=self.kind)
            return Hold(context.clock, self.path, ours, created.epoch, thread_id)

    def _release(self, hold: Hold) -> None:
        """Drop one reentrant count of ``hold``; at zero give the verdict and delete its node."""
        context = self._context
        with context.lock:
            hold.count -= 1
            if hold.count > 0:
                return
            key = (self.path, hold.thread_id)
            if context.owned.get(key) is hold:
                del context.owned[key]
        context.clock.untrack(hold)
        session_id = context.session_id()
        if context.clock.epoch != hold.epoch or session_id not in (hold.ours.session, None):
            hold.mark_lost(
                LossCode.SESSION_EXPIRED,
                "the ZooKeeper session that created the lock node ended before release",
            )
            return
        if time.monotonic() >= context.clock.valid_until:
            hold.mark_lost(
                LossCode.LEASE_CLOCK,
                "the lease clock ran out before release (no answer from the ZooKeeper leader "
                "in time, or the process was paused): another holder may have run meanwhile",
            )
        try:
            self._queue.delete(hold.node, Deadline(context.timing.idle_gap))
        except NoNodeError:
            hold.mark_lost(LossCode.NODE_DELETED, DELETED)
        except SessionExpiredError:
            hold.mark_lost(LossCode.SESSION_EXPIRED, "the ZooKeeper session expired before release")
        except (ZooKeeperUnavailable, KazooException):
            self._queue.abandon_later(hold.node.rsplit("/", 1)[1])

    def participant_nodes(self) -> list[str]:
        """Names of the current contender nodes on this path, in grant order."""
        return self._queue.participant_nodes()
