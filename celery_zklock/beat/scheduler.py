"""Highly available ``celery beat``: every beat process runs, one is elected and only it sends.

``celery -A proj beat -S celery_zklock.beat:LeaderScheduler``

**Election.** Every beat process contends for a :class:`~celery_zklock.Mutex` on
``<zklock_root>/beat/<name>/leader`` (``<name>``: the setting ``zklock_beat_name``, by default
the app's main name). The holder leads; the others wait in the lock's queue, each watching only
its predecessor (one notification per change, however many standbys). A leader that dies takes
its contender node with its session, so the next standby is granted once the server expires that
session (at most ``1.5 T + 1 s``, ``T`` the negotiated session timeout); a leader that stops
(SIGTERM) deletes its node and closes its session, and hands over at once.

**Wrapping.** For each term of leadership the leader builds an instance of the scheduler class
named by ``zklock_beat_scheduler`` (default Celery's ``PersistentScheduler``; any
``celery.beat.Scheduler``, django-celery-beat's ``DatabaseScheduler`` included) and delegates
every tick to it; it does not subclass it. Three of that instance's own methods are wrapped on
the instance: ``is_due`` (the stored last run time is applied to the entry first), ``reserve``
and ``apply_async`` (the lease is checked before, the new last run time recorded after); and the
instance gets a producer whose every publish attempt, retries included, checks the lease too.
So the wrapped class must follow :class:`celery.beat.Scheduler`'s protocol (``tick`` decides
with ``is_due``, advances with ``reserve`` and sends through ``apply_async``, as Celery's and
django-celery-beat's schedulers do). A standby builds no scheduler instance and sends nothing.

**Stop before another can be elected.** Right before every send the leader reads
:attr:`Lease.lost <celery_zklock.Lease.lost>`. That is read from the lease clock
(:mod:`celery_zklock.locks.clock`): it is true from a margin (``max(0.25 s, T/10)``) *before*
the ZooKeeper leader could expire the session and grant the lock to another beat, and also as
soon as a paused process runs again. So the check is sufficient: a send that passes it is
published before any other beat can lead, unless this process stalls between the check and the
publish for longer than the margin (the limit every lease has: see "Safety trade-offs" in the
README). The lease is released on purpose (shutdown, step-down) only while no send is between
its check and the write of its record. ``celery beat``'s SIGTERM/SIGINT handler calls
``close()`` and raises SystemExit on the main thread wherever it is, possibly in the middle of a
send: that close is carried out when the send is recorded (:class:`SendLock`), and the
SystemExit goes on to Celery's loop, which exits. A beat whose lease is lost sends nothing more,
drops its scheduler instance, and contends again at the end of the queue.

**The schedule's state.** ``PersistentScheduler`` keeps each entry's ``last_run_at`` in a shelve
file of its own process, which a standby cannot see. Here the leaders keep it in ZooKeeper: one
JSON document at ``<zklock_root>/beat/<name>/schedule`` (:func:`encode_state`) with each
entry's last run time and run count. A new leader reads it (after a ``sync``) and writes it back
under its fencing token with a versioned ``set`` before its first tick: a write that the
previous leader still had in flight either landed before that read or fails on the version. It
applies the stored times to its scheduler's entries (they replace the scheduler's own: a fresh
shelve holds "now"), and records each send right after it, again with a versioned ``set`` and
only while the lease is valid. A write refused on the version means another leader wrote: this
one steps down.

An entry no leader has sent yet is recorded too, with run count 0 and as last run time the one
its scheduler gave it: for a new entry, the moment a leader first saw it (in the claim, or in
the first tick that finds it in the schedule). That is what a single beat's shelve keeps for
it, so its first due time counts from there, across takeovers, as it would for one persistent
beat; without it each new leader would start the interval afresh, and an entry with a period
longer than the time between takeovers (a daily entry, a deploy every few hours) would never be
sent. A baseline older than the interval (the group was stopped) makes the entry due once at
the next tick, as a shelve does.

**Exactly once, at a takeover.** Every send is decided from the last run time recorded in
ZooKeeper and is recorded before the leader's next send. So a new leader starts from the last
recorded send: it re-sends no due time whose send was recorded, skips none, and sends the first
due time after the last recorded send once. Due times that fell in the takeover gap (from the old
leader's last send to the new leader's first tick, about one session timeout after a crash) are
coalesced into that one send, as Celery does for any beat that was down: ``is_due`` says "due
now", not how many times. The one exception is a send whose record did not reach ZooKeeper (the
leader died, stalled past its session, or lost ZooKeeper between the publish and the write, one
ZooKeeper round trip): the next leader sends that due time again. That is at-least-once, never a
skip. Last run times are the sending host's wall clock: keep the beat hosts' clocks synchronised
(a new leader whose clock runs ``s`` seconds ahead sends ``s`` seconds early).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final, Protocol

from celery.utils.imports import load_extension_class_names, symbol_by_name
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from celery_zklock.config import settings_of
from celery_zklock.errors import ConfigurationError, ZooKeeperUnavailable
from celery_zklock.locks import Lease, Mutex, adapter
from celery_zklock.locks.context import Deadline, wait_result
from celery_zklock.session import new_client, tls_problem
from celery_zklock.validate import forbidden_in_znode

__all__ = [
    "DEFAULT_SCHEDULER",
    "BeatSettings",
    "LeaderScheduler",
    "RunRecord",
    "apply_record",
    "apply_records",
    "beat_settings",
    "decode_state",
    "encode_state",
    "record_of",
    "records_of_new_entries",
]

logger = logging.getLogger("celery_zklock.beat")

DEFAULT_SCHEDULER: Final = "celery.beat:PersistentScheduler"
"""The scheduler class wrapped when ``zklock_beat_scheduler`` is not set."""
STATE_FORMAT: Final = 1
"""The version of the state document's layout (:func:`encode_state`)."""
RETRY_DELAY: Final = 1.0
"""Seconds between attempts after ZooKeeper failed the election or a term's start."""
CLAIM_ATTEMPTS: Final = 3
"""How often a new leader re-reads the state when its first write loses a version race."""


# -- settings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BeatSettings:
    """Where a beat group elects its leader and keeps its schedule's state."""

    root: str
    """``zklock_root``."""
    name: str
    """``zklock_beat_name``: beats with the same root and name form one group, one leader."""
    scheduler: str
    """``zklock_beat_scheduler``: the scheduler class each leader runs."""

    @property
    def election(self) -> str:
        """The lock every beat of the group contends for."""
        return f"{self.root}/beat/{self.name}/leader"

    @property
    def state(self) -> str:
        """The node holding the schedule's state (:func:`encode_state`)."""
        return f"{self.root}/beat/{self.name}/schedule"


def _setting(conf: Mapping[str, Any], name: str) -> str | None:
    value = conf.get(name)
    if value is None:
        value = os.environ.get(name.upper())
    return None if value is None or str(value) == "" else str(value)


def beat_settings(app: Any) -> BeatSettings:
    """The beat settings of ``app``: ``zklock_beat_name`` (env ``ZKLOCK_BEAT_NAME``, default
    ``app.main``), ``zklock_beat_scheduler`` (env ``ZKLOCK_BEAT_SCHEDULER``, default
    :data:`DEFAULT_SCHEDULER`) and the lock root.

    Raises ConfigurationError naming the bad setting: a name that is not one znode name (empty,
    ``.``, ``..``, a ``/`` or a character ZooKeeper refuses), no name at all (an app without a
    main name and no ``zklock_beat_name``), or a scheduler naming this class.
    """
    conf = app.conf
    name = _setting(conf, "zklock_beat_name")
    if name is None:
        main = getattr(app, "main", None)
        if not main or main == "__main__":
            raise ConfigurationError(
                "zklock_beat_name is not set and the app has no main name: set "
                "app.conf.zklock_beat_name (env ZKLOCK_BEAT_NAME) to name the beat group"
            )
        name = str(main)
    bad = next((char for char in name if char == "/" or forbidden_in_znode(char)), None)
    if name in (".", "..") or bad is not None:
        problem = "'.' or '..'" if bad is None else f"the character U+{ord(bad):04X}"
        raise ConfigurationError(
            f"zklock_beat_name must be one znode name, got {name!r} ({problem})"
        )
    scheduler = _setting(conf, "zklock_beat_scheduler") or DEFAULT_SCHEDULER
    if scheduler.replace(":", ".").rsplit(".", 1)[-1] == LeaderScheduler.__name__:
        raise ConfigurationError(
            f"zklock_beat_scheduler names {scheduler!r}: it must name the scheduler the leader "
            "runs (e.g. celery.beat:PersistentScheduler), not LeaderScheduler itself"
        )
    return BeatSettings(root=settings_of(app).root, name=name, scheduler=scheduler)


def scheduler_class(spec: str) -> Any:
    """The class ``spec`` names (``"module:Class"``, a dotted path, or a ``celery beat -S``
    alias such as ``django``); ConfigurationError if it cannot be imported."""
    aliases = dict(load_extension_class_names("celery.beat_schedulers"))
    try:
        cls = symbol_by_name(spec, aliases=aliases)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(
            f"zklock_beat_scheduler {spec!r} cannot be imported: {exc}"
        ) from exc
    if not callable(cls) or not callable(getattr(cls, "tick", None)):
        raise ConfigurationError(
            f"zklock_beat_scheduler {spec!r} is not a celery beat scheduler class (no tick())"
        )
    return cls


# -- the schedule's state (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """The last send of one schedule entry: when (timezone-aware) and how many sends so far."""

    last_run_at: datetime
    total_run_count: int


def _as_utc(moment: datetime) -> datetime:
    # Celery reads a naive last_run_at as UTC (celery.utils.time.maybe_make_aware).
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)


def record_of(entry: Any) -> RunRecord:
    """The record of a schedule entry's ``last_run_at`` and ``total_run_count``."""
    return RunRecord(_as_utc(entry.last_run_at), int(entry.total_run_count or 0))


def apply_record(entry: Any, record: RunRecord) -> bool:
    """Give ``entry`` the recorded last run time and run count; True if either changed.

    The stored time replaces the entry's own (a scheduler's fresh entry holds the time it was
    created, which is not a send). It keeps the entry's convention: naive UTC stays naive, an
    aware time is given in the entry's own zone.
    """
    current = getattr(entry, "last_run_at", None)
    if current is None or current.tzinfo is not None:
        zone = timezone.utc if current is None else current.tzinfo
        moment = record.last_run_at.astimezone(zone)
    else:
        moment = record.last_run_at.astimezone(timezone.utc).replace(tzinfo=None)
    changed = current != moment or entry.total_run_count != record.total_run_count
    if changed:
        entry.last_run_at = moment
        entry.total_run_count = record.total_run_count
    return changed


def apply_records(entries: Mapping[str, Any], records: Mapping[str, RunRecord]) -> list[str]:
    """:func:`apply_record` for every entry with a record; the names of the entries changed.
    Entries without a record keep their own times; records without an entry are ignored."""
    return [
        name
        for name, entry in entries.items()
        if name in records and apply_record(entry, records[name])
    ]


def records_of_new_entries(
    entries: Mapping[str, Any], records: Mapping[str, RunRecord]
) -> dict[str, RunRecord]:
    """:func:`record_of` each entry without a record (and with a last run time): for an entry
    no leader has sent yet that is the time its scheduler first saw it (a fresh entry's
    ``last_run_at`` is its creation time), which its first interval counts from."""
    return {
        name: record_of(entry)
        for name, entry in entries.items()
        if name not in records and getattr(entry, "last_run_at", None) is not None
    }


def encode_state(
    records: Mapping[str, RunRecord], *, leader: str, token: int, written_at: datetime
) -> bytes:
    """The state document: ``{"format", "leader", "token", "written_at", "entries": {name:
    {"last_run_at": ISO 8601 UTC, "total_run_count"}}}`` as UTF-8 JSON, entries sorted."""
    document = {
        "format": STATE_FORMAT,
        "leader": leader,
        "token": token,
        "written_at": _as_utc(written_at).isoformat(),
        "entries": {
            name: {
                "last_run_at": _as_utc(record.last_run_at).isoformat(),
                "total_run_count": record.total_run_count,
            }
            for name, record in sorted(records.items())
        },
    }
    return json.dumps(document, sort_keys=True).encode()


def decode_state(data: bytes) -> dict[str, RunRecord]:
    """The records of a state document; ``{}`` for an empty node.

    Raises ValueError for anything :func:`encode_state` did not write (another format, bad JSON,
    a missing or malformed field).
    """
    if not data:
        return {}
    try:
        document = json.loads(data)
        if document.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {document.get('format')!r}")
        return {
            str(name): RunRecord(
                _as_utc(datetime.fromisoformat(fields["last_run_at"])),
                int(fields["total_run_count"]),
            )
            for name, fields in document["entries"].items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a celery-zklock beat state document: {exc!r}") from exc


# -- one term of leadership ---------------------------------------------------------------------


class NotLeader(BaseException):
    """This beat may not send (its lease is lost, or another leader wrote the state).

    A ``BaseException``: it must pass through the ``except Exception`` with which Celery's
    ``Scheduler.apply_entry`` logs and swallows a failed send, up to :meth:`LeaderScheduler.tick`.
    """


class Superseded(Exception):
    """The state node was written by someone else since this beat read or wrote it."""


class HeldLease(Protocol):
    """What a term needs of its lease (a :class:`~celery_zklock.Lease`)."""

    @property
    def held(self) -> bool: ...

    @property
    def lost_reason(self) -> str | None: ...

    @property
    def token(self) -> int: ...


class StateStore(Protocol):
    """The schedule's state node (:class:`ZooKeeperState`)."""

    def load(self) -> dict[str, RunRecord]: ...

    def save(self, data: bytes) -> None: ...


def ensure_held(lease: HeldLease) -> None:
    """Raise :class:`NotLeader` unless ``lease`` is held: neither released nor lost, ``lost``
    being read from the lease clock (:attr:`Lease.lost <celery_zklock.Lease.lost>`)."""
    if not lease.held:
        reason = lease.lost_reason or "it was released"
        raise NotLeader(f"the leader lease is not held: {reason}")


def guarded_producer(base: type[Any], check: Callable[[], None]) -> type[Any]:
    """A subclass of the producer class ``base`` that calls ``check()`` before every publish
    attempt (kombu's ``Producer.publish`` calls ``_publish`` once per attempt, again for each
    retry after a reconnect)."""

    class GuardedProducer(base):  # type: ignore[misc]
        def _publish(self, *args: Any, **kwargs: Any) -> Any:
            check()
            return super()._publish(*args, **kwargs)

    return GuardedProducer


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


class Term:
    """One term of leadership: the wrapped scheduler instance built for it, its lease, and the
    schedule's state in ZooKeeper.

    :meth:`claim` loads the stored state and fences older leaders before the first
    :meth:`tick`; each tick is the wrapped scheduler's own, with its ``is_due``, ``reserve`` and
    ``apply_async`` wrapped on the instance (see the module docstring). ``send_lock`` is held
    from each send's lease check until its record is written; whoever releases the lease holds
    it too.
    """

    def __init__(
        self,
        lease: HeldLease,
        scheduler: Any,
        store: StateStore,
        send_lock: AbstractContextManager[Any],
        leader: str,
    ) -> None:
        self.lease = lease
        self.scheduler = scheduler
        self.records: dict[str, RunRecord] = {}
        self._store = store
        self._send_lock = send_lock
        self._leader = leader
        self._pending: dict[str, RunRecord] = {}
        self._unsaved = False
        self._is_due = scheduler.is_due
        self._reserve = scheduler.reserve
        self._apply_async = scheduler.apply_async
        scheduler.is_due = self.is_due
        scheduler.reserve = self.reserve
        scheduler.apply_async = self.apply_async

    def claim(self) -> None:
        """Read the stored state, write it back under this term's token (a write of an older
        leader still in flight then fails on the version) with the entries it did not know
        added (:func:`records_of_new_entries`), and apply it to the scheduler's entries.

        Raises NotLeader if the lease is lost or the version race is lost
        :data:`CLAIM_ATTEMPTS` times; ZooKeeperUnavailable or a KazooException if ZooKeeper
        fails a request.
        """
        for _ in range(CLAIM_ATTEMPTS):
            with self._send_lock:
                ensure_held(self.lease)
                records = self._store.load()
                # Entries no leader has seen yet: their first-seen time goes in with the claim.
                first_seen = records_of_new_entries(self.scheduler.schedule, records)
                try:
                    self._store.save(self._document({**records, **first_seen}))
                except Superseded:
                    continue
            self.records = {**records, **first_seen}
            apply_records(self.scheduler.schedule, records)
            return
        raise NotLeader("the schedule's state kept changing under a new leader's claim")

    def tick(self) -> float:
        """One tick of the wrapped scheduler; raises NotLeader where it must not send.

        Entries that appeared in the schedule since the last tick (a scheduler that reloads its
        schedule, such as django-celery-beat's) are recorded first, with their own first-seen
        time, as the claim does for those present at the start of the term."""
        first_seen = records_of_new_entries(self.scheduler.schedule, self.records)
        if first_seen or self._unsaved:
            with self._send_lock:
                ensure_held(self.lease)
                self.records.update(first_seen)
                self._save()
        return float(self.scheduler.tick())

    def is_due(self, entry: Any) -> Any:
        record = self.records.get(entry.name)
        if record is not None:
            apply_record(entry, record)
        return self._is_due(entry)

    def reserve(self, entry: Any) -> Any:
        ensure_held(self.lease)
        new_entry = self._reserve(entry)
        self._pending[new_entry.name] = record_of(new_entry)
        return new_entry

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        with self._send_lock:
            ensure_held(self.lease)
            try:
                result = self._apply_async(entry, producer=producer, advance=advance, **kwargs)
            except (Exception, NotLeader):
                # Also after a failed send: Celery's reserve consumed that due time (it does not
                # retry a send every tick), and the state must say what the scheduler believes.
                self._record(entry.name)
                raise
            except BaseException:
                # SystemExit or KeyboardInterrupt (celery beat's SIGTERM/SIGINT handler raises
                # it wherever the main thread is): recorded too, but the stop must reach Celery's
                # loop whatever the record meets, not a NotLeader its tick would swallow.
                try:
                    self._record(entry.name)
                except NotLeader as exc:
                    logger.warning("beat: stopping; the send in progress is not recorded: %s", exc)
                raise
            self._record(entry.name)
            return result

    def _record(self, name: str) -> None:
        record = self._pending.pop(name, None)
        if record is None:
            return
        ensure_held(self.lease)
        self.records[name] = record
        self._save()

    def _save(self) -> None:
        try:
            self._store.save(self._document(self.records))
        except Superseded as exc:
            raise NotLeader(f"another beat wrote the schedule's state: {exc}") from exc
        except (ZooKeeperUnavailable, KazooException) as exc:
            # Written or not, we do not know; the next write checks which (ZooKeeperState) and
            # carries this record too. Until then a takeover would send this due time again.
            logger.warning("beat: the last send is not recorded in ZooKeeper yet: %r", exc)
            self._unsaved = True
        else:
            self._unsaved = False

    def _document(self, records: Mapping[str, RunRecord]) -> bytes:
        return encode_state(
            records,
            leader=self._leader,
            token=self.lease.token,
            written_at=datetime.now(timezone.utc),
        )

    def close(self) -> None:
        """Close the wrapped scheduler (it syncs its own store); errors are logged."""
        close_quietly(self.scheduler)


def close_quietly(scheduler: Any) -> None:
    """``scheduler.close()``, logging instead of raising: a term ends whatever its store does."""
    try:
        scheduler.close()
    except Exception:
        logger.exception("beat: closing the scheduler of a term failed")


class ZooKeeperState:
    """The state node at ``path``: read after a ``sync``, written with versioned requests.

    :meth:`save` raises :class:`Superseded` when someone else wrote since our last read or
    write. After a write whose outcome is unknown (no answer in time, connection lost), the
    next :meth:`save` reads the node first: holding our own last attempt it was written, holding
    what we last knew it was not, anything else is someone else's write.
    """

    def __init__(self, client: KazooClient, path: str, timeout: Callable[[], float]) -> None:
        self._client = client
        self._path = path
        self._timeout = timeout
        self._version: int | None = None  # None: the node does not exist
        self._known = b""
        self._attempted: bytes | None = None

    def _wait(self, request: Any, what: str) -> Any:
        return wait_result(request, Deadline(self._timeout()), f"{what} {self._path}")

    def _read(self) -> tuple[bytes, int | None]:
        self._wait(self._client.sync_async(self._path), "syncing before reading")
        try:
            data, stat = self._wait(self._client.get_async(self._path), "reading")
        except NoNodeError:
            return b"", None
        return bytes(data or b""), int(stat.version)

    def load(self) -> dict[str, RunRecord]:
        data, version = self._read()
        self._known, self._version, self._attempted = data, version, None
        try:
            return decode_state(data)
        except ValueError:
            logger.error(
                "beat: the schedule's state at %s cannot be read; starting from the "
                "scheduler's own last run times and overwriting it",
                self._path,
                exc_info=True,
            )
            return {}

    def save(self, data: bytes) -> None:
        if self._attempted is not None:
            current, version = self._read()
            if version is not None and current == self._attempted:
                self._known, self._version = current, version
            elif current != self._known or version != self._version:
                raise Superseded(f"{self._path} changed under us (version {version})")
            self._attempted = None
        self._attempted = data
        try:
            if self._version is None:
                self._wait(self._client.create_async(self._path, data, makepath=True), "creating")
                self._version = 0
            else:
                stat = self._wait(
                    self._client.set_async(self._path, data, version=self._version), "writing"
                )
                self._version = int(stat.version)
        except (BadVersionError, NodeExistsError, NoNodeError) as exc:
            self._attempted = None
            raise Superseded(f"{self._path}: {type(exc).__name__}") from exc
        self._known, self._attempted = data, None


# -- the election -------------------------------------------------------------------------------


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


# -- the scheduler ------------------------------------------------------------------------------


class LeaderScheduler:
    """A ``celery beat`` scheduler that sends only while this process is the elected leader.

    ``celery -A proj beat -S celery_zklock.beat:LeaderScheduler`` on as many hosts as you like;
    see the module docstring for the election, the guarantee and the state. Every keyword
    ``celery beat`` passes (``schedule_filename``, ``max_interval``, ...) goes to the wrapped
    scheduler. ``lazy=True`` (``celery beat``'s banner) connects to nothing.

    The interface ``celery.beat.Service`` uses (``tick``, ``max_interval``, ``should_sync``,
    ``_do_sync``, ``sync``, ``close``, ``info``) is implemented here; any other attribute is the
    current term's scheduler's, or, on a standby, that of an unstarted (lazy) instance.
    """

    def __init__(self, app: Any, *, lazy: bool = False, Producer: Any = None, **kwargs: Any):
        self.app = app
        self.settings = beat_settings(app)
        self._scheduler_cls = scheduler_class(self.settings.scheduler)
        self._kwargs = kwargs
        self._producer_cls = Producer or app.amqp.Producer
        self._idle: Any = self._scheduler_cls(app=app, lazy=True, **kwargs)
        self.max_interval: float = self._idle.max_interval
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self._send_lock = SendLock()
        self._term: Term | None = None
        self._closed = False
        self._client: KazooClient | None = None
        self._store: ZooKeeperState | None = None
        self._elector: Elector | None = None
        if not lazy:
            self._start()

    def _start(self) -> None:
        config = settings_of(self.app).client
        client = new_client(config)
        adapter.install_connect_hook()
        mutex = Mutex(client, self.settings.election)
        self._client = client
        self._store = ZooKeeperState(client, self.settings.state, lambda: mutex.session_timeout / 3)
        self._elector = Elector(mutex, self.identity, self._send_lock, config.session_timeout)
        connected = client.start_async()
        self._elector.start()
        logger.info(
            "beat: contending for %s as %s (wrapping %s)",
            self.settings.election,
            self.identity,
            self.settings.scheduler,
        )
        connected.wait(config.connect_timeout)
        if not client.connected:
            problem = tls_problem(config) if config.use_ssl else None
            logger.warning(
                "beat: ZooKeeper (%s) not reached within %gs; a standby until it is%s",
                config.hosts,
                config.connect_timeout,
                f": {problem}" if problem else "",
            )

    # -- what celery.beat.Service calls ---------------------------------------------------------
    def tick(self) -> float:
        """As the leader, one tick of the wrapped scheduler; as a standby, wait to be elected
        (at most ``max_interval``). Returns the seconds until the next tick."""
        elector = self._elector
        if elector is None or self._closed:
            return float(self.max_interval)
        term = self._current_term(elector)
        if term is None:
            elector.changed.wait(self.max_interval)
            return 0.0
        try:
            return term.tick()
        except NotLeader as exc:
            logger.warning("beat: stopped sending: %s", exc)
            self._end_term(term, resign=term.lease.held)
            return 0.0

    def _current_term(self, elector: Elector) -> Term | None:
        elector.changed.clear()  # before reading the lease: a change after it wakes the wait
        lease = elector.lease
        term = self._term
        if term is not None and (term.lease is not lease or not term.lease.held):
            logger.warning("beat: the leader lease is gone; stopped sending")
            self._end_term(term, resign=False)
            term = None
        if term is None and lease is not None and lease.held:
            term = self._begin_term(elector, lease)
        return term

    def _begin_term(self, elector: Elector, lease: Lease) -> Term | None:
        assert self._store is not None
        scheduler = None
        try:
            scheduler = self._scheduler_cls(
                app=self.app,
                Producer=guarded_producer(self._producer_cls, lambda: ensure_held(lease)),
                **self._kwargs,
            )
            term = Term(lease, scheduler, self._store, self._send_lock, self.identity)
            term.claim()
        except (NotLeader, ZooKeeperUnavailable, KazooException) as exc:
            logger.warning("beat: could not take up the leadership, contending again: %r", exc)
            if scheduler is not None:
                close_quietly(scheduler)
            elector.resign(lease)
            return None
        except BaseException:
            if scheduler is not None:
                close_quietly(scheduler)
            elector.resign(lease)
            raise
        self._term = term
        logger.info(
            "beat: leading with token %d; the state of %d entries kept in %s",
            lease.token,
            len(term.records),
            self.settings.state,
        )
        return term

    def _end_term(self, term: Term, *, resign: bool) -> None:
        if self._term is term:
            self._term = None
        term.close()
        if resign and self._elector is not None:
            self._elector.resign(term.lease)

    def should_sync(self) -> bool:
        term = self._term
        return bool(term.scheduler.should_sync()) if term is not None else False

    def _do_sync(self) -> None:
        term = self._term
        if term is not None:
            term.scheduler._do_sync()

    def sync(self) -> None:
        term = self._term
        if term is not None:
            term.scheduler.sync()

    def close(self) -> None:
        """Stop leading and contending: close the term's scheduler, release the lease (a
        standby is granted at once) and close this beat's ZooKeeper session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._send_lock.held_here:
            # Called inside a send on this very thread (celery beat's SIGTERM handler, which
            # then raises SystemExit there): releasing the lease now would let a standby lead
            # before this send is recorded, and it would send the same due time again. Done
            # instead when the send lets go of the lock, its record written.
            self._send_lock.defer(self._shut_down)
            return
        self._shut_down()

    def _shut_down(self) -> None:
        with self._send_lock:
            term, self._term = self._term, None
            if term is not None:
                term.close()
            if self._elector is not None:
                self._elector.stop()
        client = self._client
        if client is not None:
            try:
                client.stop()
                client.close()
            except Exception:
                logger.debug("beat: error closing the ZooKeeper client", exc_info=True)
        if self._elector is not None and self._elector.is_alive():
            self._elector.join(timeout=2.0)

    @property
    def info(self) -> str:
        inner = self._idle.info
        line = f"    . leader election -> {self.settings.election} (runs {self.settings.scheduler})"
        return f"{line}\n{inner}" if inner else line

    @property
    def is_leader(self) -> bool:
        """True while this beat holds a term of leadership (and may send)."""
        term = self._term
        return term is not None and term.lease.held

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        term = self.__dict__.get("_term")
        target = term.scheduler if term is not None else self.__dict__.get("_idle")
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)
