"""One gated key's line of held messages, and when its head may go to the pool: pure, no I/O.

The gate (:mod:`celery_zklock.gate.gate`) keeps a :class:`KeyLine` per lock path with messages
held in its worker: the held messages in arrival order, the ones this worker already handed to
its pool (``sent``, until their run ends), and the path's contender queue as last read
(``queue``, None until read). :func:`may_enter` is the dispatch rule: the lock's own predicate
(:func:`~celery_zklock.locks.contenders.first_blocker`) says whether a new contender would be
granted now, and what this worker already sent and has not yet seen in the queue counts as if it
were there, so a lock that frees lets at most one held writer per worker through: a message
waits in a pool slot only when another worker's run took the lock first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_zklock.locks.contenders import Contender, LockKind, first_blocker


@dataclass(eq=False)
class Held:
    """A message held at the gate: its worker ``request``, the ``kind`` of lock its run asks
    for, when it was received (``received``: this host's wall clock, carried to the run so that
    its ``lock_timeout`` counts from here), and whether holding it raised the worker's prefetch
    (``raised_prefetch``); ``expiry`` is the timer entry that hands it over at its timeout;
    ``told``: its ``LOCK_WAITING`` state was stored."""

    request: Any
    kind: LockKind
    received: float
    raised_prefetch: bool = False
    expiry: Any = None
    told: bool = False


def may_enter(kind: LockKind, queue: Sequence[Contender], sent: Sequence[LockKind]) -> bool:
    """Whether a run asking for ``kind`` would be granted now, in a queue of ``queue`` with this
    worker's ``sent`` runs (dispatched, not yet ended) still to come.

    A writer needs a free lock and nothing sent; a reader needs no writer queued or sent; a
    semaphore lease needs fewer than its limit queued and fewer than its limit sent (a sent run
    may already be in ``queue``: counting both would leave leases unused).
    """
    if first_blocker(queue, kind) is not None:
        return False
    if kind.kind == "write":
        return not sent
    if kind.kind == "read":
        return all(other.kind == "read" for other in sent)
    assert kind.limit is not None
    return len(sent) < kind.limit


@dataclass(eq=False)
class KeyLine:
    """The held messages of one lock ``path`` in one worker; see the module docstring."""

    path: str
    held: deque[Held] = field(default_factory=deque)
    sent: list[tuple[Any, LockKind]] = field(default_factory=list)
    queue: list[Contender] | None = None
    watched: bool = False
    reading: bool = False
    read_again: bool = False
    blocker: str | None = None
    """The node the head of the line waits for, as last looked up."""
    holder: str | None = None
    """That node's task id ("" when it is not a task run's), once read."""

    def forget_ended(self, running: Callable[[Any], bool]) -> None:
        """Drop the sent runs for which ``running(request)`` is false (their run has ended)."""
        self.sent = [(request, kind) for request, kind in self.sent if running(request)]

    def next_ready(self) -> Held | None:
        """Take the head of the line if it may go to the pool now (see :func:`may_enter`)."""
        if not self.held or self.queue is None:
            return None
        head = self.held[0]
        if not may_enter(head.kind, self.queue, [kind for _, kind in self.sent]):
            return None
        self.held.popleft()
        return head

    @property
    def idle(self) -> bool:
        """Nothing held and nothing sent: the gate can forget this key."""
        return not self.held and not self.sent
