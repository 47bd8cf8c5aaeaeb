"""The leader election of a beat group: every beat contends for one
:class:`~celery_zklock.Mutex` (``<zklock_root>/beat/<name>/leader``) in a background thread
(:class:`Elector`), the holder leads, and a lease is only ever released under the
:class:`SendLock`, never between a send's lease check (:func:`ensure_held`, which raises
:class:`NotLeader`) and the write of its record; a release asked for inside a send (``celery
beat``'s SIGTERM handler) is deferred to the end of that send. How the election hands over and
why the check suffices: ``docs/beat.md``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from celery_zklock.locks import Lease, Mutex
from celery_zklock.locks.lease import HeldLease

logger = logging.getLogger("celery_zklock.beat")

RETRY_DELAY: Final = 1.0
"""Seconds between attempts after ZooKeeper failed the election or a term's start."""


class NotLeader(BaseException):
    """This beat may not send (its lease is lost, or another leader wrote the state).

    A ``BaseException``: it must pass through the ``except Exception`` with which Celery's
    ``Scheduler.apply_entry`` logs and swallows a failed send, up to :meth:`LeaderScheduler.tick`.
    """


def ensure_held(lease: HeldLease) -> None:
    """Raise :class:`NotLeader` unless ``lease`` is held: neither released nor lost, ``lost``
    being read from the lease clock (:attr:`Lease.lost <celery_zklock.Lease.lost>`)."""
    if not lease.held:
        reason = lease.lost_reason or "it was released"
        raise NotLeader(f"the leader lease is not held: {reason}")


class SendLock:
    """The lock held from each send's lease check until its record is written, and by whoever
    releases the lease (so never between the two). Reentrant.

    A release asked for by the thread that holds it (``celery beat``'s SIGTERM handler runs
    ``close()`` on the main thread, wherever that thread is: possibly inside a send) cannot
    wait for it, and must not go ahead either: :meth:`defer` runs it when that thread lets go
    of its outermost hold, after the send it interrupted is recorded.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0  # changed only by the owner, while it holds _lock
        self._deferred: list[Callable[[], None]] = []

    def __enter__(self) -> SendLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._depth == 1:
                while self._deferred:
                    call = self._deferred.pop(0)
                    try:
                        call()
                    except Exception:
                        logger.exception("beat: a release deferred to the end of a send failed")
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
            self._lock.release()

    @property
    def held_here(self) -> bool:
        """True if the calling thread holds the lock."""
        return self._depth > 0 and self._owner == threading.get_ident()

    def defer(self, call: Callable[[], None]) -> None:
        """Run ``call`` when the calling thread, which holds the lock, lets go of it."""
        if not self.held_here:
            raise RuntimeError("SendLock.defer called by a thread that does not hold it")
        self._deferred.append(call)


class Elector(threading.Thread):
    """Contends for the leader lock in the background, for the life of the beat.

    It blocks in :meth:`Mutex.acquire` while a standby, publishes the granted lease
    (:attr:`lease`, :attr:`changed`), and releases it when it is lost, resigned or the beat
    stops (under ``send_lock``, so never between a send's check and its publish), then
    contends again.
    """

    def __init__(self, mutex: Mutex, identity: str, send_lock: SendLock, recheck: float) -> None:
        super().__init__(name="zklock-beat-election", daemon=True)
        self.changed = threading.Event()
        """Set whenever :attr:`lease` changes."""
        self._mutex = mutex
        self._identity = identity
        self._send_lock = send_lock
        self._recheck = recheck
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._resigning: object = None
        self._stopping = threading.Event()
        self._wake = threading.Event()

    @property
    def lease(self) -> Lease | None:
        """The lease while this beat holds the leader lock, else None."""
        with self._lock:
            return self._lease

    def resign(self, lease: object) -> None:
        """Release ``lease`` (if it is still the current one) and contend again."""
        with self._lock:
            if self._lease is lease:
                self._resigning = lease
        self._wake.set()

    def stop(self) -> None:
        """Stop contending and release a held lease now (on the calling thread)."""
        self._stopping.set()
        self._wake.set()
        with self._send_lock:
            with self._lock:
                lease, self._lease = self._lease, None
            if lease is not None:
                lease.release()
                logger.info("beat: resigned the leadership of %s", self._mutex.path)
        self.changed.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                lease = self._mutex.acquire(data=self._identity.encode())
            except Exception as exc:  # ZooKeeper unreachable, or the client stopped at close
                if self._stopping.is_set():
                    return
                logger.warning(
                    "beat: election on %s failed, trying again: %r", self._mutex.path, exc
                )
                self._stopping.wait(RETRY_DELAY)
                continue
            self._wake.clear()
            lease.on_lost(lambda _reason: self._wake.set())
            with self._lock:
                stopping = self._stopping.is_set()
                if not stopping:
                    self._lease = lease
            if stopping:
                lease.release()
                return
            self.changed.set()
            logger.info("beat: elected leader of %s (token %d)", self._mutex.path, lease.token)
            while not (self._stopping.is_set() or lease.lost or self._resigning is lease):
                self._wake.wait(self._recheck)
                self._wake.clear()
            resigned = self._resigning is lease
            with self._send_lock:
                with self._lock:
                    if self._lease is lease:
                        self._lease = None
                    self._resigning = None
                lease.release()
            self.changed.set()
            if resigned and not self._stopping.is_set():
                self._stopping.wait(RETRY_DELAY)
