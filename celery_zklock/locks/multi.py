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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType

from kazoo.client import KazooClient

from celery_zklock.errors import LossCode
from celery_zklock.locks.calls import Deadline
from celery_zklock.locks.contenders import MUTEX, Kind, LockKind
from celery_zklock.locks.lease import Lease, LostCallback
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.queue import validate_lock_path

__all__ = ["MultiLease", "MultiLock"]


class MultiLease:
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
        for lease in reversed(self.leases):
            lease.release()

    def __enter__(self) -> MultiLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

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

        Returns the :class:`MultiLease`; None only for a try (``blocking=False``) that found a
        lock busy. Raises LockTimeout when the deadline passes first, and whatever a lock's
        acquire raises (ZooKeeperUnavailable...); in every case but a returned lease, what was
        taken is released first.
        """
        deadline = Deadline(timeout)
        taken: list[Lease] = []
        try:
            for lock in self._locks:
                self._last = lock
                lease = lock.acquire(blocking=blocking, timeout=deadline.remaining(), data=data)
                if lease is None:
                    _release_all(taken)
                    return None
                taken.append(lease)
        except BaseException:
            _release_all(taken)
            raise
        return MultiLease(taken)


def _release_all(leases: list[Lease]) -> None:
    for lease in reversed(leases):
        lease.release()
