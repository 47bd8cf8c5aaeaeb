"""One gated key's line of held messages, and when its head may go to the pool: pure, no I/O.

The gate (:mod:`celery_zklock.worker.gate.gate`) keeps a :class:`KeyLine` per lock path with
messages held in its worker: the held messages in arrival order, the ones this worker already
handed to its pool (``sent``, until their run ends, or releases the node the gate named as the
holder: :meth:`KeyLine.forget_released`), and the path's contender queue as last read
(``queue``, None until read). :func:`may_enter` is the dispatch rule: the lock's own predicate
(:func:`~celery_zklock.locks.contenders.first_blocker`) says whether a new contender would be
granted now, and what this worker already sent and has not yet seen in the queue counts as if it
were there, so a lock that frees lets at most one held writer per worker through: a message
waits in a pool slot only when another worker's run took the lock first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_zklock.locks.contenders import Contender, LockKind, first_blocker


@dataclass(eq=False)
class Held:
    """A message held at the gate: its worker ``request``, the ``kind`` of lock its run asks
    for, and three instants on this host's wall clock: ``due``, when it reached the gate (its
    receipt, or its ETA when that came later: its ``lock_timeout`` counts from here, carried to
    the run), ``timeout_at`` (None: no ``lock_timeout``) when it goes to the pool to apply
    ``lock_on_timeout``, and ``bound_at``, when it goes back to the broker (the broker's
    redelivery bound, counted from the worker's *receipt*, ETA waits included).
    ``raised_prefetch``: holding it raised the worker's prefetch; ``told``: its
    ``task-lock-waiting`` event was sent; ``waits``: its call waits when busy (else it is held
    only while ZooKeeper is away, and goes to the pool at its turn, whoever holds the lock)."""

    request: Any
    kind: LockKind
    due: float
    bound_at: float = float("inf")
    timeout_at: float | None = None
    raised_prefetch: bool = False
    told: bool = False
    waits: bool = True
    rides_out: bool = True
    """Its call rides a ZooKeeper outage out here (``lock_on_unavailable="wait"``); else, while
    ZooKeeper is away, it goes to the pool at the first free slot, where its run applies its
    policy (``retry``, ``raise``) at once."""
    not_before: float = 0.0
    """It may not go to the pool before this instant (a call sent back by its run waits for
    the others sent back with it, so that the first made goes first)."""
    behind_itself: bool = False
    """It was held behind a run of its own task id, of an attempt not before its own (its
    original, a resend's, or another copy): its run looks whether that call ended before it
    runs the body (:attr:`KeyLine.holder`)."""
    go: bool = False
    """Its run decides now (its ``lock_timeout`` ran out, the outage budget passed, its key
    could not be read): it goes to the pool at the first free slot, whoever holds the lock and
    whether ZooKeeper answers, and stays held (its broker bound still runs) until then."""

    @property
    def next_at(self) -> float:
        """The first instant at which the gate must act on this message by itself."""
        return self.bound_at if self.timeout_at is None else min(self.bound_at, self.timeout_at)


def may_enter(kind: LockKind, queue: Sequence[Contender], sent: Collection[LockKind]) -> bool:
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
    sent: dict[Any, LockKind] = field(default_factory=dict)
    """Request -> the kind of lock its run asks for, of the runs sent to the pool, in order."""
    queue: list[Contender] | None = None
    watched: bool = False
    reading: bool = False
    read_again: bool = False
    blocker: str | None = None
    """The node the head of the line waits for, as last looked up."""
    holder: str | None = None
    """That node's task id ("" when it is not a task run's), once read."""
    named: str | None = None
    """The node ``holder`` was read from."""
    holder_retries: int = 0
    """The attempt of that node's run (its identity's retries)."""

    def add(self, held: Held) -> None:
        """Put ``held`` in the line by when it reached a gate first: behind every message due
        no later (a message sent back by its run keeps its first place)."""
        if not self.held or self.held[-1].due <= held.due:
            self.held.append(held)
            return
        at = next(i for i, other in enumerate(self.held) if other.due > held.due)
        self.held.insert(at, held)

    def note_copies(self, held: Iterable[Held]) -> None:
        """Mark each of ``held`` that waits behind a run of its own call, as named
        (:attr:`Held.behind_itself`)."""
        for one in held:
            task_id, retries = attempt_of(one.request)
            if task_id == self.holder and self.holder_retries >= retries:
                one.behind_itself = True

    @property
    def idle(self) -> bool:
        """Nothing held and nothing sent: the gate can forget this key."""
        return not self.held and not self.sent

    @property
    def going(self) -> bool:
        """A held message goes at the first free slot (:attr:`Held.go`)."""
        return any(held.go for held in self.held)

    def forget_ended(self, running: Container[Any]) -> None:
        """Drop the sent runs whose request is not in ``running`` (their run has ended)."""
        for request in list(self.sent):
            if request not in running:
                del self.sent[request]

    def forget_released(self) -> None:
        """Drop the sent run that held the node ``holder`` names once that node is gone from
        ``queue``: the run released its lock (it may still be finishing, storing its result),
        so the next held message need not wait for its end, which would let another worker's
        message take the lock first at each release of this worker's."""
        if not self.holder or self.named is None or self.queue is None:
            return
        if any(contender.name == self.named for contender in self.queue):
            return
        self.named = None  # once: a later run of the same task id (a retry) is another run
        for request in list(self.sent):
            if request.id == self.holder:
                del self.sent[request]

    def head_ready(self, now: float = float("inf")) -> bool:
        """Whether the head of the line may go to the pool at ``now`` (see :func:`may_enter`)."""
        if not self.held or self.queue is None:
            return False
        head = self.held[0]
        if head.not_before > now:
            return False
        return not head.waits or may_enter(head.kind, self.queue, self.sent.values())

    def next_ready(self, now: float = float("inf")) -> Held | None:
        """The held message to send to the pool next at ``now``: the first one that goes
        (:attr:`Held.go`), else the head if :meth:`head_ready`; None if none may go yet."""
        for held in self.held:
            if held.go:
                return held
        return self.held[0] if self.head_ready(now) else None

    def take_due(self, now: float, timeouts: bool = True) -> list[Held]:
        """Act on the held messages due at ``now``: those whose ``lock_timeout`` ran out go
        (:attr:`Held.go`: the run applies ``lock_on_timeout``), unless not ``timeouts``; from
        the first one whose broker bound came, that one and every one behind it are taken and
        returned (back to the broker together, in line order, so that none overtakes another
        of its key)."""
        back_from = next((i for i, h in enumerate(self.held) if h.bound_at <= now), None)
        to_broker: list[Held] = []
        if back_from is not None:
            while len(self.held) > back_from:
                to_broker.append(self.held.pop())
            to_broker.reverse()
        for held in self.held:
            if timeouts and held.timeout_at is not None and held.timeout_at <= now:
                held.go = True
        return to_broker


def attempt_of(request: Any) -> tuple[str, int]:
    """The attempt a worker's ``Request`` carries: its task id and its retries."""
    return request.id, request.request_dict.get("retries") or 0
