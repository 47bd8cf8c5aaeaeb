"""``LeaderScheduler``, the ``celery beat`` scheduler of a highly available beat group
(``celery -A proj beat -S celery_zklock.beat:LeaderScheduler``): every beat process runs it,
only the elected one (:mod:`celery_zklock.beat.election`) sends. For each term of leadership it
builds an instance of the scheduler class ``zklock_beat_scheduler`` names and delegates every
tick to it (a :class:`Term`), wrapping that instance's ``is_due``, ``reserve`` and
``apply_async`` and its producer's publish so that every send is checked against the lease
before and recorded in the schedule's state (:mod:`celery_zklock.beat.state`) after; the
wrapped class must tick the way :class:`celery.beat.Scheduler` does. The guarantees (it stops
sending before another beat can lead; exactly once at a takeover, except a send whose record did
not reach ZooKeeper) and their limits: ``docs/beat.md``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from typing import Any, Final

from celery.utils.imports import load_extension_class_names, symbol_by_name
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock.beat.election import Elector, NotLeader, SendLock, ensure_held
from celery_zklock.beat.state import (
    RunRecord,
    StateStore,
    Superseded,
    ZooKeeperState,
    apply_record,
    apply_records,
    encode_state,
    record_of,
    records_of_new_entries,
)
from celery_zklock.errors import ConfigurationError, ZooKeeperUnavailable
from celery_zklock.locks import Lease, Mutex
from celery_zklock.locks.lease import HeldLease
from celery_zklock.zk import adapter
from celery_zklock.zk.client import new_client, tls_problem
from celery_zklock.zk.settings import BeatSettings, settings_of

logger = logging.getLogger("celery_zklock.beat")

CLAIM_ATTEMPTS: Final = 3
"""How often a new leader re-reads the state when its first write loses a version race."""


# -- settings -----------------------------------------------------------------------------------


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


def guarded_producer(base: type[Any], check: Callable[[], None]) -> type[Any]:
    """A subclass of the producer class ``base`` that calls ``check()`` before every publish
    attempt (kombu's ``Producer.publish`` calls ``_publish`` once per attempt, again for each
    retry after a reconnect)."""

    class GuardedProducer(base):  # type: ignore[misc]
        def _publish(self, *args: Any, **kwargs: Any) -> Any:
            check()
            return super()._publish(*args, **kwargs)

    return GuardedProducer


class Term:
    """One term of leadership: the wrapped scheduler instance built for it, its lease, and the
    schedule's state in ZooKeeper.

    :meth:`claim` loads the stored state and fences older leaders before the first
    :meth:`tick`; each tick is the wrapped scheduler's own, with its ``is_due``, ``reserve`` and
    ``apply_async`` wrapped on the instance (see ``docs/beat.md``). ``send_lock`` is held
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
        # The instance's own methods kept, ours put in their place:
        self._is_due, scheduler.is_due = scheduler.is_due, self.is_due
        self._reserve, scheduler.reserve = scheduler.reserve, self.reserve
        self._apply_async, scheduler.apply_async = scheduler.apply_async, self.apply_async

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


# -- the scheduler ------------------------------------------------------------------------------


class LeaderScheduler:
    """A ``celery beat`` scheduler that sends only while this process is the elected leader.

    ``celery -A proj beat -S celery_zklock.beat:LeaderScheduler`` on as many hosts as you like;
    see ``docs/beat.md`` for the election, the guarantee and the state. Every keyword
    ``celery beat`` passes (``schedule_filename``, ``max_interval``, ...) goes to the wrapped
    scheduler. ``lazy=True`` (``celery beat``'s banner) connects to nothing.

    The interface ``celery.beat.Service`` uses (``tick``, ``max_interval``, ``should_sync``,
    ``_do_sync``, ``sync``, ``close``, ``info``) is implemented here; any other attribute is the
    current term's scheduler's, or, on a standby, that of an unstarted (lazy) instance.
    """

    def __init__(self, app: Any, *, lazy: bool = False, Producer: Any = None, **kwargs: Any):
        self.app = app
        self.settings: BeatSettings = settings_of(app).beat
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
        except BaseException as exc:
            failed = isinstance(exc, (NotLeader, ZooKeeperUnavailable, KazooException))
            if failed:  # anything else (a bug, a stop) is raised, after the same clean-up
                logger.warning("beat: could not take up the leadership, contending again: %r", exc)
            if scheduler is not None:
                close_quietly(scheduler)
            elector.resign(lease)
            if not failed:
                raise
            return None
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
