"""A leader election on one path: :class:`LeaderLatch`, with Apache Curator's ``LeaderLatch``
layout.

Each participant keeps one contender node ``<path>/_c_<uuid>-latch-<seq>`` in the path's queue,
named as Curator's ``LeaderLatch`` names its nodes (Curator sorts them by the sequence after
``latch-``, as we do), so Java services using Curator and Python processes using this class take
part in one election, one leader at a time. The first contender leads.

A latch is a :class:`~celery_zklock.Mutex` of kind
:data:`~celery_zklock.locks.contenders.LATCH` whose lease is held until it is lost or the latch
is closed, contended for by a thread of the latch. So leadership is a
:class:`~celery_zklock.Lease` and ends as a lease ends: by the lease clock
(:mod:`celery_zklock.locks.clock`), a margin *before* the ZooKeeper leader could expire the
session and so elect the next contender; by a session that ended; by an operator's break. A
process paused past its session (SIGSTOP, a long stall) reads :attr:`LeaderLatch.is_leader`
false from the moment it runs again, before any renewal. After a loss the latch takes its node
out of the queue (if it is still there) and joins again at the end.

Where Curator's differs: Curator 5.4 counts leadership lost when its connection is suspended
(no lease clock), and after a reconnect leads again if its node is still first; ours goes to the
end of the queue once its lease was lost, so a contender behind it leads next.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final, Literal

from kazoo.client import KazooClient

from celery_zklock.locks.contenders import LATCH
from celery_zklock.locks.lease import Lease
from celery_zklock.locks.mutex import Mutex
from celery_zklock.zk.calls import Deadline

logger = logging.getLogger("celery_zklock.locks")

LeaderListener = Callable[[bool], None]
"""Told ``True`` when the latch is elected, ``False`` when that leadership ends."""

RETRY_MIN: Final = 0.1
"""Seconds before contending again after ZooKeeper failed an attempt; doubled per failure."""
RETRY_MAX: Final = 5.0
"""The longest pause between two failed attempts."""
RECHECK_MIN: Final = 0.05
"""Shortest wait of the leading thread between two looks at its lease."""


class LeaderLatch:
    """A participant in the leader election on ``path``; at most one participant leads.

    :meth:`start` joins the election (a thread of the latch contends, and contends again after
    every loss), :meth:`close` leaves it. :attr:`is_leader` says whether this participant leads
    now, read from the lease clock at each call; :meth:`await_leader` waits for it; listeners
    (:meth:`add_listener`) are told when leadership begins and ends; :attr:`lease` is the lease
    behind the current leadership (its ``token`` fences the leader's writes: successive
    leaders' tokens rise). ``id`` is stored in the contender node's data, as Curator stores its
    participant id (UTF-8).

    Leadership counts as lost before another participant can be elected: see the module
    docstring. Code that does units of work as leader checks :attr:`is_leader` before each one
    (a unit started just before a loss runs on; fence its writes with the lease's ``token``).

    Raises:
        ValueError: ``path`` is not an absolute znode path.
    """

    def __init__(self, client: KazooClient, path: str, id: str = "") -> None:
        self._mutex = Mutex(client, path, kind=LATCH)
        self._id = id
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._state: Literal["latent", "started", "closed"] = "latent"
        self._version = 0  # rises at every change of state or lease (await_leader's wakeups)
        self._lease: Lease | None = None
        self._listeners: list[LeaderListener] = []
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        return self._mutex.path

    @property
    def id(self) -> str:
        """This participant's id, stored in its contender node."""
        return self._id

    @property
    def is_leader(self) -> bool:
        """True while this participant leads: started, not closed, and its lease held, which is
        read from the lease clock (:attr:`Lease.held <celery_zklock.Lease.held>`)."""
        return self.lease is not None

    @property
    def lease(self) -> Lease | None:
        """The lease of the current leadership while it is held, else None."""
        lease = self._lease
        return lease if lease is not None and lease.held else None

    def start(self) -> None:
        """Join the election: a thread of the latch contends from now until :meth:`close`.

        Raises:
            RuntimeError: the latch was started (or closed) before.
        """
        with self._lock:
            if self._state != "latent":
                raise RuntimeError(f"leader latch {self.path} was started before ({self._state})")
            self._state = "started"
            self._changed_locked()
            thread = self._thread = threading.Thread(
                target=self._run, name=f"zklock-leader-latch {self.path}", daemon=True
            )
        thread.start()

    def await_leader(self, timeout: float | None = None) -> bool:
        """Wait until this participant leads; True if it does, False if ``timeout`` seconds
        passed first (None: no limit), or the latch is not started or is closed (also by
        another thread meanwhile).

        Raises:
            ValueError: a negative timeout.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        deadline = Deadline(timeout)
        while True:
            with self._lock:
                if self._state != "started":
                    return False
                lease, version = self._lease, self._version
            # Read outside our lock: a lease found lost runs its callbacks here.
            if lease is not None and lease.held:
                return True
            with self._changed:
                if self._version != version:
                    continue
                if deadline.expired():
                    return False
                self._changed.wait(deadline.remaining())

    def add_listener(self, listener: LeaderListener) -> None:
        """Call ``listener(True)`` each time this participant is elected and ``listener(False)``
        each time that leadership ends (lost, or the latch closed: then before the node goes).

        Listeners run on the latch's thread, in that order, after :attr:`is_leader` changed:
        keep them short (the latch waits for them; :meth:`close` too). An exception is logged.
        """
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: LeaderListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def close(self) -> None:
        """Leave the election: stop contending, end a leadership (listeners told), delete our
        node. Returns once that is done (a delete ZooKeeper does not answer in time goes on in
        the background, or the node goes with its session). Idempotent; a latch is not started
        again. From a listener it returns at once, and the latch ends after the listener."""
        with self._lock:
            self._state = "closed"
            self._changed_locked()
            thread = self._thread
        self._closed.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> LeaderLatch:
        if self._state == "latent":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "leader" if self.is_leader else self._state
        return f"<LeaderLatch {self.path} id={self._id!r} {role}>"

    # -- the latch's thread ---------------------------------------------------------------
    def _run(self) -> None:
        delay = RETRY_MIN
        failing = False
        while not self._closed.is_set():
            try:
                lease = self._mutex.acquire(data=self._id.encode(), cancel=self._closed.is_set)
            except Exception as exc:  # ZooKeeper failed or is unreachable: contend again
                if self._closed.is_set():
                    return
                log = logger.debug if failing else logger.warning
                log("leader latch %s: contending failed, trying again: %r", self.path, exc)
                failing = True
                self._closed.wait(delay)
                delay = min(2 * delay, RETRY_MAX)
                continue
            failing, delay = False, RETRY_MIN
            self._lead(lease)

    def _lead(self, lease: Lease) -> None:
        """Publish ``lease`` as the leadership, wait until it is lost or the latch closes, then
        end it: unpublished, listeners told, node deleted (in that order)."""
        self._wake.clear()
        lease.on_lost(self._on_lost)
        with self._lock:
            closing = self._state == "closed"
            if not closing:
                self._lease = lease
                self._changed_locked()
        if not closing:
            logger.info("leader latch %s: elected (token %d)", self.path, lease.token)
            self._tell(True)
            while not self._closed.is_set() and lease.held:
                # Woken by a loss (on_lost) or close; else when the lease would run out
                # unrenewed, to read the clock itself (a paused process runs no timer).
                self._wake.wait(max(RECHECK_MIN, lease.valid_for))
                self._wake.clear()
            with self._lock:
                self._lease = None
                self._changed_locked()
            if lease.lost:
                logger.warning("leader latch %s: leadership lost: %s", self.path, lease.lost_reason)
            else:
                logger.info("leader latch %s: resigned (closed)", self.path)
            self._tell(False)
        lease.remove_on_lost(self._on_lost)
        lease.release()

    def _on_lost(self, _reason: str) -> None:
        self._wake.set()

    def _tell(self, leading: bool) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(leading)
            except Exception:
                logger.exception("leader latch %s: a listener failed", self.path)

    def _changed_locked(self) -> None:
        self._version += 1
        self._changed.notify_all()
