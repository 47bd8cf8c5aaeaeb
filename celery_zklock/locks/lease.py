"""A granted lock: :class:`Lease`, the user's handle, over :class:`Hold`, the record of our node;
:class:`HeldLease`, what it has in common with a :class:`~celery_zklock.locks.multi.MultiLease`.

A lease is also lost when an operator breaks it: the format of a break request is in
:mod:`celery_zklock.locks.identity`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Protocol, TypeVar

from celery_zklock.errors import LockLost, LossCode
from celery_zklock.locks.contenders import Contender, Kind

logger = logging.getLogger("celery_zklock.locks")

LostCallback = Callable[[str], None]
_Self = TypeVar("_Self", bound="HeldLease")


class Clock(Protocol):
    """The lease clock that times a hold, as the hold sees it
    (:class:`~celery_zklock.locks.clock.LeaseClock`)."""

    #: Until when (``time.monotonic()``) the clock's leases are safe without a renewal.
    valid_until: float

    def expire_if_due(self) -> None:
        """Declare the clock's leases lost now if it ran out."""


class Hold:
    """The record of our contender node while it holds the lock, shared by the leases of
    reentrant acquires.

    ``ours`` is our node's contender record (its name, the kind of lock held, its fencing
    token and the session that owns it), ``node`` its full path. A passive record: the lock
    front end counts acquires and releases on it, and the client's lease clock
    (:class:`~celery_zklock.locks.clock.LeaseClock`) records its loss (:meth:`record_lost`,
    :meth:`tell_lost`) when the session behind the node may be gone or its node was broken. A
    loss is a :class:`~celery_zklock.errors.LossCode` and a text. Its leases add and remove
    the callbacks run then (``callbacks``, under ``lock``).
    """

    def __init__(self, clock: Clock, path: str, ours: Contender, epoch: int, thread_id: int):
        self.clock = clock
        self.path = path
        self.ours = ours
        self.node = f"{path}/{ours.name}"
        self.epoch = epoch
        self.thread_id = thread_id
        self.count = 1
        self.lost_reason: str | None = None
        self.lost_code: LossCode | None = None
        self.callbacks: list[LostCallback] = []
        self.lock = threading.Lock()

    def mark_lost(self, code: LossCode, reason: str) -> None:
        """Record that the lock may be held by someone else now; run the lost callbacks once."""
        self.tell_lost(reason, self.record_lost(code, reason))

    def record_lost(self, code: LossCode, reason: str) -> list[LostCallback] | None:
        """Record the loss (the first code and reason stay) and return the callbacks to run,
        None if it was recorded before. Runs no callback, so the clock may call it under its own
        lock: the loss is then recorded before any other thread can find the lease gone from
        the clock."""
        with self.lock:
            if self.lost_reason is not None:
                return None
            self.lost_code = code
            self.lost_reason = reason
            callbacks, self.callbacks = self.callbacks, []
        return callbacks

    def tell_lost(self, reason: str, callbacks: list[LostCallback] | None) -> None:
        """Log the loss and run ``callbacks`` from :meth:`record_lost` (None: nothing to do)."""
        if callbacks is None:
            return
        logger.warning(
            "lock %s lost (token %d, %s): %s", self.node, self.ours.token, self.lost_code, reason
        )
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("lock-lost callback failed for %s", self.node)


class HeldLease(Protocol):
    """A granted lock of one path (:class:`Lease`) or several (:class:`~celery_zklock.locks.multi.
    MultiLease`), as code taking either (a task's ``self.lock``) uses it: fencing ``tokens`` by
    path (``token`` with one path), ``held``/``lost`` and why, the loss callbacks, :meth:`check`
    and one idempotent :meth:`release`. A context manager: released on exit; a block that ends
    without an exception raises :class:`LockLost` if it was lost meanwhile (it ran unlocked)."""

    @property
    def token(self) -> int: ...
    @property
    def tokens(self) -> dict[str, int]: ...
    @property
    def held(self) -> bool: ...
    @property
    def lost(self) -> bool: ...
    @property
    def lost_reason(self) -> str | None: ...
    @property
    def lost_code(self) -> LossCode | None: ...
    @property
    def valid_for(self) -> float: ...
    def check(self) -> None: ...
    def on_check_raises(self, callback: Callable[[], None] | None) -> None: ...
    def on_lost(self, callback: LostCallback) -> None: ...
    def remove_on_lost(self, callback: LostCallback) -> None: ...
    def release(self) -> None: ...

    def __enter__(self: _Self) -> _Self:
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


class Lease(HeldLease):
    """A lock granted by :meth:`Mutex.acquire` (or a side of :class:`ReadWriteLock`).

    Attributes:
        token: fencing token, the ``czxid`` of the lease's own znode: a 64-bit id that strictly
            rises with every create in the ensemble, so successive exclusive grants of one lock
            carry rising tokens. Pass it to the resource you protect and have the resource refuse
            a token lower than one it already accepted.
        node: full path of the lease's own contender znode.
        path: the lock's path.

    A lease is *held* until it is released or lost. It is lost when the client's lease clock
    (:mod:`celery_zklock.locks.clock`) can no longer prove that the ZooKeeper leader keeps the
    session behind its node alive, a margin *before* the leader could expire that session and
    grant the lock to someone else; and when an operator breaks it (a break request in the
    node's data, see :mod:`celery_zklock.locks.identity`), which the holder learns once the
    lease has been held for a renewal interval. Use :meth:`check` at safe points and
    :meth:`on_lost` to be told. As a context manager: see :class:`HeldLease`.
    """

    def __init__(self, hold: Hold, release: Callable[[Hold], None]) -> None:
        self._hold = hold
        self._release = release
        self._released = False
        self._on_check_raises: Callable[[], None] | None = None
        self.node: str = hold.node
        self.path: str = hold.path
        #: The access the lease holds (:data:`~celery_zklock.locks.contenders.Kind`).
        self.kind: Kind = hold.ours.kind

    @property
    def token(self) -> int:
        return self._hold.ours.token

    @property
    def tokens(self) -> dict[str, int]:
        return {self._hold.path: self._hold.ours.token}

    @property
    def released(self) -> bool:
        return self._released

    @property
    def lost(self) -> bool:
        """True once the lease counts as lost (stays true).

        Read from the clock, not only from the renewer's verdict: a process that was paused
        past the lease's validity sees it lost as soon as it runs again.
        """
        if self._hold.lost_reason is None and not self._released:
            self._hold.clock.expire_if_due()
        return self._hold.lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost, for people; None while it is not."""
        return self._hold.lost_reason if self.lost else None

    @property
    def lost_code(self) -> LossCode | None:
        """Why the lease was lost, as a :class:`~celery_zklock.errors.LossCode`; None while it
        is not."""
        return self._hold.lost_code if self.lost else None

    @property
    def held(self) -> bool:
        """True while neither released nor lost."""
        return not self._released and not self.lost

    @property
    def valid_for(self) -> float:
        """Seconds the lease stays held from now if no renewal is answered meanwhile; 0.0 once
        it is released or lost.

        A bound the lease clock proves from the leader's answers: nobody else can be granted the
        lock before it runs out, unless an operator deletes the node (``break --force``). For
        work that cannot be fenced, start a step only when it leaves room for that step (a
        paused process still outlives it; see docs/concepts.md).
        """
        if not self.held:
            return 0.0
        return max(0.0, self._hold.clock.valid_until - time.monotonic())

    def check(self) -> None:
        """Raise :class:`LockLost` if the lease was lost (as :attr:`lost` tells); for code that
        checks at safe points."""
        hold = self._hold
        if hold.lost_reason is None and not self._released:
            hold.clock.expire_if_due()
        if hold.lost_reason is not None:
            hook = self._on_check_raises
            if hook is not None:
                hook()
            raise LockLost(
                f"lock {self.path} lost (token {self.token}): {self._hold.lost_reason}",
                code=self._hold.lost_code,
            )

    def on_check_raises(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` on the checking thread whenever :meth:`check` is about to raise.

        For a runner that also interrupts the code holding the lease: the task's run stands its
        interruption down, as that code now knows of the loss. One callback; ``None`` removes it.
        """
        self._on_check_raises = callback

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(reason)`` once when the lease is lost (now, if it already is).

        Callbacks run on the thread that detects the loss (the lease clock's renewer or kazoo's
        event thread): keep them short and non-blocking.
        """
        hold = self._hold
        with hold.lock:
            if hold.lost_reason is None:
                hold.callbacks.append(callback)
                return
            reason = hold.lost_reason
        callback(reason)

    def remove_on_lost(self, callback: LostCallback) -> None:
        hold = self._hold
        with hold.lock:
            if callback in hold.callbacks:
                hold.callbacks.remove(callback)

    def release(self) -> None:
        """Release the lease. Idempotent; never deletes another contender's node.

        The node is deleted when the last reentrant lease on it is released. The lease counts
        as lost at release if the lease clock ran out or the session that created the node
        ended before the release began (then another holder may have run beside this one). A
        delete ZooKeeper does not answer in time is left to run in the background (on reconnect
        if need be); the node goes with its session otherwise.
        """
        if self._released:
            return
        self._released = True
        self._release(self._hold)

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<Lease {self.node} token={self.token} {state}>"


def holds_of(leases: Iterable[Lease]) -> list[Hold]:
    """The records behind ``leases``, for a recipe that has their verdict brought up to date
    (:meth:`LeaseClock.confirm_held <celery_zklock.locks.clock.LeaseClock.confirm_held>`)."""
    return [lease._hold for lease in leases]
