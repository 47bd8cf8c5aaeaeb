"""The contender queue as data: parsing child names and deciding who holds the lock.

Everything here is pure (no ZooKeeper I/O), so the decision can be tested exhaustively.

A lock is a parent znode whose children are ephemeral sequential *contender* nodes. The
names follow Apache Curator so Java services and Python workers can share a lock:

- ``_c_<uuid>-lock-<seq>``      Curator ``InterProcessMutex`` and our :class:`Mutex`; also
  Curator's ``InterProcessSemaphore`` (v1) and our :class:`Semaphore`, whose nodes are named
  like a mutex's: a semaphore is told apart by its limit, not by its nodes
- ``_c_<uuid>-__WRIT__<seq>``   Curator ``InterProcessReadWriteLock`` write side
- ``_c_<uuid>-__READ__<seq>``   Curator ``InterProcessReadWriteLock`` read side
- ``_c_<uuid>-latch-<seq>``     Curator ``LeaderLatch`` and our :class:`LeaderLatch`: the first
  contender leads (an exclusive queue)

Contenders written by kazoo's recipes (``<hex>__lock__<seq>``, ``<hex>__rlock__<seq>``) on the
same path are recognised and respected too. Contenders are ordered by the integer sequence
ZooKeeper appended, never by the whole name.

Users name a lock kind by its :data:`LockMode`; :func:`lock_kind` maps it to the
:class:`LockKind` a queue contends with, :attr:`Contender.mode` a contender's :data:`Kind` back.

A semaphore's limit ``N`` is stored in the data of the lock's parent node (``max_leases=N``,
:func:`limit_data`), so that contenders disagreeing on ``N`` are caught
(:func:`limit_agreement`) instead of each counting to its own ``N``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, get_args

from kazoo.protocol.states import ZnodeStat

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.identity import Identity, parse_identity

Kind = Literal["read", "write", "lease"]
"""The access a contender asks for: ``write`` excludes everyone, ``read`` excludes writers only,
``lease`` is one of a semaphore's ``N`` leases. Parsed nodes are ``read`` or ``write`` only (a
semaphore's nodes are named like a mutex's); ``lease`` is what a :class:`LockKind` asks for."""

#: Marker written before the sequence number, and whether it excludes everyone ("write").
MUTEX_MARKER = "lock-"
LATCH_MARKER = "latch-"
READ_MARKER = "__READ__"
WRITE_MARKER = "__WRIT__"
_KIND_OF_MARKER: dict[str, Kind] = {
    MUTEX_MARKER: "write",
    LATCH_MARKER: "write",
    WRITE_MARKER: "write",
    READ_MARKER: "read",
    "__lock__": "write",  # kazoo Lock / WriteLock
    "__rlock__": "read",  # kazoo ReadLock
}
# The marker is the one adjacent to the trailing sequence digits; a greedy prefix finds it.
_CHILD = re.compile(
    r"^(?P<prefix>.*)(?P<marker>__READ__|__WRIT__|__rlock__|__lock__|lock-|latch-)(?P<seq>\d+)$"
)
# Children that end in a sequence but carry no known marker are still somebody's contender:
# they are treated as exclusive so that we never run beside a lock we do not understand.
_UNKNOWN_SEQUENTIAL = re.compile(r"^(?P<prefix>.*?)(?P<seq>\d{10})$")

PROTECTED_PREFIX = "_c_"

UNREAD: Final = Identity(ours=False)
"""The identity of a contender whose node was not read: nobody's, as a foreign node's."""


@dataclass(frozen=True)
class LockKind:
    """What one lock kind writes and asks for: the node-name ``marker`` before the sequence
    number, the access ``kind`` (:data:`Kind`) that selects the predicate, and ``limit``: ``N``
    for "lease" (a whole number >= 1), None for the others. Raises ValueError otherwise."""

    marker: str
    kind: Kind
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "lease":
            check_limit(self.limit)
        elif self.limit is not None:
            raise ValueError(f"only a 'lease' lock kind has a limit, not {self.kind!r}")


#: Curator ``InterProcessMutex`` / our :class:`~celery_zklock.Mutex`.
MUTEX = LockKind(MUTEX_MARKER, "write")
#: Curator ``LeaderLatch`` / our :class:`~celery_zklock.LeaderLatch`: the first contender leads.
LATCH = LockKind(LATCH_MARKER, "write")
#: Curator ``InterProcessReadWriteLock``, read side.
READ = LockKind(READ_MARKER, "read")
#: Curator ``InterProcessReadWriteLock``, write side.
WRITE = LockKind(WRITE_MARKER, "write")


def check_limit(limit: object) -> int:
    """Return ``limit`` if it is a whole number >= 1 (not a bool), else raise ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"a semaphore's max_leases must be a whole number >= 1, got {limit!r}")
    return limit


LockMode = Literal["exclusive", "shared", "semaphore"]
"""A lock kind as users name it (``lock_mode``, ``celery zklock locks``): ``exclusive`` asks for
"write" access, ``shared`` for "read", ``semaphore`` for one of ``limit`` "lease"s."""
LOCK_MODES: Final[tuple[LockMode, ...]] = get_args(LockMode)
_MODE_OF_KIND: dict[Kind, LockMode] = {"write": "exclusive", "read": "shared", "lease": "semaphore"}


def lock_kind(mode: LockMode, limit: int | None = None) -> LockKind:
    """What a lock of ``mode`` contends for: the write side of a read-write lock
    (``exclusive``), its read side (``shared``), or one of ``limit`` leases (``semaphore``, in
    Curator's ``InterProcessSemaphore`` v1 layout; ValueError without a whole ``limit`` >= 1)."""
    if mode == "semaphore":
        return LockKind(MUTEX_MARKER, "lease", limit)
    return WRITE if mode == "exclusive" else READ


def protected_prefix(uuid: str) -> str:
    """The name prefix Curator's protected mode writes: ``_c_<uuid>-``.

    ``uuid`` must be the canonical 36-character form (``str(uuid.uuid4())``): Curator's helpers
    assume that fixed length.
    """
    return f"{PROTECTED_PREFIX}{uuid}-"


@dataclass(frozen=True, order=True)
class Contender:
    """One contender node: its sequence number, name and the kind of access it asks for, and,
    once its node was read (:func:`read_contender`), what the node holds: the
    :class:`~celery_zklock.locks.identity.Identity` in its data, its ``token`` (``czxid``, the
    fencing token), when it was ``created`` (Unix time, the server's clock) and the ``session``
    that owns it. Until then the identity is :data:`UNREAD` and the numbers are 0. Only
    sequence, name and kind take part in comparisons: the queue order is by sequence."""

    seq: int
    name: str
    kind: Kind
    identity: Identity = field(default=UNREAD, compare=False)
    token: int = field(default=0, compare=False)
    created: float = field(default=0.0, compare=False)
    session: int = field(default=0, compare=False)

    @property
    def task_id(self) -> str | None:
        """The task id of the run that made the node (None if unread or not a run's node)."""
        return self.identity.task_id

    @property
    def retries(self) -> int:
        """The retries of the run that made the node (0 if unread or not a run's node)."""
        return self.identity.retries

    @property
    def mode(self) -> LockMode:
        """``exclusive`` (write), ``shared`` (read) or ``semaphore`` (lease)."""
        return _MODE_OF_KIND[self.kind]

    def age(self, now: float) -> float:
        """Seconds since the node was created, at Unix time ``now`` (never negative)."""
        return max(0.0, now - self.created)


def read_contender(contender: Contender, data: bytes | None, stat: ZnodeStat) -> Contender:
    """``contender`` with what its node holds, from the node's ``data`` and ``stat``: the one
    way a read contender node becomes a record (:func:`~celery_zklock.locks.queue.read_queues`
    reads them)."""
    return replace(
        contender,
        identity=parse_identity(data),
        token=int(stat.czxid),
        created=stat.ctime / 1000.0,
        session=int(stat.ephemeralOwner),
    )


def parse_child(name: str) -> Contender | None:
    """Parse one child name of a lock parent; ``None`` for a child that is not a contender."""
    match = _CHILD.match(name)
    if match is not None:
        return Contender(int(match["seq"]), name, _KIND_OF_MARKER[match["marker"]])
    match = _UNKNOWN_SEQUENTIAL.match(name)
    if match is not None:
        return Contender(int(match["seq"]), name, "write")
    return None


def queue_of(children: Iterable[str]) -> list[Contender]:
    """The contenders among ``children``, in grant order (ascending sequence number)."""
    contenders = []
    for name in children:
        contender = parse_child(name)
        if contender is not None:
            contenders.append(contender)
    contenders.sort()
    return contenders


@dataclass(frozen=True)
class Decision:
    """What a contender learns from one look at the queue.

    ``holds`` is true when the lock is granted; otherwise ``watch`` names the single node whose
    deletion may change the answer, and which the contender must watch (herd-free waiting).
    """

    holds: bool
    watch: str | None = None


HOLDS: Final = Decision(True)
"""The decision of a contender at the head of the queue, which holds whatever the lock kind."""


def exclusive_decision(queue: Sequence[Contender], ours: int) -> Decision:
    """Exclusive (mutex, write) predicate: blocked by any lower node; watch the one just before."""
    if ours == 0:
        return Decision(True)
    return Decision(False, queue[ours - 1].name)


def shared_decision(queue: Sequence[Contender], ours: int) -> Decision:
    """Shared (read) predicate: blocked only by a lower write node; watch the nearest one."""
    for index in range(ours - 1, -1, -1):
        if queue[index].kind == "write":
            return Decision(False, queue[index].name)
    return Decision(True)


def lease_decision(queue: Sequence[Contender], ours: int, limit: int) -> Decision:
    """Semaphore predicate (Curator ``InterProcessSemaphore`` v1): the first ``limit`` contenders
    hold, whatever their kind; a later one watches the node ``limit`` places ahead of it, which
    no other contender watches (herd-free).

    The price of one watch: a waiter is woken when *that* node goes, not when any holder does. A
    lease released out of queue order leaves its slot unused (and a waiter that may now hold
    asleep) until a node it watches goes; the bound of ``limit`` holders is never exceeded.
    """
    if ours < limit:
        return Decision(True)
    return Decision(False, queue[ours - limit].name)


def decide(
    queue: Sequence[Contender], our_name: str, kind: Kind, limit: int | None = None
) -> Decision:
    """Decide for our node ``our_name`` in ``queue`` (as returned by :func:`queue_of`), asking
    for ``kind`` access; ``limit`` is the semaphore's ``N``, required for "lease" only.

    Raises:
        LookupError: our node is not in the queue (it was deleted, e.g. its session expired).
        ValueError: "lease" without a valid ``limit``, or a ``limit`` with another kind.
    """
    LockKind(MUTEX_MARKER, kind, limit)  # validates the pair
    for index, contender in enumerate(queue):
        if contender.name == our_name:
            if kind == "lease":
                assert limit is not None
                return lease_decision(queue, index, limit)
            if kind == "write":
                return exclusive_decision(queue, index)
            return shared_decision(queue, index)
    raise LookupError(f"our contender node {our_name!r} is not among the children")


def first_blocker(queue: Sequence[Contender], kind: LockKind) -> Contender | None:
    """The contender a new acquire of ``kind`` (queued after all of ``queue``) would wait for
    first, or None if it would be granted at once."""
    if kind.kind == "lease":
        assert kind.limit is not None
        return queue[len(queue) - kind.limit] if len(queue) >= kind.limit else None
    for contender in queue:
        if kind.kind == "write" or contender.kind == "write":
            return contender
    return None


def holding(queue: Sequence[Contender], limit: int | None = None) -> list[Contender]:
    """The contenders of ``queue`` that hold the lock: each one :func:`first_blocker` lets
    through at its place, asking for its own kind, or for one of ``limit`` leases (the ``N`` of
    a semaphore). That is one writer, every reader ahead of the first writer, or a semaphore's
    first ``limit``: always the head of the queue, as whoever follows a waiter waits too."""
    lease = None if limit is None else lock_kind("semaphore", limit)
    held: list[Contender] = []
    for index, contender in enumerate(queue):
        kind = lease if lease is not None else WRITE if contender.kind == "write" else READ
        if first_blocker(queue[:index], kind) is not None:
            break
        held.append(contender)
    return held


# -- a semaphore's limit, in the data of the lock's parent --------------------------------------

LIMIT_FIELD: Final = b"max_leases="


class LimitMismatch(ConfigurationError):
    """Contenders of one semaphore disagree on its limit: ``ours`` against the ``stored`` one
    (from the parent's data; None when that data is not a limit at all)."""

    def __init__(self, path: str, ours: int, stored: int | None, data: bytes) -> None:
        self.path, self.ours, self.stored = path, ours, stored
        if stored is None:
            found = f"data {data[:80]!r} that is not a semaphore limit"
        else:
            found = f"max_leases={stored}, as its other contenders use it"
        super().__init__(
            f"semaphore {path}: this contender has max_leases={ours}, but the lock's node holds "
            f"{found}; every contender of one semaphore must use the same max_leases (change "
            "it on all of them together, or use another path)"
        )


def limit_data(limit: int) -> bytes:
    """What a semaphore with ``limit`` leases stores in its parent's data: ``max_leases=N``."""
    return LIMIT_FIELD + str(check_limit(limit)).encode()


def parse_limit(data: bytes | None) -> int | None:
    """The limit stored in a lock parent's ``data``; None if it holds no limit (or no data)."""
    if not data or not data.startswith(LIMIT_FIELD):
        return None
    digits = data[len(LIMIT_FIELD) :]
    if not digits.isdigit() or digits.startswith(b"0"):
        return None
    return int(digits)


def limit_agreement(path: str, data: bytes | None, limit: int) -> Literal["agreed", "claim"]:
    """What a semaphore contender with ``limit`` does about its parent's ``data``: "agreed" if
    it stores the same limit, "claim" if it has no data yet (store ours, with a versioned write
    so that only one first contender's limit is stored).

    Raises:
        LimitMismatch: the data stores another limit, or is not a limit.
    """
    if not data:
        return "claim"
    stored = parse_limit(data)
    if stored != limit:
        raise LimitMismatch(path, limit, stored, data)
    return "agreed"
