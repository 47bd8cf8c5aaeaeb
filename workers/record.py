"""What the fleet's critical sections and fault injections leave behind in Redis.

**Section records.** A locked task appends ``enter`` right after its lock is granted, ``write``
after its fenced write, and ``exit`` right before its lock is released (with how the section
ended: ``outcome``), each one JSON :class:`SectionEvent` pushed (``RPUSH``) to the list
``zklock:run:<run_id>:events``. A fault injector that kills a worker process appends a
``killed`` event to the same list (:meth:`SectionRecorder.record_kill`), and one that takes a
process's leases away where no lease clock can see it coming appends ``paused`` (SIGSTOP) or
``expired`` (its session closed on the server) (:meth:`SectionRecorder.record_forced_loss`).
Redis runs commands one
at a time, so the list is a total order of those events, whatever host or clock they came from:
if two sections really never overlapped, the first one's ``exit`` precedes the second one's
``enter`` in the list. :mod:`workers.checker` replays it. A clean history proves nothing about
runs not recorded.

**Fault records.** :class:`FaultLog` keeps what a fault injector did during a run
(:class:`FaultRecord`), in the list ``zklock:run:<run_id>:faults``.

**The fence** the sections write through is :class:`celery_zklock.fence.RedisFence`;
:class:`FencedResource` and :func:`check_sections` are the older API, kept for
:mod:`workers.demo` until it moves to :class:`~celery_zklock.fence.RedisFence` and
:func:`workers.checker.check_run`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, get_args

from celery_zklock.fence import FenceOutcome, FenceStats, RedisFence

__all__ = [
    "FAULT_KINDS",
    "FORCED_LOSS_KINDS",
    "FaultLog",
    "FaultRecord",
    "FenceOutcome",
    "FenceStats",
    "FencedResource",
    "KeyStats",
    "Mode",
    "Overlap",
    "SectionEvent",
    "SectionRecorder",
    "SectionReport",
    "check_sections",
    "events_key",
    "faults_key",
]

Mode = Literal["exclusive", "shared"]
EventKind = Literal["enter", "write", "exit", "killed", "paused", "expired"]
MODES: Final[tuple[Mode, ...]] = get_args(Mode)
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)
FAULT_KINDS: Final = (
    "kill",
    "pause",
    "expire",
    "leader",
    "partition",
    "redis_restart",
    "blackhole",
    "follower_partition",
)
FORCED_LOSS_KINDS: Final[tuple[EventKind, ...]] = ("paused", "expired")
"""Event kinds that say a fault took a process's leases away where no holder can see it coming."""

# The Redis client is untyped (redis-py has no stubs here): ``Any`` keeps that honest.
RedisClient = Any


# ----------------------------------------------------------------------------------- records


def events_key(run_id: str) -> str:
    """The Redis list holding run ``run_id``'s section events."""
    return f"zklock:run:{run_id}:events"


def faults_key(run_id: str) -> str:
    """The Redis list holding run ``run_id``'s fault records."""
    return f"zklock:run:{run_id}:faults"


@dataclass(frozen=True)
class SectionEvent:
    """One record of a critical section, or of a process killed while it may have held some.

    ``token`` (the fencing token) is unique per lock acquisition, so ``(task_id, token)``
    identifies a section even when a message is delivered twice. ``time`` is the wall clock
    (``time.time()``) of whoever recorded the event, used only for durations; the order of events
    is the list's. ``accepted`` and ``previous_token`` are set on ``write`` events only.
    ``outcome`` is set on ``exit`` events: ``"ok"``, ``"lost"`` (the body stopped with
    ``LockLost``) or ``"error:<ExceptionType>"``; None in records made before it existed.

    A ``killed`` event means the process ``pid`` on ``hostname`` died: it closes every section
    that process had entered and not exited. A ``paused`` event means a fault stopped that process
    (SIGSTOP) while it held locks, an ``expired`` one that a fault closed its ZooKeeper session on
    the server: from then on its open sections may be overlapped by their successors without the
    lock being at fault (see :mod:`workers.checker`). In these three kinds only ``hostname``,
    ``pid`` and ``time`` mean anything (``task_id`` and ``key`` are empty, ``mode`` is a
    placeholder, ``token`` 0).
    """

    kind: EventKind
    task_id: str
    key: str
    mode: Mode
    token: int
    hostname: str = ""
    pid: int = 0
    node: str = ""
    time: float = 0.0
    accepted: bool | None = None
    previous_token: int | None = None
    outcome: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise ValueError(f"event mode must be one of {MODES}, got {self.mode!r}")

    @property
    def holder(self) -> str:
        """``<task_id>#<token>``: the identity of the section this event belongs to."""
        return f"{self.task_id}#{self.token}"

    def to_json(self) -> str:
        """Compact JSON; ``outcome`` is left out when None, so older readers still parse it."""
        data = asdict(self)
        if data["outcome"] is None:
            del data["outcome"]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> SectionEvent:
        """Parse :meth:`to_json`'s output (or an older record); raises ValueError otherwise."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a section event is a JSON object, got {text!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a section event: {text!r} ({exc})") from None


class SectionRecorder:
    """Appends a run's :class:`SectionEvent` records to Redis and reads them back."""

    def __init__(self, redis: RedisClient, run_id: str) -> None:
        self.run_id = run_id
        self.key = events_key(run_id)
        self._redis = redis

    def record(self, event: SectionEvent) -> None:
        """Append ``event`` (one ``RPUSH``: atomic, ordered after every earlier append)."""
        self._redis.rpush(self.key, event.to_json())

    def record_kill(self, hostname: str, pid: int, time: float) -> None:
        """Append a ``killed`` event: process ``pid`` of ``hostname`` is dead as of now.

        Call it after the kill took effect and before anything else is recorded about it.
        ``hostname`` and ``pid`` must be what that process put in its section events: the
        worker's node name (``task.request.hostname``) and the pid of the process that ran the
        task bodies (in a prefork worker, the pool child's, not the parent's).
        """
        self._record_process_event("killed", hostname, pid, time)

    def record_forced_loss(self, kind: EventKind, hostname: str, pid: int, time: float) -> None:
        """Append a ``paused`` or ``expired`` event for process ``pid`` of ``hostname``.

        Call it once the fault took effect (the process is stopped, or its session is about to
        be closed) and before its successors can be granted: the checker excuses overlaps of
        the sections open at this point only (``hostname``/``pid`` as in :meth:`record_kill`).
        """
        if kind not in FORCED_LOSS_KINDS:
            raise ValueError(f"a forced loss is one of {FORCED_LOSS_KINDS}, got {kind!r}")
        self._record_process_event(kind, hostname, pid, time)

    def _record_process_event(self, kind: EventKind, hostname: str, pid: int, time: float) -> None:
        self.record(
            SectionEvent(
                kind=kind,
                task_id="",
                key="",
                mode="exclusive",
                token=0,
                hostname=hostname,
                pid=pid,
                time=time,
            )
        )

    def events(self) -> list[SectionEvent]:
        """Every event of the run, in the order Redis received them."""
        return [SectionEvent.from_json(raw) for raw in self._redis.lrange(self.key, 0, -1)]

    def clear(self) -> None:
        """Delete the run's events."""
        self._redis.delete(self.key)


# ------------------------------------------------------------------------------------ faults


@dataclass(frozen=True)
class FaultRecord:
    """One fault a fault injector tried to cause during a run.

    ``kind`` is one of :data:`FAULT_KINDS`; ``time`` the injector's wall clock when it acted;
    ``target`` what it acted on (a worker, a ZooKeeper node, Redis); ``ran`` whether the fault
    really happened (False: it could not be injected, ``detail`` says why); ``detail`` free text.
    """

    kind: str
    time: float
    target: str
    ran: bool
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultRecord:
        """Parse :meth:`to_json`'s output; raises ValueError on anything else."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a fault record is a JSON object, got {text!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a fault record: {text!r} ({exc})") from None


class FaultLog:
    """A run's :class:`FaultRecord` list in Redis, in the order they were recorded."""

    def __init__(self, redis: RedisClient, run_id: str) -> None:
        self.run_id = run_id
        self.key = faults_key(run_id)
        self._redis = redis

    def record(self, fault: FaultRecord) -> None:
        """Append ``fault`` (one ``RPUSH``)."""
        self._redis.rpush(self.key, fault.to_json())

    def records(self) -> list[FaultRecord]:
        """Every fault recorded for the run, oldest first."""
        return [FaultRecord.from_json(raw) for raw in self._redis.lrange(self.key, 0, -1)]

    def clear(self) -> None:
        """Delete the run's fault records."""
        self._redis.delete(self.key)


# ------------------------------------------------------------------------- older fence API


class FencedResource:
    """The older name of :class:`celery_zklock.fence.RedisFence`, with a boolean :meth:`write`.

    Same Redis keys as a :class:`~celery_zklock.fence.RedisFence` of the same namespace.
    """

    def __init__(self, redis: RedisClient, namespace: str) -> None:
        self.fence = RedisFence(redis, namespace)
        self.namespace = namespace

    def write(self, key: str, token: int, value: str) -> bool:
        """True if the fence accepted the write (see :meth:`RedisFence.write`)."""
        return self.fence.write(key, token, value).accepted

    def write_outcome(self, key: str, token: int, value: str) -> FenceOutcome:
        """:meth:`RedisFence.write`."""
        return self.fence.write(key, token, value)

    def last_token(self, key: str) -> int | None:
        return self.fence.last_token(key)

    def value(self, key: str) -> str | None:
        return self.fence.value(key)

    def stats(self) -> FenceStats:
        return self.fence.stats()

    def clear(self) -> None:
        self.fence.clear()


# ---------------------------------------------------------------------------- older checker


@dataclass(frozen=True)
class Overlap:
    """A section entered while a conflicting one was inside: a mutual-exclusion violation."""

    key: str
    position: int
    """Index of the offending ``enter`` in the event list."""
    entering: str
    entering_mode: Mode
    inside: tuple[tuple[str, Mode], ...]
    """The holders (and their modes) inside when it entered."""


@dataclass
class KeyStats:
    """Per key: sections seen and the most holders inside at once, by mode."""

    sections: int = 0
    exclusive_sections: int = 0
    shared_sections: int = 0
    max_exclusive: int = 0
    max_shared: int = 0


@dataclass(frozen=True)
class SectionReport:
    """What :func:`check_sections` found in one history."""

    keys: Mapping[str, KeyStats]
    overlaps: tuple[Overlap, ...]
    open_sections: tuple[str, ...]
    """Holders that entered and never exited (a crash, or the run is still going)."""
    malformed: tuple[str, ...]
    """Events that contradict the protocol: an exit without enter, a second enter."""
    writes_accepted: int
    writes_refused: Mapping[Mode, int]
    stale_writes_accepted: tuple[SectionEvent, ...]
    """Accepted writes whose token was lower than the key's previous accepted token."""
    hold_seconds: tuple[float, ...]
    """Enter-to-exit time of each closed section (one host's clock)."""
    closed_task_ids: frozenset[str] = field(default_factory=frozenset)

    @property
    def violations(self) -> int:
        """Number of sections that entered while a conflicting section was inside."""
        return len(self.overlaps)


def check_sections(events: Iterable[SectionEvent]) -> SectionReport:
    """Replay ``events`` in order and report overlaps, open sections and stale writes.

    Per key, an ``exclusive`` section may not enter while any section is inside; a ``shared``
    one may not enter while an ``exclusive`` one is inside. Shared sections may overlap each
    other, so their refused writes (a concurrent reader with a higher token wrote first) are
    expected and counted apart from exclusive ones. A ``killed`` event closes the sections of
    its process. Every overlap counts, also one with a holder whose lock was lost:
    :func:`workers.checker.check_run` tells those apart.
    """
    inside: dict[str, dict[str, SectionEvent]] = {}
    keys: dict[str, KeyStats] = {}
    overlaps: list[Overlap] = []
    malformed: list[str] = []
    holds: list[float] = []
    closed: set[str] = set()
    accepted = 0
    refused: dict[Mode, int] = {mode: 0 for mode in MODES}
    stale: list[SectionEvent] = []
    for position, event in enumerate(events):
        if event.kind == "killed":
            for open_here in inside.values():
                for holder, opened in list(open_here.items()):
                    if (opened.hostname, opened.pid) == (event.hostname, event.pid):
                        del open_here[holder]
            continue
        if event.kind in FORCED_LOSS_KINDS:
            continue  # every overlap counts here
        holders = inside.setdefault(event.key, {})
        stats = keys.setdefault(event.key, KeyStats())
        if event.kind == "enter":
            if event.holder in holders:
                malformed.append(f"#{position}: second enter of {event.holder}")
                continue
            conflicting = [
                (holder, e.mode)
                for holder, e in holders.items()
                if event.mode == "exclusive" or e.mode == "exclusive"
            ]
            if conflicting:
                overlaps.append(
                    Overlap(event.key, position, event.holder, event.mode, tuple(conflicting))
                )
            holders[event.holder] = event
            _count_entry(stats, holders, event.mode)
        elif event.kind == "exit":
            entered = holders.pop(event.holder, None)
            if entered is None:
                malformed.append(f"#{position}: exit of {event.holder} without an enter")
                continue
            holds.append(max(0.0, event.time - entered.time))
            closed.add(event.task_id)
        elif event.accepted:
            accepted += 1
            if event.previous_token is not None and event.token < event.previous_token:
                stale.append(event)
        else:
            refused[event.mode] += 1
    return SectionReport(
        keys=keys,
        overlaps=tuple(overlaps),
        open_sections=tuple(h for holders in inside.values() for h in holders),
        malformed=tuple(malformed),
        writes_accepted=accepted,
        writes_refused=refused,
        stale_writes_accepted=tuple(stale),
        hold_seconds=tuple(holds),
        closed_task_ids=frozenset(closed),
    )


def _count_entry(stats: KeyStats, holders: Mapping[str, SectionEvent], mode: Mode) -> None:
    stats.sections += 1
    if mode == "exclusive":
        stats.exclusive_sections += 1
    else:
        stats.shared_sections += 1
    modes = [e.mode for e in holders.values()]
    stats.max_exclusive = max(stats.max_exclusive, modes.count("exclusive"))
    stats.max_shared = max(stats.max_shared, modes.count("shared"))
