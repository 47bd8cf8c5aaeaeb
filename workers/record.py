"""What a fleet run leaves in Redis: its section events and its fault records.

A locked task appends ``enter`` once granted, ``writing`` just before its fenced write,
``write`` after it and ``exit`` before it releases; a fault injector appends ``killed``,
``paused`` or ``expired`` for a process it took the leases of. Each is one ``RPUSH`` of a JSON
:class:`SectionEvent` to ``zklock:run:<run_id>:events``, so the list is one total order,
whatever host or clock wrote it: :mod:`workers.checker` replays it. :class:`FaultLog` keeps the
injector's :class:`FaultRecord` list in ``zklock:run:<run_id>:faults``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Generic, Literal, Protocol, TypeVar, get_args

__all__ = [
    "FAULT_ALIASES",
    "FAULT_KINDS",
    "FORCED_LOSS_KINDS",
    "MAIN_PROCESS_KILL",
    "PREEMPTED_OUTCOME",
    "FaultLog",
    "FaultRecord",
    "Mode",
    "SectionEvent",
    "SectionRecorder",
    "events_key",
    "faults_key",
]

Mode = Literal["exclusive", "shared"]
EventKind = Literal["enter", "writing", "write", "exit", "killed", "paused", "expired", "survived"]
MODES: Final[tuple[Mode, ...]] = get_args(Mode)
PREEMPTED_OUTCOME: Final = "preempted"
"""The ``exit`` outcome of a section whose lock a newer ``preempt`` call broke (``LockLost``)."""
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)
FAULT_KINDS: Final = (
    "kill",
    "pause",
    "expire",
    "leader",
    "partition",
    "broker_restart",
    "blackhole",
    "follower_partition",
    "stall_before_write",
    "kill_held",
    "quorum_loss",
)
FAULT_ALIASES: Final[Mapping[str, str]] = {"redis_restart": "broker_restart"}
"""Former names of fault kinds, still accepted in a plan (``--faults``)."""
MAIN_PROCESS_KILL: Final = "SIGKILL of the worker's main process"
"""How the detail of a fault that killed a worker's main process (the whole worker) begins."""
EXPIRE_CALL_TIMEOUT: Final = 15.0
"""Seconds the fault injector's session close may take (:func:`workers.faults.expire_session`)
after its ``expired`` event, recorded before the call: a section its process enters meanwhile
is on the session being closed."""
FORCED_LOSS_KINDS: Final[tuple[EventKind, ...]] = ("paused", "expired")
"""Event kinds that say a fault took a process's leases away where no holder can see it coming."""

# The Redis client is untyped (redis-py has no stubs here): ``Any`` keeps that honest.
RedisClient = Any
_D = TypeVar("_D")


class _Record(Protocol):
    def to_json(self) -> str: ...


_R = TypeVar("_R", bound=_Record)


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
    is the list's. ``accepted`` and ``previous_token`` are set on ``write`` events only. A
    ``writing`` event (same fields as the ``enter``) is recorded just before the fenced write is
    sent, so every write recorded before it reached the fence first (records made before it
    existed have none); its ``valid_until`` is the wall time until which the holder's lease was
    held by its own lease clock (:attr:`celery_zklock.Lease.valid_for`).
    ``outcome`` is set on ``exit`` events: ``"ok"``, ``"lost"`` (the body stopped with
    ``LockLost``) or ``"error:<ExceptionType>"``; None in records made before it existed.
    Every event of a rate-limited section (``lock_rate``) carries ``rate``, the rate it was
    admitted under in Celery's syntax (``"6/m"``), and ``admitted``, its admission node's
    ``ctime`` in milliseconds: ZooKeeper's clock (the leader's), the very time the rate limit
    compares, read by the section from ZooKeeper (None if it could not be read); both are None
    for a section without a rate and in records made before they existed.

    A ``killed`` event means the process ``pid`` on ``hostname`` died: it closes every section
    that process had entered and not exited. An injected kill is recorded at once, so the
    process was alive (its sections valid) until about there; ``late`` marks a death only found
    afterwards (a worker that died on its own), which happened at some unknown point before.
    A ``paused`` event means a fault stopped that process (SIGSTOP) while it held locks, an
    ``expired`` one that a fault closed its ZooKeeper session on the server: from then on its
    open sections may be overlapped by their successors without the lock being at fault (see
    :mod:`workers.checker`). A ``paused`` event's ``time`` is taken before the stop and it
    carries the workers' ``session_timeout``: ZooKeeper cannot expire the session much before
    that timeout has passed. When it also carries the holder's ``valid_until`` (a holder that
    stopped itself knows it), nobody may be granted its lock before that time. A ``survived``
    event says the fault recorded by the process's earlier ``paused`` or ``expired`` events did
    not take its session after all (the pause ended before the expiry, the expiry call failed):
    those events excuse nothing. In these kinds only ``hostname``, ``pid``, ``time``, ``late``,
    ``session_timeout`` and ``valid_until`` mean anything (``task_id`` and ``key`` are empty,
    ``mode`` is a placeholder, ``token`` 0).
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
    late: bool = False
    session_timeout: float | None = None
    valid_until: float | None = None
    rate: str | None = None
    admitted: int | None = None

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
        """Compact JSON; ``outcome``, ``late``, ``session_timeout``, ``valid_until``, ``rate``
        and ``admitted`` are left out when unset, so older readers still parse it."""
        data = asdict(self)
        if data["outcome"] is None:
            del data["outcome"]
        if not data["late"]:
            del data["late"]
        for optional in ("session_timeout", "valid_until", "rate", "admitted"):
            if data[optional] is None:
                del data[optional]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> SectionEvent:
        """Parse :meth:`to_json`'s output (or an older record); raises ValueError otherwise."""
        return _from_json(cls, text, "a section event")


class _RedisList(Generic[_R]):
    """A run's list of records in Redis, appended with one ``RPUSH`` each (atomic, ordered
    after every earlier append), read back oldest first."""

    def __init__(self, redis: RedisClient, run_id: str, key: str) -> None:
        self.run_id = run_id
        self.key = key
        self._redis = redis

    def record(self, record: _R) -> None:
        """Append ``record``."""
        self._redis.rpush(self.key, record.to_json())

    def record_once(self, record: _R) -> None:
        """Append ``record`` unless the list already holds it (an append that was interrupted
        after Redis took it)."""
        text = record.to_json()
        if self._redis.lpos(self.key, text) is None:
            self._redis.rpush(self.key, text)

    def _read(self, parse: Callable[[bytes], _R]) -> list[_R]:
        return [parse(raw) for raw in self._redis.lrange(self.key, 0, -1)]

    def clear(self) -> None:
        """Delete the run's list."""
        self._redis.delete(self.key)


class SectionRecorder(_RedisList[SectionEvent]):
    """Appends a run's :class:`SectionEvent` records to Redis and reads them back."""

    def __init__(self, redis: RedisClient, run_id: str) -> None:
        super().__init__(redis, run_id, events_key(run_id))

    def record_kill(self, hostname: str, pid: int, time: float, *, late: bool = False) -> None:
        """Append a ``killed`` event: process ``pid`` of ``hostname`` is dead as of now.

        Call it after the kill took effect and before anything else is recorded about it: the
        checker counts an overlap of the process's sections recorded before this event as a
        violation. ``late``: the death was found after the fact (it happened at some unknown
        point before), and overlaps before it cannot be told from a legitimate hand-over.
        ``hostname`` and ``pid`` must be what that process put in its section events: the
        worker's node name (``task.request.hostname``) and the pid of the process that ran the
        task bodies (in a prefork worker, the pool child's, not the parent's).
        """
        self._record_process_event("killed", hostname, pid, time, late=late)

    def record_forced_loss(
        self,
        kind: EventKind,
        hostname: str,
        pid: int,
        time: float,
        *,
        session_timeout: float | None = None,
        valid_until: float | None = None,
    ) -> None:
        """Append a ``paused`` or ``expired`` event for process ``pid`` of ``hostname``.

        Call it once the fault took effect (the process is stopped, or its session is about to
        be closed) and before its successors can be granted: the checker excuses overlaps of
        the sections open at this point only (``hostname``/``pid`` as in :meth:`record_kill`).
        For ``paused``, ``time`` is when the stop was sent and ``session_timeout`` the
        workers' session timeout: without it a pause excuses nothing; ``valid_until``, when the
        holder told it (its ``writing`` event), replaces the guess from the timeout. If the fault
        then did not take the session, append :meth:`record_survived`.
        """
        if kind not in FORCED_LOSS_KINDS:
            raise ValueError(f"a forced loss is one of {FORCED_LOSS_KINDS}, got {kind!r}")
        self._record_process_event(
            kind, hostname, pid, time, session_timeout=session_timeout, valid_until=valid_until
        )

    def record_survived(self, hostname: str, pid: int, time: float) -> None:
        """Append a ``survived`` event: the forced losses recorded for the process so far did
        not take its session (it is still the lock holder's): they excuse no overlap."""
        self._record_process_event("survived", hostname, pid, time)

    def _record_process_event(
        self,
        kind: EventKind,
        hostname: str,
        pid: int,
        time: float,
        *,
        late: bool = False,
        session_timeout: float | None = None,
        valid_until: float | None = None,
    ) -> None:
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
                late=late,
                session_timeout=session_timeout,
                valid_until=valid_until,
            )
        )

    def events(self) -> list[SectionEvent]:
        """Every event of the run, in the order Redis received them."""
        return self._read(SectionEvent.from_json)


# ------------------------------------------------------------------------------------ faults


@dataclass(frozen=True)
class FaultRecord:
    """One fault a fault injector tried to cause during a run.

    ``kind`` is one of :data:`FAULT_KINDS`; ``time`` the injector's wall clock when it acted;
    ``target`` what it acted on (a worker, a ZooKeeper node, Redis); ``ran`` whether the fault
    really happened (False: it could not be injected, ``detail`` says why); ``detail`` free text.
    ``ended``: the same clock when the fault was over, for a ``broker_restart`` once the broker
    served again, for a ``quorum_loss`` once a leader served again (None when not recorded, and
    in records made before it existed).
    """

    kind: str
    time: float
    target: str
    ran: bool
    detail: str
    ended: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        """Compact JSON; ``ended`` is left out when unset, so older readers still parse it."""
        data = asdict(self)
        if data["ended"] is None:
            del data["ended"]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultRecord:
        """Parse :meth:`to_json`'s output; raises ValueError on anything else."""
        return _from_json(cls, text, "a fault record")


class FaultLog(_RedisList[FaultRecord]):
    """A run's :class:`FaultRecord` list in Redis, in the order they were recorded."""

    def __init__(self, redis: RedisClient, run_id: str) -> None:
        super().__init__(redis, run_id, faults_key(run_id))

    def records(self) -> list[FaultRecord]:
        """Every fault recorded for the run, oldest first."""
        return self._read(FaultRecord.from_json)


def _from_json(kind: type[_D], text: str | bytes, what: str) -> _D:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{what} is a JSON object, got {text!r}")
    try:
        return kind(**data)
    except TypeError as exc:
        raise ValueError(f"not {what}: {text!r} ({exc})") from None
