"""Fault injection for fleet runs: each fault aimed at a worker process inside a critical section.

A plan (:func:`parse_faults`, e.g. ``kill:3,pause:3,expire:3,leader:3,partition:3,
redis_restart:3``, or ``all:3``) says how many of each kind; :class:`FaultInjector` runs them one
after another, interleaved (:func:`fault_order`), ``gap`` seconds apart, and records each one
(:class:`~workers.record.FaultRecord`) in the run's :class:`~workers.record.FaultLog`: ``ran``
is False, with the reason in ``detail``, for a fault that could not be injected.

Targets come from the run's section records (:class:`OpenSections`): a section whose ``enter``
has no ``exit`` yet is open, and its ``hostname``/``pid`` name the process inside it, its
``node`` the lock node whose ``ephemeralOwner`` is that process's ZooKeeper session. The kinds:

- ``kill``: SIGKILL the holder process. Once it is gone, a ``killed`` event is recorded
  (:meth:`~workers.record.SectionRecorder.record_kill`). A prefork pool process is replaced by
  its pool (and its message requeued at once: ``task_reject_on_worker_lost``); a worker's main
  process (threads, solo) takes its whole worker down: the fleet restarts it, and its messages
  come back after the broker's visibility timeout.
- ``pause``: SIGSTOP the holder until the server expired its session (its lock node is gone:
  a GC pause past the session timeout), then SIGCONT.
- ``expire``: expire the holder's session on the server (:func:`expire_session`).
- ``leader``: SIGKILL the ZooKeeper leader, wait for a new one, restart the killed node.
  Ensemble only.
- ``partition``: cut the ZooKeeper link of a holder that runs in a network namespace
  (:mod:`workers.netns`) until the server expired its session, then heal it.
- ``redis_restart``: SIGKILL the broker Redis and restart it (it must be persistent:
  ``appendonly`` with ``appendfsync always`` loses no message). The Redis holding the records,
  fence and results is a separate server, outside this fault's reach.

Process faults need the processes on this machine; in an external run (no local fleet or
stack) they are recorded as not run. ``expire`` needs only ZooKeeper and runs anywhere.
The injector changes processes (restarts workers, ZooKeeper nodes, Redis): run it in the main
thread, whose children those processes become (see :mod:`celery_zklock.testing.processes`).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Final

from kazoo.client import KazooClient

from celery_zklock.testing import RedisServer, ZooKeeperEnsemble, ZooKeeperServer
from workers.fleet import Fleet, FleetWorker, pid_alive
from workers.netns import unavailable_reason
from workers.record import (
    FAULT_KINDS,
    FaultLog,
    FaultRecord,
    SectionEvent,
    SectionRecorder,
    events_key,
)

__all__ = [
    "FaultEnvironment",
    "FaultInjector",
    "OpenSections",
    "count_ran",
    "describe_plan",
    "expire_session",
    "fault_order",
    "kill_process",
    "parse_faults",
    "quiet_kazoo_logger",
    "session_password",
]

POLL: Final = 0.02
ZK_CALL_TIMEOUT: Final = 5.0

# ------------------------------------------------------------------------------------ plans


def parse_faults(text: str) -> dict[str, int]:
    """``"kill:3,pause:2"`` -> ``{"kill": 3, "pause": 2}``; ``"all:N"`` means every kind N times.

    An empty text is no fault. Raises ValueError naming the bad entry.
    """
    plan: dict[str, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        kind, sep, count_text = entry.partition(":")
        kind = kind.strip().replace("-", "_")
        try:
            count = int(count_text) if sep else 1
        except ValueError:
            raise ValueError(f"fault {entry!r}: the count must be a whole number") from None
        if count < 0:
            raise ValueError(f"fault {entry!r}: the count must be >= 0")
        kinds = FAULT_KINDS if kind == "all" else (kind,)
        for one in kinds:
            if one not in FAULT_KINDS:
                raise ValueError(
                    f"unknown fault {kind!r}: choose from {', '.join(FAULT_KINDS)} or all"
                )
            plan[one] = plan.get(one, 0) + count
    return {kind: n for kind, n in plan.items() if n > 0}


def fault_order(plan: Mapping[str, int], seed: int = 0) -> list[str]:
    """The faults of ``plan`` in the order they run: rounds of one of each kind still due, each
    round shuffled with ``seed``, so every kind is spread over the whole run."""
    rng = random.Random(seed)
    due = dict(plan)
    order: list[str] = []
    while any(due.values()):
        round_ = [kind for kind in FAULT_KINDS if due.get(kind, 0) > 0]
        rng.shuffle(round_)
        for kind in round_:
            due[kind] -= 1
        order += round_
    return order


# ------------------------------------------------------------------------ session expiry

_JAVA_MULTIPLIER: Final = 0x5DEECE66D
_JAVA_MASK: Final = (1 << 48) - 1
# ZooKeeperServer.generatePasswd seeds java.util.Random with (session id ^ this constant).
_ZK_SUPER_SECRET: Final = 0xB3415C00


def session_password(session_id: int) -> bytes:
    """The 16-byte password ZooKeeper gave session ``session_id``.

    The server derives it from the id alone (``new java.util.Random(id ^ 0xB3415C00)
    .nextBytes(16 bytes)``), so a session can be taken over, and closed, knowing only its id:
    which the ``ephemeralOwner`` of any of its ephemeral nodes gives.
    """
    seed = ((session_id ^ _ZK_SUPER_SECRET) ^ _JAVA_MULTIPLIER) & _JAVA_MASK
    out = bytearray()
    while len(out) < 16:
        seed = (seed * _JAVA_MULTIPLIER + 0xB) & _JAVA_MASK
        word = seed >> 16  # java.util.Random.next(32)
        for _ in range(min(4, 16 - len(out))):
            out.append(word & 0xFF)
            word >>= 8
    return bytes(out)


def expire_session(hosts: str, session_id: int, timeout: float = 15.0) -> None:
    """Expire session ``session_id`` on the server: its ephemeral nodes go at once.

    A second client attaches to the session (:func:`session_password`) and closes it: the real
    server-side expiry, as when the session times out. The owner's connection is dropped and
    its next reconnect is told the session expired.
    """
    twin = KazooClient(
        hosts=hosts,
        client_id=(session_id, session_password(session_id)),
        logger=quiet_kazoo_logger(),
    )
    try:
        twin.start(timeout=timeout)
        twin.stop()
    finally:
        twin.close()


def quiet_kazoo_logger() -> logging.Logger:
    """A logger for our own kazoo clients: their connection drops during a fault are expected,
    and without a handler Python would print each warning to stderr."""
    logger = logging.getLogger("workers.faults.kazoo")
    logger.setLevel(logging.ERROR)
    return logger


# ------------------------------------------------------------------------------ processes


def kill_process(pid: int, timeout: float = 10.0) -> float:
    """SIGKILL ``pid`` and wait until it is gone (or a zombie); return the seconds that took.

    Raises TimeoutError if it is still alive after ``timeout`` seconds.
    """
    started = time.monotonic()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return 0.0
    if not _wait_for(lambda: not pid_alive(pid), timeout):
        raise TimeoutError(f"process {pid} is still alive {timeout:.0f} s after SIGKILL")
    return time.monotonic() - started


def _wait_for(predicate: Callable[[], bool], timeout: float, interval: float = POLL) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


# ---------------------------------------------------------------------------------- targets


class OpenSections:
    """The sections of a run that are open now, read incrementally from its event list.

    :meth:`refresh` reads the events appended since the last call; ``killed`` events close the
    sections of their process.
    """

    def __init__(self, redis: Any, run_id: str) -> None:
        self._redis = redis
        self._key = events_key(run_id)
        self._cursor = 0
        self._open: dict[str, SectionEvent] = {}

    def refresh(self) -> list[SectionEvent]:
        """The open sections' ``enter`` events, oldest first."""
        raw = self._redis.lrange(self._key, self._cursor, -1)
        self._cursor += len(raw)
        for item in raw:
            event = SectionEvent.from_json(item)
            if event.kind == "enter":
                self._open[event.holder] = event
            elif event.kind == "exit":
                self._open.pop(event.holder, None)
            elif event.kind == "killed":
                for holder, entered in list(self._open.items()):
                    if (entered.hostname, entered.pid) == (event.hostname, event.pid):
                        del self._open[holder]
        return list(self._open.values())


@dataclass
class FaultEnvironment:
    """What the injector may act on. ``records`` is a client of the Redis holding the run's
    records (outside the fault domain); ``zk_hosts`` reaches ZooKeeper from this process.
    ``fleet``, ``zookeeper`` and ``broker`` are None in an external run."""

    run_id: str
    records: Any
    zk_hosts: str
    session_timeout: float
    fleet: Fleet | None = None
    zookeeper: ZooKeeperServer | ZooKeeperEnsemble | None = None
    broker: RedisServer | None = None


@dataclass(frozen=True)
class _Target:
    event: SectionEvent
    worker: FleetWorker | None
    session_id: int

    def describe(self) -> str:
        e = self.event
        where = ""
        if self.worker is not None:
            role = "main process" if self.worker.pid == e.pid else "pool process"
            where = f" ({self.worker.spec.pool} {role})"
        return (
            f"{e.hostname} pid {e.pid}{where} holding {e.key} ({e.mode}, token {e.token}, "
            f"task {e.task_id}, session 0x{self.session_id:x})"
        )


class _NotRun(Exception):
    """The fault could not be injected; the message says why."""


class FaultInjector:
    """Runs a fault plan against a run (see the module docstring).

    ``gap`` seconds separate two faults; a fault that needs a holder waits up to
    ``target_timeout`` seconds for one. Call :meth:`close` at the end (it also undoes a fault
    interrupted half-way: resumes a paused process, heals a cut link).
    """

    def __init__(
        self,
        env: FaultEnvironment,
        plan: Mapping[str, int],
        *,
        seed: int = 0,
        gap: float = 1.0,
        target_timeout: float = 30.0,
    ) -> None:
        self.env = env
        self.order = fault_order(plan, seed)
        self.records: list[FaultRecord] = []
        self.gap = gap
        self.target_timeout = target_timeout
        self._rng = random.Random(seed)
        self._log = FaultLog(env.records, env.run_id)
        self._recorder = SectionRecorder(env.records, env.run_id)
        self._sections = OpenSections(env.records, env.run_id)
        self._stop = threading.Event()
        self._zk: KazooClient | None = None
        self._undo: list[Callable[[], None]] = []

    # -- progress -----------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self.order)

    @property
    def done(self) -> int:
        return len(self.records)

    def pending(self) -> bool:
        """True while faults of the plan are still to run."""
        return self.done < self.total and not self._stop.is_set()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the fault in progress (safe from any thread)."""
        self._stop.set()

    # -- running ------------------------------------------------------------------------
    def run(self) -> list[FaultRecord]:
        """Run every fault of the plan in order (until :meth:`stop`); return their records.

        Faults not reached because of :meth:`stop` are recorded as not run.
        """
        for index, kind in enumerate(self.order):
            if self._stop.wait(self.gap if index else 0.0):
                self._record(FaultRecord(kind, time.time(), "", False, "the run ended first"))
                continue
            self._record(self.inject(kind))
            self.revive()  # a worker that died of it (or of anything else)
        return list(self.records)

    def revive(self) -> None:
        """Restart fleet workers that died on their own (a worker the broker restart crashed),
        first recording the death of every process with a section open in them."""
        if self.env.fleet is not None:
            self.env.fleet.revive(on_dead=self._record_deaths)

    def _record_deaths(self, worker: FleetWorker) -> None:
        now = time.time()
        dead = {(e.hostname, e.pid) for e in self._sections.refresh()}
        for hostname, pid in sorted(dead):
            if hostname == worker.nodename:
                self._recorder.record_kill(hostname, pid, now)

    def inject(self, kind: str) -> FaultRecord:
        """Inject one fault of ``kind`` now (waiting for a target if it needs one)."""
        method: Callable[[], FaultRecord] = getattr(self, f"_{kind}")
        try:
            return method()
        except _NotRun as exc:
            return FaultRecord(kind, time.time(), "", False, str(exc))
        except Exception as exc:
            return FaultRecord(kind, time.time(), "", False, f"error: {exc!r}")
        finally:
            self._run_undo()

    def close(self) -> None:
        """Undo whatever a fault left behind and close the ZooKeeper client. Idempotent."""
        self._stop.set()
        self._run_undo()
        if self._zk is not None:
            self._zk.stop()
            self._zk.close()
            self._zk = None

    def _record(self, record: FaultRecord) -> None:
        self.records.append(record)
        self._log.record(record)

    @contextmanager
    def _undo_on_exit(self, undo: Callable[[], None]) -> Iterator[None]:
        """Run ``undo`` when the block ends, or in :meth:`close` if we never get there."""
        self._undo.append(undo)
        try:
            yield
        finally:
            if undo in self._undo:
                self._undo.remove(undo)
                undo()

    def _run_undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- ZooKeeper from here ------------------------------------------------------------
    def _client(self) -> KazooClient:
        if self._zk is None:
            client = KazooClient(hosts=self.env.zk_hosts, logger=quiet_kazoo_logger())
            client.start(timeout=15)
            self._zk = client
        return self._zk

    def _session_of(self, node: str) -> int | None:
        """The session owning ephemeral ``node``, or None if the node is gone (or unknown)."""
        try:
            stat = self._client().exists_async(node).get(timeout=ZK_CALL_TIMEOUT)
        except Exception:
            return None
        return int(stat.ephemeralOwner) if stat is not None and stat.ephemeralOwner else None

    def _wait_node_gone(self, node: str, timeout: float) -> float | None:
        """Seconds until ``node`` disappeared, or None if it is still there at the deadline."""
        started = time.monotonic()

        def gone() -> bool:
            try:
                return self._client().exists_async(node).get(timeout=ZK_CALL_TIMEOUT) is None
            except Exception:
                return False

        return time.monotonic() - started if _wait_for(gone, timeout, 0.05) else None

    def _expiry_deadline(self) -> float:
        """How long a server may take to expire a silent session, with room to spare."""
        return 3 * self.env.session_timeout + 10.0

    # -- targets ------------------------------------------------------------------------
    def _holder(self, *, netns_only: bool = False, local: bool = True) -> _Target:
        """Wait for a process inside a section (alive, ours; in a namespace if ``netns_only``)
        whose lock node still exists; raise _NotRun after ``target_timeout`` seconds."""
        fleet = self.env.fleet
        if local and fleet is None:
            raise _NotRun("external run: the worker processes are not on this machine")
        deadline = time.monotonic() + self.target_timeout
        while not self._stop.is_set():
            candidates = []
            for event in self._sections.refresh():
                worker = fleet.find(event.pid) if fleet is not None else None
                if local and (worker is None or not pid_alive(event.pid)):
                    continue
                if netns_only and (worker is None or worker.netns is None):
                    continue
                candidates.append((event, worker))
            self._rng.shuffle(candidates)
            for event, worker in candidates:
                session = self._session_of(event.node)
                if session is not None:
                    return _Target(event, worker, session)
            if time.monotonic() >= deadline:
                what = "a worker in a network namespace" if netns_only else "a worker"
                raise _NotRun(f"{what} was not inside a section within {self.target_timeout:g} s")
            time.sleep(POLL)
        raise _NotRun("the run ended before a target was found")

    def _under_load(self) -> None:
        """Wait (up to ``target_timeout``) until some section is open, so that a fault of the
        shared infrastructure lands while locks are held; go ahead anyway after that."""
        _wait_for(
            lambda: self._stop.is_set() or bool(self._sections.refresh()), self.target_timeout
        )

    # -- the faults -----------------------------------------------------------------------
    def _kill(self) -> FaultRecord:
        target = self._holder()
        event, worker, fleet = target.event, target.worker, self.env.fleet
        assert worker is not None and fleet is not None  # local targets always have them
        described = target.describe()  # before the worker's pid changes
        killed_at = time.time()
        if worker.pid == event.pid:
            worker.kill()  # a main process: the whole worker (and its group) goes
            self._recorder.record_kill(event.hostname, event.pid, time.time())
            started = time.monotonic()
            try:
                fleet.restart(worker)
                restarted = f"the fleet restarted the worker in {time.monotonic() - started:.1f} s"
            except Exception as exc:  # the kill happened: record it, with why the worker is down
                restarted = f"the worker did not restart: {exc}"
            detail = (
                f"SIGKILL of the worker's main process; {restarted}; its messages return after "
                "the broker's visibility timeout"
            )
        else:
            took = kill_process(event.pid)
            self._recorder.record_kill(event.hostname, event.pid, time.time())
            detail = (
                f"SIGKILL of a pool process, gone after {took * 1000:.0f} ms; its pool replaces "
                "it and its message is requeued"
            )
        return FaultRecord("kill", killed_at, described, True, detail)

    def _still_holding(self, target: _Target) -> bool:
        """True if ``target``'s lock node still belongs to its session (checked after a fault
        landed: the holder may have let go just before)."""
        return self._session_of(target.event.node) == target.session_id

    def _pause(self) -> FaultRecord:
        while True:
            target = self._holder()
            pid = target.event.pid
            paused_at = time.time()
            started = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            if self._still_holding(target):
                break
            _resume(pid)  # it released the lock before the stop landed: aim again
        with self._undo_on_exit(lambda: _resume(pid)):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        paused = time.monotonic() - started
        if expired_after is None:
            detail = f"SIGSTOP for {paused:.1f} s, but its session did not expire meanwhile"
        else:
            detail = (
                f"SIGSTOP for {paused:.1f} s (the server expired its session after "
                f"{expired_after:.1f} s), then SIGCONT"
            )
        return FaultRecord("pause", paused_at, target.describe(), True, detail)

    def _expire(self) -> FaultRecord:
        target = self._holder(local=False)
        expired_at = time.time()
        expire_session(self.env.zk_hosts, target.session_id)
        gone = self._wait_node_gone(target.event.node, 10.0)
        detail = "session closed on the server; its lock node went after " + (
            f"{gone * 1000:.0f} ms" if gone is not None else "more than 10 s (still there)"
        )
        return FaultRecord("expire", expired_at, target.describe(), True, detail)

    def _leader(self) -> FaultRecord:
        ensemble = self.env.zookeeper
        if not isinstance(ensemble, ZooKeeperEnsemble):
            raise _NotRun(
                "needs a local ZooKeeper ensemble ("
                + ("external run" if ensemble is None else "this run has a standalone server")
                + ")"
            )
        self._under_load()
        myid = ensemble.leader(timeout=30)
        pid = ensemble.node(myid).pid
        killed_at = time.time()
        started = time.monotonic()
        ensemble.kill(myid)
        with self._undo_on_exit(lambda: _restart_node(ensemble, myid)):
            successor = ensemble.leader(timeout=30)
            elected = time.monotonic() - started
        back = time.monotonic() - started
        detail = (
            f"SIGKILL of the leader; node {successor} led after {elected:.2f} s; node {myid} "
            f"restarted and serving after {back:.2f} s"
        )
        return FaultRecord("leader", killed_at, f"ZooKeeper node {myid} (pid {pid})", True, detail)

    def _partition(self) -> FaultRecord:
        fleet = self.env.fleet
        if fleet is None:
            raise _NotRun("external run: the worker processes are not on this machine")
        if not any(w.netns is not None for w in fleet):
            reason = unavailable_reason() or "the run was started without such a worker"
            raise _NotRun(f"no worker runs in a network namespace: {reason}")
        while True:
            target = self._holder(netns_only=True)
            namespace = target.worker.netns if target.worker is not None else None
            assert namespace is not None
            cut_at = time.time()
            started = time.monotonic()
            namespace.cut()
            if self._still_holding(target):
                break
            namespace.heal()  # it released the lock before the cut: aim again
        with self._undo_on_exit(namespace.heal):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        cut_for = time.monotonic() - started
        detail = f"ZooKeeper link of netns {namespace.name} down for {cut_for:.1f} s" + (
            f" (the server expired the session after {expired_after:.1f} s), then healed"
            if expired_after is not None
            else ", healed before the session expired"
        )
        return FaultRecord("partition", cut_at, target.describe(), True, detail)

    def _redis_restart(self) -> FaultRecord:
        broker = self.env.broker
        if broker is None:
            raise _NotRun("external run: the broker is not a local Redis")
        self._under_load()
        port = broker.port
        killed_at = time.time()
        down = broker.restart()
        detail = f"SIGKILL and restart of the broker Redis; down {down:.2f} s"
        return FaultRecord("redis_restart", killed_at, f"broker Redis on port {port}", True, detail)


def _resume(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _restart_node(ensemble: ZooKeeperEnsemble, myid: int) -> None:
    if not ensemble.node(myid).is_running():
        ensemble.restart(myid, timeout=30)


def describe_plan(plan: Mapping[str, int]) -> str:
    """``kill x3, pause x3`` (``no faults`` for an empty plan)."""
    return ", ".join(f"{kind} x{n}" for kind, n in plan.items()) or "no faults"


def count_ran(records: Sequence[FaultRecord]) -> dict[str, int]:
    """Per kind, how many faults really ran."""
    counts: dict[str, int] = {}
    for record in records:
        if record.ran:
            counts[record.kind] = counts.get(record.kind, 0) + 1
    return counts
