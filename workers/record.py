"""What the fleet's critical sections leave behind in Redis, the fence they write through, and the
checker that reads the history back.

**Records.** A locked task appends ``enter`` right after its lock is granted, ``write`` after its
fenced write, and ``exit`` right before its lock is released, each one JSON
:class:`SectionEvent` pushed (``RPUSH``) to the list ``zklock:run:<run_id>:events``. Redis runs
commands one at a time, so the list is a total order of those events, whatever host or clock
they came from. If two sections really never overlapped, the first one's ``exit`` precedes the
second one's ``enter`` in the list; so an ``enter`` of an exclusive holder while anyone is inside,
or of a shared holder while an exclusive one is inside, proves two holders held the lock at once
(:func:`check_sections`). A clean history proves nothing about runs not recorded.

**The fence.** :class:`FencedResource` is a keyed value in Redis that only the current lock
holder may overwrite: each write carries the holder's fencing token (the lease's ``czxid``,
which grows with every acquisition), and a Lua compare-and-set refuses a token lower than the
last accepted one for that key and counts the refusal. A holder that lost its lock (paused past
its session timeout, cut off) and writes after a newer holder wrote is refused, however late its
write arrives. Equal tokens are accepted (one holder writing twice).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, get_args

__all__ = [
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
]

Mode = Literal["exclusive", "shared"]
EventKind = Literal["enter", "write", "exit"]
MODES: Final[tuple[Mode, ...]] = get_args(Mode)
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)

# The Redis client is untyped (redis-py has no stubs here): ``Any`` keeps that honest.
RedisClient = Any


# ------------------------------------------------------------------------------------- fence

# KEYS: tokens hash, values hash, counters hash. ARGV: key, token (decimal digits), value.
# Tokens are 64-bit czxids; Lua numbers are doubles (exact only below 2**53), so the tokens are
# compared as decimal strings without leading zeros: shorter is lower, equal length compares
# bytewise.
_FENCE_LUA: Final = """
local last = redis.call('HGET', KEYS[1], ARGV[1])
if last then
  if #ARGV[2] < #last or (#ARGV[2] == #last and ARGV[2] < last) then
    redis.call('HINCRBY', KEYS[3], 'refused', 1)
    return {0, last}
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'accepted', 1)
return {1, last or ''}
"""


@dataclass(frozen=True)
class FenceOutcome:
    """One fenced write: ``accepted``, and the last accepted token before it (None: first)."""

    accepted: bool
    previous_token: int | None


@dataclass(frozen=True)
class FenceStats:
    """Counts of a fence's writes since it was created (or cleared)."""

    accepted: int
    refused: int


class FencedResource:
    """Keyed values in Redis that accept a write only with a token >= the key's last token.

    ``namespace`` separates resources; all of one namespace's Redis keys share the hash tag
    ``{namespace}``, so the script works on Redis Cluster. Tokens are non-negative integers
    (ZooKeeper czxids: :attr:`celery_zklock.Lease.token`). Thread-safe and fork-safe as far as
    the redis-py client passed in is.
    """

    def __init__(self, redis: RedisClient, namespace: str) -> None:
        if not namespace or any(c in namespace for c in "{}"):
            raise ValueError(f"namespace must be non-empty without braces, got {namespace!r}")
        self.namespace = namespace
        self._redis = redis
        prefix = f"zklock:fence:{{{namespace}}}"
        self._tokens_key = f"{prefix}:tokens"
        self._values_key = f"{prefix}:values"
        self._counters_key = f"{prefix}:counters"
        self._script = redis.register_script(_FENCE_LUA)

    def write(self, key: str, token: int, value: str) -> bool:
        """Store ``value`` under ``key`` unless ``token`` is lower than the last accepted one.

        Returns True if the write was accepted; a refusal is counted (:meth:`stats`).
        """
        return self.write_outcome(key, token, value).accepted

    def write_outcome(self, key: str, token: int, value: str) -> FenceOutcome:
        """Like :meth:`write`, and also return the last accepted token seen by the script."""
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"a fencing token is an integer >= 0, got {token!r}")
        accepted, previous = self._script(
            keys=[self._tokens_key, self._values_key, self._counters_key],
            args=[key, str(token), value],
        )
        previous_text = _text(previous)
        return FenceOutcome(
            accepted=int(accepted) == 1,
            previous_token=int(previous_text) if previous_text else None,
        )

    def last_token(self, key: str) -> int | None:
        """The last accepted token for ``key``, or None if nothing was written."""
        raw = self._redis.hget(self._tokens_key, key)
        return int(_text(raw)) if raw is not None else None

    def value(self, key: str) -> str | None:
        """The value of the last accepted write for ``key``, or None."""
        raw = self._redis.hget(self._values_key, key)
        return _text(raw) if raw is not None else None

    def stats(self) -> FenceStats:
        """How many writes were accepted and refused."""
        counters = {_text(k): int(v) for k, v in self._redis.hgetall(self._counters_key).items()}
        return FenceStats(counters.get("accepted", 0), counters.get("refused", 0))

    def clear(self) -> None:
        """Forget every key, value and count of this namespace."""
        self._redis.delete(self._tokens_key, self._values_key, self._counters_key)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# ----------------------------------------------------------------------------------- records


def events_key(run_id: str) -> str:
    """The Redis list holding run ``run_id``'s events."""
    return f"zklock:run:{run_id}:events"


@dataclass(frozen=True)
class SectionEvent:
    """One record of a critical section.

    ``token`` (the fencing token) is unique per lock acquisition, so ``(task_id, token)``
    identifies a section even when a message is delivered twice. ``time`` is the worker's wall
    clock (``time.time()``), used only for durations measured on one host; the order of events
    is the list's. ``accepted`` and ``previous_token`` are set on ``write`` events only.
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
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> SectionEvent:
        """Parse :meth:`to_json`'s output; raises ValueError on anything else."""
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

    def events(self) -> list[SectionEvent]:
        """Every event of the run, in the order Redis received them."""
        return [SectionEvent.from_json(raw) for raw in self._redis.lrange(self.key, 0, -1)]

    def clear(self) -> None:
        """Delete the run's events."""
        self._redis.delete(self.key)


# ----------------------------------------------------------------------------------- checker


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
    expected and counted apart from exclusive ones.
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
