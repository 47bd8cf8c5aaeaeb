"""Fault injection for fleet runs: each fault aimed at a worker process inside a critical section.

A plan (:func:`parse_faults`: ``kill:3,pause:3`` or ``all:3``) says how many of each kind;
:class:`FaultInjector` runs them interleaved (:func:`fault_order`), aims each at a process inside
an open section (:class:`OpenSections`) and records what it did in the run's
:class:`~workers.record.FaultLog`, with the reason when it could not. What each kind does, and
why ``pause`` and ``expire`` record a forced loss, is in ``docs/fleet.md``. The injector restarts
processes: run it in the main thread (see :mod:`celery_zklock.testing.processes`).
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import random
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any, Final

from celery.utils import worker_direct
from kazoo.client import KazooClient

from celery_zklock.testing import RedisServer, ZooKeeperEnsemble, ZooKeeperServer
from celery_zklock.testing.processes import pause_process, pid_alive
from celery_zklock.testing.rabbitmq import RabbitMQServer
from celery_zklock.testing.zookeeper import partition_unavailable_reason
from celery_zklock.zk import four_letter
from workers.chatter import IN_PROCESS_POOLS, start_chatter, stop_chatter
from workers.fleet import Fleet, FleetWorker, WorkerSpec
from workers.netns import Namespace, blackhole_unavailable_reason, unavailable_reason
from workers.record import (
    EXPIRE_CALL_TIMEOUT,
    FAULT_ALIASES,
    FAULT_KINDS,
    MAIN_PROCESS_KILL,
    FaultLog,
    FaultRecord,
    SectionEvent,
    SectionRecorder,
    events_key,
)
from workers.settings import is_amqp
from workers.tasks import EXCLUSIVE_TASK

__all__ = [
    "FaultEnvironment",
    "FaultInjector",
    "OpenSections",
    "describe_plan",
    "expire_session",
    "fault_order",
    "gate_holdings",
    "held_at_gates",
    "kill_process",
    "parse_faults",
    "quiet_kazoo_logger",
    "session_member",
    "session_password",
]

POLL: Final = 0.02
UNAVAILABLE: Final = "unavailable here: "
"""How the record of a fault that this run cannot inject at all begins."""
ZK_CALL_TIMEOUT: Final = 5.0
PLANT_KEY_PREFIX: Final = "fault-"
NATURAL_HOLDER_WAIT: Final = 10.0
"""Seconds ``partition`` waits for a workload section in a namespace worker before it plants one."""
WAITER_HOLD_MS: Final = 200
WAITER_ENTRY_TIMEOUT: Final = 5.0
"""Seconds to wait, once the holder's node is gone, for the waiter to enter before healing."""
QUEUE_TIMEOUT: Final = 15.0
"""Seconds a planted section may take to enter, or a waiter to queue, in one worker."""
CHATTER_PER_SESSION: Final = 4
"""Requests per session timeout the chatter sends (kazoo pings after T/3 without a send)."""
HELD_TARGET_WAIT: Final = 5.0
"""Seconds ``kill_held`` waits for a gate holding workload messages before it plants some."""
PLANTED_HELD: Final = 2
"""Waiters ``kill_held`` plants behind its planted holder, for the gate to hold."""
GATE_REPLY_TIMEOUT: Final = 1.0
"""Seconds to wait for the workers' gates to say what they hold (``zklock_held``)."""
QUORUM_LOSS_MARGIN: Final = 3.0
"""Seconds past the session timeout that ``quorum_loss`` keeps a majority of members down."""
FIRST_FAULT_SECONDS: Final = 10.0
"""The pace :meth:`FaultInjector.seconds_left` assumes until a fault ended."""
NOT_RECONNECTED: Final = "the injector's own client was still not reconnected"
INJECTOR_RECONNECT_DELAY: Final = 1.0
"""Longest pause between the injector's own client's attempts to reconnect (kazoo's default
backoff grows to an hour: after a quorum loss the next fault would find it still away)."""

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
        kind = FAULT_ALIASES.get(kind, kind)
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


def expire_session(hosts: str, session_id: int, timeout: float = EXPIRE_CALL_TIMEOUT) -> None:
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


_SESSION_ID_RE: Final = re.compile(r"\bsid=0x([0-9a-fA-F]+)")


def session_member(ensemble: ZooKeeperEnsemble, session_id: int) -> int | None:
    """The myid of the running member whose client connections include session
    ``session_id`` (from each member's ``cons``), or None if none lists it."""
    for node in ensemble.nodes:
        if not node.is_running():
            continue
        cons = four_letter.ask("127.0.0.1", node.port, "cons", timeout=2.0) or ""
        listed = {int(m, 16) for m in _SESSION_ID_RE.findall(cons)}
        if session_id in listed:
            return node.myid
    return None


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


def held_at_gates(
    app: Any, timeout: float = GATE_REPLY_TIMEOUT, destination: Sequence[str] | None = None
) -> dict[str, dict[str, int]]:
    """Messages held at each answering worker's gate now (of ``destination``'s workers, if
    given): ``{node name: {lock path: count}}``, from the ``zklock_held`` inspect command (a
    worker without a gate, or holding nothing, answers ``{}``)."""
    replies = (
        app.control.broadcast(
            "zklock_held",
            reply=True,
            timeout=timeout,
            destination=destination,
            limit=len(destination) if destination else None,
        )
        or []
    )
    return {
        node: {path: int(held.get("held", 0)) for path, held in (paths or {}).items()}
        for reply in replies
        for node, paths in reply.items()
    }


def gate_holdings(app: Any, timeout: float = GATE_REPLY_TIMEOUT) -> dict[str, int]:
    """Messages held at each answering worker's gate now: ``{node name: count}``."""
    return {node: sum(paths.values()) for node, paths in held_at_gates(app, timeout).items()}


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
        self.positions: dict[tuple[str, str], int] = {}
        """``(holder, kind)`` -> position in the event list, for ``enter`` and ``exit`` events
        read so far (``holder`` is ``task_id#token``)."""
        self.entered: dict[str, SectionEvent] = {}
        """Task id -> its latest ``enter`` event read so far."""
        self.exited: dict[str, SectionEvent] = {}
        """Holder (``task_id#token``) -> its ``exit`` event, for those read so far."""
        self.writes: dict[tuple[str, str], SectionEvent] = {}
        """``(holder, kind)`` -> its latest ``writing`` or ``write`` event read so far."""

    def refresh(self) -> list[SectionEvent]:
        """The open sections' ``enter`` events, oldest first."""
        raw = self._redis.lrange(self._key, self._cursor, -1)
        for offset, item in enumerate(raw):
            event = SectionEvent.from_json(item)
            if event.kind in ("enter", "exit"):
                self.positions[(event.holder, event.kind)] = self._cursor + offset
            if event.kind == "enter":
                self._open[event.holder] = event
                self.entered[event.task_id] = event
            elif event.kind == "exit":
                self._open.pop(event.holder, None)
                self.exited[event.holder] = event
            elif event.kind in ("writing", "write"):
                self.writes[(event.holder, event.kind)] = event
            elif event.kind == "killed":
                for holder, entered in list(self._open.items()):
                    if (entered.hostname, entered.pid) == (event.hostname, event.pid):
                        del self._open[holder]
        self._cursor += len(raw)
        return list(self._open.values())

    def ran_sections(self, where: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """``(hostname, pid)`` of every process ``where`` picks that entered a section in the
        run (read afresh), its sections open or not: the processes a kill of a whole worker or
        container takes. One whose body had just ended may not have stored its result yet (the
        checker's ``died_before_its_ack``), as the holder a kill picks often has: its lock node
        goes at its release, after its body's end."""
        self.refresh()
        seen = (*self.entered.values(), *self.exited.values())
        return sorted({(e.hostname, e.pid) for e in seen if where(e.hostname, e.pid)})


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
    broker: RedisServer | RabbitMQServer | None = None


def _redelivery(fleet: Fleet) -> str:
    """When the broker of ``fleet`` hands out again the messages of a worker that died."""
    if is_amqp(fleet.settings.broker_url):
        return "when the broker sees the worker's connection close (RabbitMQ)"
    return f"after the broker's visibility timeout ({fleet.settings.visibility_timeout:g} s)"


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


@dataclass(frozen=True)
class _Waiter:
    """A planted section queued behind a planted holder: its task id, worker and lock node
    (empty when it waits held at its worker's gate, which hands it to the pool once the lock
    can be granted)."""

    task_id: str
    worker: FleetWorker
    node: str


class _NotRun(Exception):
    """The fault could not be injected; the message says why."""


class _Unavailable(_NotRun):
    """The fault cannot be injected in this run at all (no namespace, an external fleet...):
    trying again would fail the same way."""


class _NoHolder(_NotRun):
    """No process was inside a section (of the kind wanted) in time."""


class FaultInjector:
    """Runs a fault plan against a run (see the module docstring).

    ``gap`` seconds separate two faults; a fault that needs a holder waits up to
    ``target_timeout`` seconds for one; ``kill_held`` waits up to ``held_wait`` seconds for a
    gate holding workload messages before it plants some. Call :meth:`close` at the end (it
    also undoes a fault interrupted half-way: resumes a paused process, heals a cut link).
    """

    def __init__(
        self,
        env: FaultEnvironment,
        plan: Mapping[str, int],
        *,
        seed: int = 0,
        gap: float = 1.0,
        target_timeout: float = 30.0,
        held_wait: float = HELD_TARGET_WAIT,
    ) -> None:
        self.env = env
        self.held_wait = held_wait
        self.order = fault_order(plan, seed)
        self.records: list[FaultRecord] = []
        self.gap = gap
        self.target_timeout = target_timeout
        self._rng = random.Random(seed)
        self._log = FaultLog(env.records, env.run_id)
        self._recorder = SectionRecorder(env.records, env.run_id)
        self._sections = OpenSections(env.records, env.run_id)
        self._stop = threading.Event()
        self._started: float | None = None  # time.monotonic() when run() began
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

    def seconds_left(self) -> float:
        """Rough seconds the faults still to run take, at the pace of those run so far
        (``FIRST_FAULT_SECONDS`` each before the first ended); 0.0 once none is pending."""
        if not self.pending():
            return 0.0
        started, done = self._started, self.done
        pace = (
            FIRST_FAULT_SECONDS
            if started is None or not done
            else ((time.monotonic() - started) / done)
        )
        return pace * (self.total - done)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the fault in progress (safe from any thread)."""
        self._stop.set()

    # -- running ------------------------------------------------------------------------
    def run(self) -> list[FaultRecord]:
        """Run every fault of the plan in order (until :meth:`stop`); return their records.

        Faults not reached because of :meth:`stop` are recorded as not run.
        """
        self._started = time.monotonic()
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
                # Found dead only now: it died at some unknown point before (late).
                self._recorder.record_kill(hostname, pid, now, late=True)

    def inject(self, kind: str) -> FaultRecord:
        """Inject one fault of ``kind`` now (waiting for a target if it needs one), once every
        fleet worker runs (one may have died since the last fault: see :meth:`revive`).

        A fault that could not run for a passing reason (no holder in time, a planted section
        slow to enter under load, a command that failed) is tried once more after the gap; its
        record then says why the first try did not count."""
        first = self._try(kind)
        if first.ran or first.detail.startswith(UNAVAILABLE) or self._stop.wait(self.gap):
            return first
        second = self._try(kind)
        return replace(second, detail=f"{second.detail} (second try; the first: {first.detail})")

    def _try(self, kind: str) -> FaultRecord:
        method: Callable[[], FaultRecord] = getattr(self, f"_{kind}")
        try:
            self.revive()
            return method()
        except _Unavailable as exc:
            return FaultRecord(kind, time.time(), "", False, f"{UNAVAILABLE}{exc}")
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
            client = KazooClient(
                hosts=self.env.zk_hosts,
                logger=quiet_kazoo_logger(),
                connection_retry={"max_delay": INJECTOR_RECONNECT_DELAY, "max_tries": -1},
            )
            client.start(timeout=15)
            self._zk = client
        return self._zk

    def _session_of(self, node: str, client: KazooClient | None = None) -> int | None:
        """The session owning ephemeral ``node``, or None if the node is gone (or unknown)."""
        try:
            stat = (client or self._client()).exists_async(node).get(timeout=ZK_CALL_TIMEOUT)
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
    def _holder(
        self, *, netns_only: bool = False, local: bool = True, timeout: float | None = None
    ) -> _Target:
        """Wait for a process inside a section (alive, ours; in a namespace if ``netns_only``)
        whose lock node still exists; raise _NoHolder after ``timeout`` seconds (default
        ``target_timeout``)."""
        fleet = self.env.fleet
        if local and fleet is None:
            raise _Unavailable("external run: the worker processes are not on this machine")
        timeout = self.target_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
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
                raise _NoHolder(f"{what} was not inside a section within {timeout:g} s")
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
            detail = f"{MAIN_PROCESS_KILL}; {restarted}; its messages return {_redelivery(fleet)}"
        else:
            took = kill_process(event.pid)
            self._recorder.record_kill(event.hostname, event.pid, time.time())
            detail = (
                f"SIGKILL of a pool process, gone after {took * 1000:.0f} ms; its pool replaces "
                "it and its message is requeued"
            )
        return FaultRecord("kill", killed_at, described, True, detail)

    def _kill_held(self) -> FaultRecord:
        """SIGKILL of a whole worker, main process and pool at once, while its gate holds
        messages: a workload worker's if one holds some within ``held_wait`` seconds, else one
        made to hold :data:`PLANTED_HELD` behind a planted section. Every section open in it is
        recorded killed; the fleet restarts it; the held messages, never acknowledged, come
        back after the broker's visibility timeout."""
        fleet = self._local_fleet()
        if not fleet.settings.gate:
            raise _Unavailable("the fleet runs without the gate (--gate off)")
        found = self._worker_holding(fleet)
        if found is not None:
            return self._kill_whole(fleet, *found, planted=False)
        worker = self._gated_worker(fleet)
        with self._planted_holder(worker, "kill_held") as holder:
            for _ in range(PLANTED_HELD):
                self._send_section(worker, holder.event.key, WAITER_HOLD_MS, QUEUE_TIMEOUT)
            held: list[int] = []

            def holding() -> bool:
                held[:] = [self._holdings(fleet.app).get(worker.nodename, 0)]
                return held[0] > 0 or self._stop.is_set()

            if not _wait_for(holding, QUEUE_TIMEOUT, 0.2) or not held[0]:
                raise _NotRun(
                    f"the gate of worker {worker.label} held none of {PLANTED_HELD} waiters "
                    f"planted behind a section within {QUEUE_TIMEOUT:g} s"
                )
            return self._kill_whole(fleet, worker, held[0], planted=True)

    def _holdings(self, app: Any) -> dict[str, int]:
        try:
            return gate_holdings(app)
        except Exception:  # the broker restarting: no answer this time
            return {}

    def _worker_holding(self, fleet: Fleet) -> tuple[FleetWorker, int] | None:
        """A running worker whose gate holds workload messages, and how many; None if none
        did within ``held_wait`` seconds."""
        deadline = time.monotonic() + self.held_wait
        while not self._stop.is_set():
            holdings = self._holdings(fleet.app)
            candidates = [
                (worker, holdings[worker.nodename])
                for worker in fleet
                if holdings.get(worker.nodename, 0) > 0 and worker.is_running()
            ]
            if candidates:
                return self._rng.choice(candidates)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
        raise _NotRun("the run ended before a target was found")

    def _gated_worker(self, fleet: Fleet) -> FleetWorker:
        """A running workload worker with a gate (gevent workers have none)."""
        candidates = [
            w for w in fleet if w.is_running() and not w.spec.queues and w.spec.pool != "gevent"
        ]
        if not candidates:
            raise _NotRun("no running worker with a gate to plant held messages in")
        return self._rng.choice(candidates)

    def _kill_whole(
        self, fleet: Fleet, worker: FleetWorker, held: int, *, planted: bool
    ) -> FaultRecord:
        pids = worker.process_ids()
        described = (
            f"{worker.nodename} ({worker.spec.pool} x{worker.spec.concurrency}, main process "
            f"pid {worker.pid}) holding {held} messages at its gate"
        )
        killed_at = time.time()
        worker.kill()  # SIGKILL to its process group: the main process and its pool at once
        _wait_for(lambda: not any(pid_alive(pid) for pid in pids), 10.0)
        now = time.time()
        # Read after every process is gone: a section entered just before the kill is included.
        killed = set(pids)
        for hostname, pid in self._sections.ran_sections(
            lambda hostname, pid: hostname == worker.nodename and pid in killed
        ):
            self._recorder.record_kill(hostname, pid, now)
        started = time.monotonic()
        try:
            fleet.restart(worker)
            restarted = f"the fleet restarted it in {time.monotonic() - started:.1f} s"
        except Exception as exc:  # the kill happened: record it, with why the worker is down
            restarted = f"it did not restart: {exc}"
        detail = (
            f"{MAIN_PROCESS_KILL} and pool ({len(pids)} processes) while its gate held "
            f"messages ({held} at its last answer{', planted behind a section' if planted else ''}"
            "); "
            f"{restarted}; the held messages, never acknowledged, return {_redelivery(fleet)}"
        )
        return FaultRecord("kill_held", killed_at, described, True, detail)

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
            pause_process(pid)
            if self._still_holding(target):
                break
            _resume(pid)  # it released the lock before the stop landed: aim again
        # Stamped with the time before the stop: the server last heard from the client at most
        # a third of the session timeout before (kazoo sends a ping after that long idle), so
        # it cannot expire the session sooner than 2/3 of the timeout after this (the checker
        # excuses an overlap only from half the timeout on).
        hostname = target.event.hostname
        self._recorder.record_forced_loss(
            "paused", hostname, pid, paused_at, session_timeout=self.env.session_timeout
        )
        with self._undo_on_exit(lambda: _resume(pid)):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        if expired_after is None:  # resumed with its session: the pause excuses nothing
            self._recorder.record_survived(hostname, pid, time.time())
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
        self._recorder.record_forced_loss(
            "expired", target.event.hostname, target.event.pid, expired_at
        )
        # Recorded before the call: a successor may be granted (and record its enter) as soon as
        # the server closed the session, before this injector could record anything after it.
        # If the call fails and the node is still there, the record is withdrawn.
        try:
            expire_session(self.env.zk_hosts, target.session_id)
        except Exception:
            if self._wait_node_gone(target.event.node, 1.0) is None:
                self._recorder.record_survived(target.event.hostname, target.event.pid, time.time())
            raise
        gone = self._wait_node_gone(target.event.node, 10.0)
        detail = "session closed on the server; its lock node went after " + (
            f"{gone * 1000:.0f} ms" if gone is not None else "more than 10 s (still there)"
        )
        return FaultRecord("expire", expired_at, target.describe(), True, detail)

    def _stall_before_write(self) -> FaultRecord:
        fleet = self._local_fleet()
        running = [w for w in fleet if w.is_running() and not w.spec.queues]
        if len(running) < 2:
            raise _NotRun("needs two running workers: one for the holder, one for its successor")
        # A pool process stops alone; a main process (threads, solo) would stop the worker's
        # other sections with it.
        pool_processes = [w for w in running if w.spec.pool == "prefork"]
        worker = self._rng.choice(pool_processes or running)
        with self._planted_holder(worker, "stall_before_write", stallable=True) as target:
            return self._stalled(target)

    def _stalled(self, target: _Target) -> FaultRecord:
        """Queue a successor behind ``target``, make it stop itself right before its write,
        keep it stopped until its session expired and the successor wrote, then resume it
        and see what the fence made of its write."""
        holder, pid, hostname = target.event.holder, target.event.pid, target.event.hostname
        waiter, misses = self._queue_waiter(target)
        if waiter is None:
            raise _NotRun("no successor could be queued (" + "; ".join(misses) + ")")
        stall_key = self._stall_key(target.event.key)

        def unstall() -> None:  # a holder not stopped yet must not stop once we are gone
            self.env.records.delete(stall_key)
            _resume(pid)

        acted_at = time.time()
        started = time.monotonic()
        with self._undo_on_exit(unstall):
            self.env.records.set(stall_key, "1", ex=3600)
            self.env.records.set(self._release_key(target.event.key), "1", ex=3600)
            writing = self._wait_write_event(holder, "writing", QUEUE_TIMEOUT)
            if writing is None:
                raise _NotRun(f"the holder did not reach its write within {QUEUE_TIMEOUT:g} s")
            if not _wait_for(lambda: _stopped(pid), QUEUE_TIMEOUT):
                raise _NotRun(f"the holder did not stop itself within {QUEUE_TIMEOUT:g} s")
            # Stamped with the holder's own clock just before it stopped (its `writing` event),
            # with its lease's validity then: the checker excuses only a successor granted once
            # the holder's own lease clock had given the lock up.
            self._recorder.record_forced_loss(
                "paused",
                hostname,
                pid,
                writing.time,
                session_timeout=self.env.session_timeout,
                valid_until=writing.valid_until,
            )
            gone = self._wait_node_gone(target.event.node, self._expiry_deadline())
            if gone is None:  # resumed with its session: the pause excuses nothing
                unstall()
                self._recorder.record_survived(hostname, pid, time.time())
                raise _NotRun(
                    f"the holder's session outlived a stop of {time.monotonic() - started:.1f} s"
                )
            entered = self._wait_entered(waiter.task_id, WAITER_ENTRY_TIMEOUT)
            successor = (
                None
                if entered is None
                else self._wait_write_event(
                    entered.holder, "write", WAITER_ENTRY_TIMEOUT + WAITER_HOLD_MS / 1000
                )
            )
            unstall()
        stopped = time.monotonic() - started
        own = self._wait_write_event(holder, "write", QUEUE_TIMEOUT)
        if successor is None:
            then = f"the successor in {waiter.worker.label} did not write within the wait"
        else:
            then = (
                f"the successor in {waiter.worker.label} (token {successor.token}) entered and "
                f"wrote ({'accepted' if successor.accepted else 'refused'})"
            )
        if own is None:
            wrote = f"its write was not recorded within {QUEUE_TIMEOUT:g} s"
        elif own.accepted:
            wrote = f"its write with token {own.token} was ACCEPTED"
        else:
            wrote = (
                f"its write with token {own.token} was refused by the fence (last token "
                f"{own.previous_token})"
            )
        detail = (
            f"SIGSTOP of the holder by itself between its `writing` event and its fenced write, "
            f"for {stopped:.1f} s: the server expired its session after {gone:.1f} s and {then}; "
            f"then SIGCONT: {wrote}"
        )
        return FaultRecord("stall_before_write", acted_at, target.describe(), True, detail)

    def _wait_write_event(self, holder: str, kind: str, timeout: float) -> SectionEvent | None:
        """Holder ``holder``'s ``writing`` or ``write`` event once recorded, or None after
        ``timeout``."""
        found: list[SectionEvent] = []

        def recorded() -> bool:
            self._sections.refresh()
            event = self._sections.writes.get((holder, kind))
            if event is not None:
                found.append(event)
            return bool(found) or self._stop.is_set()

        _wait_for(recorded, timeout)
        return found[0] if found else None

    def _leader(self) -> FaultRecord:
        ensemble = self._local_ensemble()
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

    def _quorum_loss(self) -> FaultRecord:
        """SIGKILL of a majority of the ensemble (the leader and as many followers as it takes:
        2 of 3), under load: the members left stop serving (no quorum), which the detail says
        with when, until the killed ones are restarted on their ports and data after the
        session timeout plus :data:`QUORUM_LOSS_MARGIN` seconds. Over once a leader serves
        again (``ended``) and this injector's own client is connected again. Nothing is recorded
        as a forced loss: every holder was cut off past its session timeout and must know."""
        ensemble = self._local_ensemble()
        self._under_load()
        leader = ensemble.leader(timeout=30)
        followers = [node.myid for node in ensemble.nodes if node.myid != leader]
        down = [leader, *sorted(self._rng.sample(followers, ensemble.size // 2))]
        left = [myid for myid in followers if myid not in down]
        described = f"ZooKeeper members {_members(ensemble, down)} of {ensemble.size}"
        holding = len(self._sections.refresh())
        outage = self.env.session_timeout + QUORUM_LOSS_MARGIN
        killed_at = time.time()
        started = time.monotonic()
        with self._undo_on_exit(lambda: _restart_nodes(ensemble, down)):
            for myid in down:  # signalled together: no election between the two deaths
                ensemble.node(myid).send_signal(signal.SIGKILL)
            for myid in down:
                if not ensemble.node(myid).wait(10.0):
                    raise _NotRun(f"ZooKeeper member {myid} still ran 10 s after SIGKILL")
            served = _wait_for(
                lambda: all(ensemble.node(m).mode() is None for m in left), outage, 0.05
            )
            no_quorum = time.monotonic() - started
            self._stop.wait(max(0.0, outage - no_quorum))
            kept_down = time.monotonic() - started
        successor = ensemble.leader(timeout=30)
        ensemble.wait_serving(timeout=30)
        back = time.monotonic() - started
        ended = time.time()
        reconnected = self._wait_reconnected()
        rest = f"member{'s' if len(left) > 1 else ''} {', '.join(map(str, left))}"
        stopped = (
            f"{rest} stopped serving after {no_quorum:.2f} s"
            if served
            else f"{rest} still served {no_quorum:.1f} s after"
        )
        detail = (
            f"SIGKILL of {len(down)} of {ensemble.size} members, the leader {leader} among "
            f"them, with {holding} sections open; {stopped} (no quorum); kept down "
            f"{kept_down:.1f} s (session timeout {self.env.session_timeout:g} s + "
            f"{QUORUM_LOSS_MARGIN:g} s), then restarted on the same ports and data; node "
            f"{successor} led {back - kept_down:.2f} s later, {back:.1f} s after the kill"
            + ("" if reconnected else "; " + NOT_RECONNECTED)
        )
        return FaultRecord("quorum_loss", killed_at, described, True, detail, ended)

    def _wait_reconnected(self) -> bool:
        """Wait until this injector's own client is connected again (after ZooKeeper was away,
        for the next fault's look-ups); False if it was not within a bound."""
        return _wait_for(
            lambda: self._client().connected, 2 * self.env.session_timeout + 10.0, 0.05
        )

    def _partition(self) -> FaultRecord:
        fleet = self._local_fleet()
        in_netns = [w for w in fleet if w.netns is not None]
        if not in_netns:
            reason = unavailable_reason() or "the run was started without such a worker"
            raise _Unavailable(f"no worker runs in a network namespace: {reason}")
        while True:
            try:
                target = self._holder(netns_only=True, timeout=NATURAL_HOLDER_WAIT)
            except _NoHolder:
                break  # the workload left the namespace workers idle: plant a section
            namespace = target.worker.netns if target.worker is not None else None
            assert namespace is not None
            cut_at = time.time()
            namespace.cut()
            if self._still_holding(target):
                return self._partitioned(target, namespace, cut_at)
            namespace.heal()  # it released the lock before the cut: aim again
        running = [w for w in in_netns if w.is_running()] or in_netns
        worker = self._rng.choice(running)
        assert worker.netns is not None
        with self._planted_holder(worker, "partition") as target:
            cut_at = time.time()
            worker.netns.cut()
            return self._partitioned(target, worker.netns, cut_at, planted=True)

    def _partitioned(
        self, target: _Target, namespace: Namespace, cut_at: float, planted: bool = False
    ) -> FaultRecord:
        """Once the link is cut: wait until the server expired the holder's session, heal."""
        started = time.monotonic()
        with self._undo_on_exit(namespace.heal):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        cut_for = time.monotonic() - started
        detail = f"ZooKeeper link of netns {namespace.name} down for {cut_for:.1f} s" + (
            f" (the server expired the session after {expired_after:.1f} s), then healed"
            if expired_after is not None
            else ", healed before the session expired"
        )
        if planted:
            detail += f" (a section planted after {NATURAL_HOLDER_WAIT:g} s without one there)"
        return FaultRecord("partition", cut_at, target.describe(), True, detail)

    def _broker_restart(self) -> FaultRecord:
        """SIGKILL of the local broker (Redis or RabbitMQ) under load, then a restart on the
        same port and data; ``ended`` is when it serves again."""
        broker = self.env.broker
        if broker is None:
            raise _Unavailable("external run: the broker is not a local Redis or RabbitMQ")
        name = "Redis" if isinstance(broker, RedisServer) else "RabbitMQ"
        self._under_load()
        port = broker.port
        killed_at = time.time()
        down = broker.restart()
        ended = time.time()
        detail = f"SIGKILL and restart of the broker {name}; down {down:.2f} s"
        return FaultRecord(
            "broker_restart", killed_at, f"broker {name} on port {port}", True, detail, ended
        )

    # -- planted sections ---------------------------------------------------------------
    def _local_ensemble(self) -> ZooKeeperEnsemble:
        ensemble = self.env.zookeeper
        if not isinstance(ensemble, ZooKeeperEnsemble):
            raise _Unavailable(
                "needs a local ZooKeeper ensemble ("
                + ("external run" if ensemble is None else "this run has a standalone server")
                + ")"
            )
        return ensemble

    def _local_fleet(self) -> Fleet:
        if self.env.fleet is None:
            raise _Unavailable("external run: the worker processes are not on this machine")
        return self.env.fleet

    def _send_section(
        self,
        worker: FleetWorker,
        key: str,
        hold_ms: int,
        wait: float,
        release_key: str = "",
        stall_key: str = "",
    ) -> str:
        """Send an exclusive section of the run to ``worker``; return its task id."""
        kwargs = {"release_key": release_key} if release_key else {}
        if stall_key:
            kwargs["stall_key"] = stall_key
        result = (
            self._local_fleet()
            .app.tasks[EXCLUSIVE_TASK]
            .apply_async(
                (self.env.run_id, key, hold_ms),
                kwargs,
                queue=worker_direct(worker.nodename),
                zklock={"on_busy": "wait", "timeout": wait},
            )
        )
        return str(result.id)

    def _wait_entered(self, task_id: str, timeout: float) -> SectionEvent | None:
        """The ``enter`` event of task ``task_id`` once recorded, or None after ``timeout``."""
        found: list[SectionEvent] = []

        def entered() -> bool:
            self._sections.refresh()
            event = self._sections.entered.get(task_id)
            if event is not None:
                found.append(event)
            return bool(found) or self._stop.is_set()

        _wait_for(entered, timeout)
        return found[0] if found else None

    def _release_key(self, key: str) -> str:
        """The Redis key that ends the hold of the section planted on ``key``."""
        return f"{events_key(self.env.run_id)}:release:{key}"

    def _stall_key(self, key: str) -> str:
        """The Redis key that makes the section planted on ``key`` stall before its write."""
        return f"{events_key(self.env.run_id)}:stall:{key}"

    @contextmanager
    def _planted_holder(
        self, worker: FleetWorker, kind: str, *, stallable: bool = False
    ) -> Iterator[_Target]:
        """Plant a long exclusive section on a key of its own in ``worker``; yield it once it
        holds the lock. When the block ends, the section is told to end (it may be over by
        then: it lost its lock). ``stallable``: the section is given its stall key (see
        :func:`workers.tasks.run_section`)."""
        if not worker.is_running():
            self.revive()  # it died meanwhile (a broker restart can take a worker down)
        key = f"{PLANT_KEY_PREFIX}{kind.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        release_key = self._release_key(key)
        stall_key = self._stall_key(key) if stallable else ""
        hold_ms = math.ceil(2 * self._expiry_deadline() * 1000)
        task_id = self._send_section(worker, key, hold_ms, QUEUE_TIMEOUT, release_key, stall_key)
        try:
            event = self._wait_entered(task_id, QUEUE_TIMEOUT)
            if event is None:
                raise _NotRun(
                    f"the section planted in worker {worker.label} did not enter within "
                    f"{QUEUE_TIMEOUT:g} s"
                )
            session = self._session_of(event.node)
            if session is None:
                raise _NotRun(f"the planted section's lock node {event.node} is gone already")
            yield _Target(event, worker, session)
        finally:
            self.env.records.set(release_key, "1", ex=3600)

    def _queue_waiter(
        self,
        holder: _Target,
        *,
        client: KazooClient | None = None,
        workers: Sequence[FleetWorker] = (),
    ) -> tuple[_Waiter | None, list[str]]:
        """Queue a short exclusive section on the holder's key in another worker (one of
        ``workers`` if given); return it once its contender node is in the queue, or it is held
        at that worker's gate (None if no worker got it there in time), and why other tries did
        not count."""
        fleet = self._local_fleet()
        parent = posixpath.dirname(holder.event.node)
        known = {posixpath.basename(holder.event.node)}
        candidates = list(workers) or [
            w for w in fleet if w is not holder.worker and w.is_running() and not w.spec.queues
        ]
        self._rng.shuffle(candidates)
        wait = self._expiry_deadline() + 2 * QUEUE_TIMEOUT
        misses: list[str] = []
        for worker in candidates[:3]:
            task_id = self._send_section(worker, holder.event.key, WAITER_HOLD_MS, wait)
            node = self._wait_queued(worker, parent, known, client)
            if node is None:
                misses.append(f"{worker.label} did not queue it within {QUEUE_TIMEOUT:g} s")
                continue
            return _Waiter(task_id, worker, node), misses
        return None, misses

    def _wait_queued(
        self, worker: FleetWorker, parent: str, known: set[str], client: KazooClient | None
    ) -> str | None:
        """Once a waiter sent to ``worker`` waits for ``parent``'s lock: its contender node (a
        pool run queued in ZooKeeper), or "" when ``worker``'s gate holds a message of that
        lock (the gate, not the pool, waits for it to free); None after
        :data:`QUEUE_TIMEOUT`."""
        deadline = time.monotonic() + QUEUE_TIMEOUT
        while not self._stop.is_set():
            node = self._wait_new_child(parent, known, GATE_REPLY_TIMEOUT, client)
            if node is not None:
                return node
            try:
                held = held_at_gates(self._local_fleet().app, destination=[worker.nodename])
            except Exception:  # the broker restarting: look again
                held = {}
            if held.get(worker.nodename, {}).get(parent, 0) > 0:
                return ""
            if time.monotonic() >= deadline:
                return None
        return None

    def _wait_new_child(
        self, parent: str, known: set[str], timeout: float, client: KazooClient | None
    ) -> str | None:
        """The path of a child of ``parent`` not in ``known``, once there is one."""
        found: list[str] = []

        def appeared() -> bool:
            try:
                children = (client or self._client()).get_children_async(parent)
                fresh = sorted(set(children.get(timeout=ZK_CALL_TIMEOUT)) - known)
            except Exception:
                return self._stop.is_set()
            found.extend(f"{parent}/{child}" for child in fresh[:1])
            return bool(found) or self._stop.is_set()

        _wait_for(appeared, timeout, 0.05)
        return found[0] if found else None

    def _waiter_outcome(
        self, holder: _Target, waiter: _Waiter | None, gone_after: float | None, misses: list[str]
    ) -> str:
        """Once the holder's node is gone: wait for the waiter to enter, and tell whether the
        holder was still inside its section then (the hazard) or had left it."""
        if waiter is None:
            return "no waiter could be queued (" + "; ".join(misses) + ")"
        if gone_after is None:
            return f"the waiter in {waiter.worker.label} stayed queued"
        gone_at = time.monotonic()
        entered = self._wait_entered(waiter.task_id, WAITER_ENTRY_TIMEOUT)
        if entered is None:
            return (
                f"the waiter in {waiter.worker.label} did not enter within "
                f"{WAITER_ENTRY_TIMEOUT:g} s of the node's removal"
            )
        after = time.monotonic() - gone_at
        self._sections.refresh()
        positions = self._sections.positions
        enter_at = positions.get((entered.holder, "enter"), -1)
        exit_at = positions.get((holder.event.holder, "exit"))
        exited = self._sections.exited.get(holder.event.holder)
        if exit_at is None or exit_at > enter_at:
            return (
                f"the waiter in {waiter.worker.label} entered (within {after * 1000:.0f} ms) "
                "while the holder was still inside its section: the holder had not learned "
                "that its lock was gone"
            )
        outcome = exited.outcome if exited is not None else None
        return (
            f"the holder had left its section (outcome {outcome}) before the waiter in "
            f"{waiter.worker.label} entered"
        )

    # -- silent partitions ------------------------------------------------------------------
    def _blackhole(self) -> FaultRecord:
        fleet = self._local_fleet()
        in_netns = [w for w in fleet if w.netns is not None]
        if not in_netns:
            why = unavailable_reason() or "the run was started without such a worker"
            raise _Unavailable(f"no worker runs in a network namespace: {why}")
        candidates = [w for w in in_netns if w.spec.pool in IN_PROCESS_POOLS and w.is_running()]
        if not candidates:
            raise _NotRun(
                "no running worker in a network namespace has an in-process pool "
                f"({', '.join(sorted(IN_PROCESS_POOLS))}): its tasks would not share a client"
            )
        reason = blackhole_unavailable_reason()
        if reason is not None:
            raise _Unavailable(reason)
        worker = self._rng.choice(candidates)
        namespace = worker.netns
        assert namespace is not None
        interval = self.env.session_timeout / CHATTER_PER_SESSION
        with self._planted_holder(worker, "blackhole") as target:
            reply = start_chatter(
                fleet.app, worker.nodename, interval, self._expiry_deadline() + 2 * QUEUE_TIMEOUT
            )
            with self._undo_on_exit(lambda: stop_chatter(fleet.app, worker.nodename)):
                if reply.get("session") != target.session_id:
                    raise _NotRun(
                        f"the worker's chatter runs on session {reply.get('session')}, the "
                        f"holder's is {target.session_id}: not the same ZooKeeper client"
                    )
                waiter, misses = self._queue_waiter(target)
                cut_at = time.time()
                started = time.monotonic()
                namespace.blackhole()
                with self._undo_on_exit(namespace.heal):
                    gone = self._wait_node_gone(target.event.node, self._expiry_deadline())
                    waited = self._waiter_outcome(target, waiter, gone, misses)
                silent = time.monotonic() - started
        detail = (
            f"ZooKeeper link of netns {namespace.name} silent (every packet dropped both ways, "
            f"sockets open) for {silent:.1f} s while the worker sent a request every "
            f"{interval:.2f} s on the holder's client; "
            + (
                f"the server expired the session after {gone:.1f} s"
                if gone is not None
                else "the session did not expire meanwhile"
            )
            + f"; {waited}; then healed"
        )
        return FaultRecord("blackhole", cut_at, target.describe(), True, detail)

    def _follower_partition(self) -> FaultRecord:
        ensemble = self._local_ensemble()
        if not ensemble.isolatable:
            reason = partition_unavailable_reason() or "it was started without isolatable members"
            raise _Unavailable(f"no member of the ensemble can be cut off: {reason}")
        fleet = self._local_fleet()
        leader = ensemble.leader(timeout=30)
        followers = [
            node.myid
            for node in ensemble.nodes
            if node.myid != leader and node.myid in ensemble.isolatable and node.mode()
        ]
        if not followers:
            raise _NotRun(f"no isolatable follower serves (leader {leader})")
        member = self._rng.choice(followers)
        # The holder's worker connects to that follower only, the waiter's to the leader only:
        # which member a fleet worker's client picked is chance (and a prefork worker's
        # children share the pick), so the fault brings its own two workers.
        tag = uuid.uuid4().hex[:4]
        specs = [
            WorkerSpec(
                f"fp{tag}{role}",
                "threads",
                1,
                zk_hosts=f"127.0.0.1:{ensemble.node(myid).port}",
                queues=(f"zklock-fault-{tag}",),
            )
            for role, myid in (("h", member), ("w", leader))
        ]
        pinned = fleet.add(specs)
        try:
            holder_worker, waiter_worker = pinned
            with self._planted_holder(holder_worker, "follower_partition") as target:
                return self._isolate_follower(ensemble, target, member, leader, waiter_worker)
        finally:
            fleet.remove(pinned)

    def _isolate_follower(
        self,
        ensemble: ZooKeeperEnsemble,
        target: _Target,
        member: int,
        leader: int,
        waiter_worker: FleetWorker,
    ) -> FaultRecord:
        on = session_member(ensemble, target.session_id)
        if on != member:
            raise _NotRun(f"the holder's session is on member {on}, not on follower {member}")
        # Watch the holder's node from the leader: the isolated follower's view is frozen.
        observer = KazooClient(
            hosts=f"127.0.0.1:{ensemble.node(leader).port}", logger=quiet_kazoo_logger()
        )
        observer.start(timeout=15)
        try:
            waiter, misses = self._queue_waiter(target, client=observer, workers=[waiter_worker])
            cut_at = time.time()
            started = time.monotonic()
            ensemble.isolate(member)
            with self._undo_on_exit(lambda: _heal_member(ensemble, member)):
                gone, moved = self._wait_expired_or_moved(observer, ensemble, target, member)
                waited = self._waiter_outcome(target, waiter, gone, misses)
            isolated = time.monotonic() - started
        finally:
            observer.stop()
            observer.close()
        if gone is not None:
            outcome = f"the leader expired the session after {gone:.1f} s"
        elif moved is not None:
            outcome = (
                f"the follower dropped its clients first and the holder's session moved to "
                f"member {moved} before it expired (syncLimit x tickTime shorter than the "
                "session timeout)"
            )
        else:
            outcome = "the session did not expire meanwhile"
        detail = (
            f"follower {member} cut off from the other members (leader {leader}) for "
            f"{isolated:.1f} s, its client port reachable; {outcome}; {waited}; then healed"
        )
        return FaultRecord(
            "follower_partition",
            cut_at,
            f"{target.describe()} on ZooKeeper member {member}",
            True,
            detail,
        )

    def _wait_expired_or_moved(
        self, observer: KazooClient, ensemble: ZooKeeperEnsemble, target: _Target, member: int
    ) -> tuple[float | None, int | None]:
        """Seconds until the holder's node was gone as the leader sees it; or the member its
        session moved to meanwhile; (None, None) at the deadline."""
        started = time.monotonic()
        deadline = started + self._expiry_deadline()
        next_look = started + 0.5
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                stat = observer.exists_async(target.event.node).get(timeout=ZK_CALL_TIMEOUT)
            except Exception:
                stat = True
            if stat is None:
                return time.monotonic() - started, None
            if now >= next_look:
                where = session_member(ensemble, target.session_id)
                if where is not None and where != member:
                    return None, where
                next_look = now + 0.5
            if now >= deadline:
                break
            time.sleep(0.05)
        return None, None


def _resume(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _stopped(pid: int) -> bool:
    """True if process ``pid`` is stopped (by a signal: state T in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _heal_member(ensemble: ZooKeeperEnsemble, myid: int) -> None:
    ensemble.heal(myid)
    ensemble.wait_serving(timeout=30)


def _restart_node(ensemble: ZooKeeperEnsemble, myid: int) -> None:
    if not ensemble.node(myid).is_running():
        ensemble.restart(myid, timeout=30)


def _restart_nodes(ensemble: ZooKeeperEnsemble, myids: Sequence[int]) -> None:
    """Restart those of ``myids`` that are down, one after the other: the first one back
    forms a quorum with the members left."""
    for myid in myids:
        _restart_node(ensemble, myid)


def _members(ensemble: ZooKeeperEnsemble, myids: Sequence[int]) -> str:
    """``1 (pid 41), 3 (pid 43)``."""
    return ", ".join(f"{myid} (pid {ensemble.node(myid).pid})" for myid in myids)


def describe_plan(plan: Mapping[str, int]) -> str:
    """``kill x3, pause x3`` (``no faults`` for an empty plan)."""
    return ", ".join(f"{kind} x{n}" for kind, n in plan.items()) or "no faults"
