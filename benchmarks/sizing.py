"""Section 9 of ``python -m benchmarks``: the figures behind ``docs/sizing.md``, measured on a
3-member ensemble this section starts itself (the section's standalone server is not used).

1. **Requests per locked task**: a ``ZkLockTask`` no-op on a fresh key, called in this process
   the way a prefork worker calls it (:func:`benchmarks.task_layer._as_worker`), exclusive,
   shared and semaphore (``lock_limit=3``), exclusive on one key for every call (its container
   kept), and exclusive ``wait`` through the worker's gate
   (:class:`celery_zklock.worker.gate.gate.Gate`, the real class, in front of a stand-in consumer
   that runs its callbacks on this thread). Counted two ways: on the client, every request kazoo
   queues (``KazooClient._call`` wrapped, by request type: :class:`RequestTally`); on the
   servers, the sum over the members of ``mntr`` ``zk_packets_received`` (pings included; the
   probes themselves taken off).
2. **The lease clock's traffic** of one holding process: one session (``T`` = the library's
   default 10 s) holding 0, 1, 10 and 100 locks; requests per second over a window once the
   renewals run, by type, and the packets the servers received (pings included).
3. **Lock cycles per second**: ``processes`` worker processes (one session each), each on a key
   of its own, loop ``Mutex`` acquire+release (the key reused, and a fresh key each cycle as
   per-argument task keys do) against the floor, a bare create + delete of an ephemeral
   sequential node; the ratio to the floor per repetition is the figure that carries over to
   other hardware.
4. **ZooKeeper's CPU per session**: ``sessions`` sessions spread over worker processes, idle
   and then each holding one lock; the ensemble's JVMs' CPU time (``/proc/<pid>/stat``
   utime + stime, all three members) over a window, less the same window with no session,
   per session and scaled to 1,000 sessions.

Every figure is a median with its spread over ``repeats`` repetitions. Method and the reading
of the figures: ``docs/sizing.md``.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, Task
from celery.app.trace import reset_worker_optimizations, setup_worker_optimizations
from kazoo.client import KazooClient

from benchmarks.common import (
    ZK_SETTINGS,
    Progress,
    Worker,
    broadcast,
    cpu_snapshot,
    cpu_used,
    mntr,
    paired,
    rotated,
    serve_client,
    spread,
    start_workers,
    stop_workers,
)
from benchmarks.task_layer import _as_worker, _noop
from celery_zklock import Mutex, ZkLockTask
from celery_zklock.locks.clock import timing_for
from celery_zklock.testing import ZooKeeperEnsemble
from celery_zklock.worker.gate.gate import Gate
from celery_zklock.zk.client import close_clients, get_client
from celery_zklock.zk.settings import GateConfig, settings_of

#: The published ceiling (Hunt et al., USENIX ATC 2010): saturated writes/s on 3 servers.
PUBLISHED_WRITES_PER_S = 21_000
#: Writes per lock cycle: the contender's create and its delete.
WRITES_PER_CYCLE = 2
#: Session timeout of every session this section opens: the library's default.
SESSION_TIMEOUT_S = 10.0
#: The semaphore task's limit.
SEMAPHORE_LIMIT = 3
#: Lock counts one holding process holds in part 2.
HELD_COUNTS = (0, 1, 10, 100)
#: Sessions part 4 scales its per-session CPU to.
SCALE_TO_SESSIONS = 1000
#: ZooKeeper settings of the section's ensemble: the suite's, with ZooKeeper's own container
#: check interval (as in production; the tests' 300 ms reaps a task key's container between
#: two calls and adds a write).
ENSEMBLE_SETTINGS: dict[str, Any] = {**ZK_SETTINGS, "container_check_interval_ms": 60_000}
ROOT = "/bench/sizing"
#: The locked tasks of part 1, by the name their figures go under.
TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "exclusive": {"lock_on_busy": "skip"},
    "shared": {"lock_mode": "shared", "lock_on_busy": "skip"},
    "semaphore": {"lock_mode": "semaphore", "lock_limit": SEMAPHORE_LIMIT},
    "exclusive+gate": {"lock_on_busy": "wait", "lock_timeout": 30},
}
#: Part 1's cases: those tasks on a fresh key each call, and the exclusive one on one key.
TASK_KINDS = ("exclusive", "exclusive-reused-key", "shared", "semaphore", "exclusive+gate")


# ------------------------------------------------------------------------------- pure helpers


class RequestTally:
    """Counts the requests a kazoo client queues, by request type (``Create``, ``Sync``, ...).

    Every request kazoo sends but its pings and its connect passes through
    ``KazooClient._call``; :meth:`install` wraps that method on one client object (the class
    is untouched) and :meth:`remove` puts it back. A ``multi`` counts once, as ``Transaction``
    (kazoo's name), whatever it holds; the library's own container create is a ``multi``
    (:mod:`celery_zklock.zk.adapter`), shown under its class name."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._installed: list[KazooClient] = []

    def record(self, request: object) -> None:
        with self._lock:
            self.counts[type(request).__name__] += 1

    def install(self, client: KazooClient) -> None:
        original = client._call

        def counted(request: Any, async_object: Any) -> Any:
            self.record(request)
            return original(request, async_object)

        client._call = counted
        self._installed.append(client)

    def remove(self) -> None:
        for client in self._installed:
            client.__dict__.pop("_call", None)
        self._installed.clear()

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)


def per_unit(before: Counter[str], after: Counter[str], units: float) -> dict[str, float]:
    """``after - before`` per type, divided by ``units`` (calls, seconds), plus ``total``;
    types that did not move are left out."""
    if units <= 0:
        raise ValueError(f"units must be positive, got {units}")
    moved = {name: (after[name] - before.get(name, 0)) / units for name in after}
    out = {name: value for name, value in sorted(moved.items()) if value}
    out["total"] = sum(out.values())
    return out


def packets_delta(before: Sequence[int], after: Sequence[int], probes_per_member: int = 1) -> int:
    """Packets the members received between two ``mntr`` rounds, less the ``mntr`` probes of
    the second round (``probes_per_member`` each; the first round's are counted before)."""
    if len(before) != len(after):
        raise ValueError("the two rounds read different member counts")
    return sum(a - b for a, b in zip(after, before, strict=True)) - probes_per_member * len(after)


def cpu_ms_per_session_second(
    used_s: float, idle_s: float, sessions: int, window_s: float
) -> float:
    """CPU milliseconds per session per second: the window's CPU with the sessions less the
    same window's without (``idle_s``), over ``sessions`` and ``window_s``."""
    if sessions <= 0 or window_s <= 0:
        raise ValueError("sessions and window_s must be positive")
    return (used_s - idle_s) / sessions / window_s * 1e3


def share_of_core(ms_per_session_second: float, sessions: int = SCALE_TO_SESSIONS) -> float:
    """The share of one CPU core (1.0 = a whole core) ``sessions`` sessions take, each at
    ``ms_per_session_second`` CPU ms per second."""
    return ms_per_session_second * sessions / 1e3


def published_cycles_per_s(
    writes_per_s: float = PUBLISHED_WRITES_PER_S, writes_per_cycle: int = WRITES_PER_CYCLE
) -> float:
    """Lock cycles per second an ensemble that saturates at ``writes_per_s`` writes serves."""
    return writes_per_s / writes_per_cycle


# ------------------------------------------------------------------------- the ensemble's view


def packets(ensemble: ZooKeeperEnsemble) -> list[int]:
    """``zk_packets_received`` of every member (one ``mntr`` probe each)."""
    return [int(mntr(node.port)["zk_packets_received"]) for node in ensemble.nodes]


def jvm_cpu(ensemble: ZooKeeperEnsemble) -> dict[int, float]:
    """CPU seconds so far of every member's JVM."""
    return cpu_snapshot([node.pid for node in ensemble.nodes if node.pid is not None])


# ------------------------------------------------------------------ part 1: requests per task


@dataclass
class _Timer:
    def cancel(self) -> None:
        return None


@dataclass
class _Consumer:
    """What :class:`Gate` uses of a worker's consumer; its callbacks run on the caller's
    thread (:meth:`run_soon`), as the consumer's hub runs them on the consumer's."""

    app: Celery
    soon: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]]] = field(
        default_factory=queue.Queue
    )

    def __post_init__(self) -> None:
        self.hub = type("Hub", (), {"_ready_lock": None})()
        self.qos = type(
            "Qos", (), {"increment_eventually": _nothing, "decrement_eventually": _nothing}
        )()
        self.timer = type("Timer", (), {"call_after": _timer, "call_repeatedly": _timer})()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.soon.put((fn, args))

    def run_soon(self, timeout: float = 30.0) -> None:
        fn, args = self.soon.get(timeout=timeout)
        fn(*args)


def _nothing(*_: Any) -> None:
    return None


def _timer(*_: Any) -> _Timer:
    return _Timer()


@dataclass(eq=False)  # hashed by identity as Celery's are: the gate keys its sent runs by them
class _Request:
    """What the gate reads of a worker's request."""

    task: Task
    args: tuple[Any, ...]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kwargs: dict[str, Any] = field(default_factory=dict)
    request_dict: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.task.name)


def _task_app(hosts: str) -> Celery:
    app = Celery("bench-sizing", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = hosts
    app.conf.zklock_root = f"{ROOT}/tasks"
    app.conf.zklock_session_timeout = SESSION_TIMEOUT_S
    app.conf.task_ignore_result = True
    for kind, extra in TASK_OPTIONS.items():
        app.task(name=f"bench.sizing.{kind}", base=ZkLockTask, bind=True, shared=False, **extra)(
            _noop
        )
    return app


class _GatedCalls:
    """Calls that go through ``gate`` first, as a worker's messages do; counts what the
    client sent from a call's start to its dispatch to the "pool" (the gate's own requests)."""

    def __init__(self, gate: Gate, consumer: _Consumer, tally: RequestTally) -> None:
        self.gate, self.consumer, self.tally = gate, consumer, tally
        self.gate_sent: Counter[str] = Counter()
        self._started: Counter[str] = Counter()
        gate.wrap(self._pool)

    def _pool(self, request: Any) -> None:
        self.gate_sent.update(self.tally.snapshot() - self._started)
        _as_worker(request.task)(request.args[0])

    def caller(self, task: Task) -> Callable[[int], None]:
        def call(n: int) -> None:
            self._started = self.tally.snapshot()
            if self.gate.on_task_request(_Request(task, (n,))) is None:  # held: a read first
                while self.gate.held:
                    self.consumer.run_soon()

        return call


def requests_per_task(
    ensemble: ZooKeeperEnsemble, *, calls: int, warmup: int, repeats: int, progress: Progress
) -> dict[str, Any]:
    """Part 1 (see the module docstring)."""
    app = _task_app(ensemble.hosts)
    setup_worker_optimizations(app, hostname="bench@sizing")
    consumer = _Consumer(app)
    gate = Gate(consumer, GateConfig(enabled=True, max_held=100, max_hold=60.0))
    tally = RequestTally()
    numbers = itertools.count()
    try:
        client = get_client(settings_of(app).client)
        gate.client = client  # as Gate._connect sets it, without its thread
        tally.install(client)
        tasks = {kind: app.tasks[f"bench.sizing.{kind}"] for kind in TASK_OPTIONS}
        gated = _GatedCalls(gate, consumer, tally)
        cases: dict[str, Callable[[int], None]] = {
            kind: _as_worker(task) for kind, task in tasks.items() if kind != "exclusive+gate"
        }
        cases["exclusive+gate"] = gated.caller(tasks["exclusive+gate"])
        reused = _as_worker(app.tasks["bench.sizing.exclusive"])
        cases["exclusive-reused-key"] = lambda n: reused(-1)  # one key, its container kept
        for call in cases.values():
            for _ in range(warmup):
                call(next(numbers))
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in TASK_KINDS}
        for rep in range(repeats):
            for kind in rotated(TASK_KINDS, rep):
                call = cases[kind]
                client_before, gate_before = tally.snapshot(), Counter(gated.gate_sent)
                server_before = packets(ensemble)
                for _ in range(calls):
                    call(next(numbers))
                server = packets_delta(server_before, packets(ensemble))
                run: dict[str, Any] = {
                    "client": per_unit(client_before, tally.snapshot(), calls),
                    "server_packets": server / calls,
                }
                if kind == "exclusive+gate":
                    run["gate"] = per_unit(gate_before, gated.gate_sent, calls)
                runs[kind].append(run)
            progress(
                f"sizing: requests per task rep {rep + 1}/{repeats}: "
                + ", ".join(
                    f"{kind} {runs[kind][-1]['client']['total']:.2f} "
                    f"(server {runs[kind][-1]['server_packets']:.2f})"
                    for kind in TASK_KINDS
                )
            )
    finally:
        tally.remove()
        close_clients()
        reset_worker_optimizations(app)
    return {
        "calls": calls,
        "warmup": warmup,
        "how": "client: requests queued through KazooClient._call, by type; server: sum over "
        "the members of mntr zk_packets_received, pings included, the probes taken off",
        "runs": runs,
        "results": {kind: _summary_of_runs(runs[kind]) for kind in TASK_KINDS},
    }


def _summary_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({name for run in runs for name in run["client"]})
    summary: dict[str, Any] = {
        "client": {name: spread([run["client"].get(name, 0.0) for run in runs]) for name in names},
        "server_packets": spread([run["server_packets"] for run in runs]),
    }
    if all("gate" in run for run in runs):
        gate_names = sorted({name for run in runs for name in run["gate"]})
        summary["gate"] = {
            name: spread([run["gate"].get(name, 0.0) for run in runs]) for name in gate_names
        }
    return summary


# -------------------------------------------------------------- part 2: the lease clock's traffic


def lease_clock_traffic(
    ensemble: ZooKeeperEnsemble,
    *,
    window_s: float,
    repeats: int,
    held_counts: Sequence[int] = HELD_COUNTS,
    progress: Progress,
) -> dict[str, Any]:
    """Part 2 (see the module docstring): one session of its own, the only one open."""
    timing = timing_for(SESSION_TIMEOUT_S)
    client = KazooClient(hosts=ensemble.hosts, timeout=SESSION_TIMEOUT_S)
    client.start(timeout=60)
    tally = RequestTally()
    tally.install(client)
    root = f"{ROOT}/held"
    client.ensure_path(root)
    runs: dict[int, list[dict[str, Any]]] = {count: [] for count in held_counts}
    try:
        for rep in range(repeats):
            for count in rotated(list(held_counts), rep):
                leases = [
                    Mutex(client, f"{root}/r{rep}-k{i}").acquire(timeout=30) for i in range(count)
                ]
                # Past the first renewal and each lease's one read of its node (at R).
                time.sleep(2 * timing.renew_interval + 0.5)
                client_before, server_before = tally.snapshot(), packets(ensemble)
                time.sleep(window_s)
                server = packets_delta(server_before, packets(ensemble))
                runs[count].append(
                    {
                        "client": per_unit(client_before, tally.snapshot(), window_s),
                        "server_packets_per_s": server / window_s,
                    }
                )
                for lease in leases:
                    lease.release()
            progress(
                f"sizing: lease clock rep {rep + 1}/{repeats}: "
                + ", ".join(
                    f"{count} held {runs[count][-1]['client']['total']:.2f}/s "
                    f"(server {runs[count][-1]['server_packets_per_s']:.2f}/s)"
                    for count in held_counts
                )
            )
    finally:
        tally.remove()
        client.stop()
        client.close()
    return {
        "session_timeout_s": SESSION_TIMEOUT_S,
        "renew_interval_s": timing.renew_interval,
        "window_s": window_s,
        "how": "client: requests per second queued through KazooClient._call, by type (pings "
        "are not among them); server: packets per second the members received from this "
        "session, pings included",
        "runs": {str(count): value for count, value in runs.items()},
        "results": {
            str(count): {
                "client": {
                    name: spread([run["client"].get(name, 0.0) for run in runs[count]])
                    for name in sorted({n for run in runs[count] for n in run["client"]})
                },
                "server_packets_per_s": spread(
                    [run["server_packets_per_s"] for run in runs[count]]
                ),
            }
            for count in held_counts
        },
    }


# --------------------------------------------------------------- part 3: lock cycles per second


def _cycle_worker(conn: Any, hosts: str) -> None:
    serve_client(conn, hosts, _cycle)


def _cycle(client: KazooClient, command: tuple[Any, ...]) -> int:
    """``("cycle", kind, index, start_at, duration)``: cycles done in ``duration`` seconds from
    the monotonic time ``start_at``."""
    _, kind, index, start_at, duration = command
    base = f"{ROOT}/cycles/w{index}"
    client.ensure_path(base)
    key = f"{base}/key"
    time.sleep(max(0.0, start_at - time.monotonic()))
    end = start_at + duration
    done = 0
    while time.monotonic() < end:
        if kind == "floor":
            client.delete(client.create(f"{base}/n-", ephemeral=True, sequence=True))
        else:
            Mutex(client, key).acquire(timeout=30).release()
        done += 1
    return done


def lock_cycles(
    ensemble: ZooKeeperEnsemble,
    *,
    process_counts: Sequence[int],
    duration_s: float,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """Part 3 (see the module docstring)."""
    kinds = ("floor", "mutex")
    results: dict[str, Any] = {}
    for processes in process_counts:
        workers = start_workers(_cycle_worker, [(ensemble.hosts,)] * processes, ready_timeout=300)
        try:
            _cycle_all(workers, "mutex", 1.0)  # warm-up: every worker's key and parent exist
            _cycle_all(workers, "floor", 1.0)
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            for rep in range(repeats):
                for kind in rotated(kinds, rep):
                    rates[kind].append(_cycle_all(workers, kind, duration_s) / duration_s)
                progress(
                    f"sizing: {processes} processes rep {rep + 1}/{repeats}: mutex "
                    f"{rates['mutex'][-1]:.0f}/s, floor {rates['floor'][-1]:.0f}/s"
                )
        finally:
            stop_workers(workers)
        results[str(processes)] = {
            "cycles_per_s": {kind: spread(rates[kind]) for kind in kinds},
            "mutex_vs_floor": paired(rates["mutex"], rates["floor"], lambda a, b: a / b),
            "per_repetition": rates,
        }
    return {
        "duration_s": duration_s,
        "process_counts": list(process_counts),
        "how": "each process one session and one key of its own (reused), acquire+release back "
        "to back; floor: create + delete of an ephemeral sequential node under the process's "
        "own parent",
        "results": results,
    }


def _cycle_all(workers: Sequence[Worker], kind: str, duration_s: float) -> int:
    start_at = time.monotonic() + 0.5
    for index, worker in enumerate(workers):
        worker.send("cycle", kind, index, start_at, duration_s)
    return sum(worker.reply(duration_s + 120) for worker in workers)


# ---------------------------------------------------------- part 4: ZooKeeper's CPU per session


def _session_worker(conn: Any, hosts: str, index: int, count: int) -> None:
    """Open ``count`` sessions (``T`` = :data:`SESSION_TIMEOUT_S`), answer ready, then on
    ``hold`` take one lock per session (a key each), on ``release`` let them go, on ``quit``
    close them."""

    clients: list[KazooClient] = []
    leases: list[Any] = []
    try:
        for _ in range(count):
            client = KazooClient(hosts=hosts, timeout=SESSION_TIMEOUT_S)
            client.start(timeout=120)
            clients.append(client)
        conn.send(("ok", None))
        while True:
            command = conn.recv()
            try:
                if command[0] == "quit":
                    break
                if command[0] == "hold":
                    leases = [
                        Mutex(c, f"{ROOT}/sessions/p{index}-c{j}").acquire(timeout=60)
                        for j, c in enumerate(clients)
                    ]
                elif command[0] == "release":
                    for lease in leases:
                        lease.release()
                    leases = []
                conn.send(("ok", len(leases)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        for client in clients:
            client.stop()
            client.close()


def _window(
    ensemble: ZooKeeperEnsemble, client_pids: Sequence[int], window_s: float
) -> dict[str, float]:
    """The ensemble's JVM CPU, the client processes' CPU and the packets received, over one
    window of ``window_s`` seconds."""
    jvm_before, clients_before = jvm_cpu(ensemble), cpu_snapshot(client_pids)
    packets_before = packets(ensemble)
    time.sleep(window_s)
    jvm_after, clients_after = jvm_cpu(ensemble), cpu_snapshot(client_pids)
    if set(jvm_after) != set(jvm_before):
        raise RuntimeError("a ZooKeeper member exited during the window")
    return {
        "zk_cpu_s": cpu_used(jvm_before, jvm_after),
        "client_cpu_s": cpu_used(clients_before, clients_after),
        "packets_per_s": packets_delta(packets_before, packets(ensemble)) / window_s,
    }


def session_cpu(
    ensemble: ZooKeeperEnsemble,
    *,
    sessions: int,
    processes: int,
    window_s: float,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """Part 4 (see the module docstring)."""
    per_process = [
        sessions // processes + (1 if i < sessions % processes else 0) for i in range(processes)
    ]
    admin = KazooClient(hosts=ensemble.hosts, timeout=SESSION_TIMEOUT_S)
    admin.start(timeout=60)
    admin.ensure_path(f"{ROOT}/sessions")
    admin.stop()
    admin.close()
    runs: list[dict[str, Any]] = []
    settle = 2 * timing_for(SESSION_TIMEOUT_S).renew_interval + 1.0
    for rep in range(repeats):
        time.sleep(1.0)
        none = _window(ensemble, [], window_s)
        started = time.monotonic()
        workers = start_workers(
            _session_worker,
            [(ensemble.hosts, i, n) for i, n in enumerate(per_process)],
            ready_timeout=600,
        )
        try:
            opened_s = time.monotonic() - started
            pids = [w.process.pid for w in workers if w.process.pid is not None]
            time.sleep(settle)
            idle = _window(ensemble, pids, window_s)
            broadcast(workers, ("hold",), timeout=600)
            time.sleep(settle)
            holding = _window(ensemble, pids, window_s)
            broadcast(workers, ("release",), timeout=600)
        finally:
            stop_workers(workers)
        run: dict[str, Any] = {"none": none, "idle": idle, "holding": holding, "open_s": opened_s}
        for state, measured in (("idle", idle), ("holding", holding)):
            run[f"{state}_zk_ms"] = cpu_ms_per_session_second(
                measured["zk_cpu_s"], none["zk_cpu_s"], sessions, window_s
            )
            run[f"{state}_client_ms"] = cpu_ms_per_session_second(
                measured["client_cpu_s"], 0.0, sessions, window_s
            )
            run[f"{state}_packets"] = (measured["packets_per_s"] - none["packets_per_s"]) / sessions
        runs.append(run)
        progress(
            f"sizing: {sessions} sessions rep {rep + 1}/{repeats}: ZooKeeper CPU per session "
            f"idle {run['idle_zk_ms']:.4f} ms/s, holding {run['holding_zk_ms']:.4f} ms/s "
            f"(no sessions: {none['zk_cpu_s'] / window_s * 1e3:.1f} ms/s)"
        )

    def figure(name: str) -> dict[str, float]:
        return spread([run[name] for run in runs])

    results: dict[str, Any] = {
        "no_sessions_zk_ms_per_s": spread(
            [run["none"]["zk_cpu_s"] / window_s * 1e3 for run in runs]
        ),
    }
    for state in ("idle", "holding"):
        zk_ms = figure(f"{state}_zk_ms")
        results[state] = {
            "zk_cpu_ms_per_session_s": zk_ms,
            "zk_core_share_per_1000": {
                k: (share_of_core(v) if k not in ("n",) else v) for k, v in zk_ms.items()
            },
            "client_cpu_ms_per_session_s": figure(f"{state}_client_ms"),
            "packets_per_session_s": figure(f"{state}_packets"),
        }
    return {
        "sessions": sessions,
        "processes": processes,
        "window_s": window_s,
        "session_timeout_s": SESSION_TIMEOUT_S,
        "runs": runs,
        "results": results,
    }


# ------------------------------------------------------------------------------------ section


@contextmanager
def _ensemble() -> Iterator[ZooKeeperEnsemble]:
    ensemble = ZooKeeperEnsemble(3, **ENSEMBLE_SETTINGS)
    ensemble.start(timeout=120)
    try:
        yield ensemble
    finally:
        ensemble.stop()


def run_section(
    *,
    calls: int,
    warmup: int,
    window_s: float,
    cpu_window_s: float,
    cycle_processes: Sequence[int],
    cycle_seconds: float,
    sessions: int,
    session_processes: int,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """The four parts on one 3-member ensemble; see the module docstring."""
    loads = {"loadavg_at_start": list(os.getloadavg())}
    with _ensemble() as ensemble:
        ensemble_info = {
            "members": ensemble.size,
            "leader": ensemble.leader(),
            "settings": ENSEMBLE_SETTINGS,
        }
        tasks = requests_per_task(
            ensemble, calls=calls, warmup=warmup, repeats=repeats, progress=progress
        )
        clock = lease_clock_traffic(ensemble, window_s=window_s, repeats=repeats, progress=progress)
        cycles = lock_cycles(
            ensemble,
            process_counts=cycle_processes,
            duration_s=cycle_seconds,
            repeats=repeats,
            progress=progress,
        )
        cpu = session_cpu(
            ensemble,
            sessions=sessions,
            processes=session_processes,
            window_s=cpu_window_s,
            repeats=repeats,
            progress=progress,
        )
    loads["loadavg_at_end"] = list(os.getloadavg())
    return {
        "config": {
            "repeats": repeats,
            "ensemble": ensemble_info,
            **loads,
            "published_writes_per_s": PUBLISHED_WRITES_PER_S,
            "published_cycles_per_s": published_cycles_per_s(),
        },
        "requests_per_task": tasks,
        "lease_clock": clock,
        "lock_cycles": cycles,
        "session_cpu": cpu,
    }
