"""The contender queue as data: parsing child names and deciding who holds the lock.

Everything here is pure (no ZooKeeper I/O), so the decision can be tested exhaustively.

A lock is a parent znode whose children are ephemeral sequential *contender* nodes. The
names follow Apache Curator so Java services and Python workers can share a lock:

- ``_c_<uuid>-lock-<seq>``      Curator ``InterProcessMutex`` and our :class:`Mutex`
- ``_c_<uuid>-__WRIT__<seq>``   Curator ``InterProcessReadWriteLock`` write side
- ``_c_<uuid>-__READ__<seq>``   Curator ``InterProcessReadWriteLock`` read side

Contenders written by kazoo's recipes (``<hex>__lock__<seq>``, ``<hex>__rlock__<seq>``) on the
same path are recognised and respected too. Contenders are ordered by the integer sequence
ZooKeeper appended, never by the whole name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["read", "write"]

#: Marker written before the sequence number, and whether it excludes everyone ("write").
MUTEX_MARKER = "lock-"
READ_MARKER = "__READ__"
WRITE_MARKER = "__WRIT__"
_KIND_OF_MARKER: dict[str, Kind] = {
    MUTEX_MARKER: "write",
    WRITE_MARKER: "write",
    READ_MARKER: "read",
    "__lock__": "write",  # kazoo Lock / WriteLock
    "__rlock__": "read",  # kazoo ReadLock
}
# The marker is the one adjacent to the trailing sequence digits; a greedy prefix finds it.
_CHILD = re.compile(
    r"^(?P<prefix>.*)(?P<marker>__READ__|__WRIT__|__rlock__|__lock__|lock-)(?P<seq>\d+)$"
)
# Children that end in a sequence but carry no known marker are still somebody's contender:
# they are treated as exclusive so that we never run beside a lock we do not understand.
_UNKNOWN_SEQUENTIAL = re.compile(r"^(?P<prefix>.*?)(?P<seq>\d{10})$")

PROTECTED_PREFIX = "_c_"


@dataclass(frozen=True)
class LockKind:
    """What one lock kind writes and asks for: the node-name ``marker`` before the sequence
    number, and the access ``kind`` that selects the predicate ("write" excludes everyone,
    "read" excludes writers only)."""

    marker: str
    kind: Kind


#: Curator ``InterProcessMutex`` / our :class:`~celery_zklock.Mutex`.
MUTEX = LockKind(MUTEX_MARKER, "write")
#: Curator ``InterProcessReadWriteLock``, read side.
READ = LockKind(READ_MARKER, "read")
#: Curator ``InterProcessReadWriteLock``, write side.
WRITE = LockKind(WRITE_MARKER, "write")


def protected_prefix(uuid: str) -> str:
    """The name prefix Curator's protected mode writes: ``_c_<uuid>-``.

    ``uuid`` must be the canonical 36-character form (``str(uuid.uuid4())``): Curator's helpers
    assume that fixed length.
    """
    return f"{PROTECTED_PREFIX}{uuid}-"


@dataclass(frozen=True, order=True)
class Contender:
    """One contender node: its sequence number, name and the kind of access it asks for."""

    seq: int
    name: str
    kind: Kind


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
    parsed = (parse_child(name) for name in children)
    return sorted(c for c in parsed if c is not None)


@dataclass(frozen=True)
class Decision:
    """What a contender learns from one look at the queue.

    ``holds`` is true when the lock is granted; otherwise ``watch`` names the single node whose
    deletion may change the answer, and which the contender must watch (herd-free waiting).
    """

    holds: bool
    watch: str | None = None


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


def decide(queue: Sequence[Contender], our_name: str, kind: Kind) -> Decision:
    """Decide for our node ``our_name`` in ``queue`` (as returned by :func:`queue_of`).

    Raises:
        LookupError: our node is not in the queue (it was deleted, e.g. its session expired).
    """
    for index, contender in enumerate(queue):
        if contender.name == our_name:
            if kind == "write":
                return exclusive_decision(queue, index)
            return shared_decision(queue, index)
    raise LookupError(f"our contender node {our_name!r} is not among the children")
