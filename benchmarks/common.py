"""What every benchmark section shares: statistics, the local stack, ZooKeeper probes, processes.

Statistics: per repetition a benchmark computes its figure (a p50, a rate, a count); the report
shows the median over repetitions (at least :data:`MIN_REPEATS`), with its spread
(:func:`spread`: min, max and the interquartile range) where a section gives it. Sections 2
and 4 take ratios and differences against a baseline per repetition (the two contenders' runs
of the same repetition, :func:`paired`) and summarise those the same way; the others take them
of the medians.

The stack: one Redis for the whole run, and a fresh standalone ZooKeeper per section, every one
with the same settings (:data:`ZK_SETTINGS`: ZooKeeperServer's defaults, fsync on; the test
suite turns fsync off for its own servers, tests/conftest.py), so one section's left-over
sessions, watches or heap never weigh on the next.

Processes: the contention, herd and scale sections run their contenders in worker processes
started through a ``forkserver`` (:func:`mp_context`): each worker is forked from a clean server
process that already imported kazoo and the recipes, so no kazoo client ever crosses a fork and
starting 32 workers costs little.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient

from celery_zklock.testing import RedisServer, ZooKeeperServer
from celery_zklock.zk import four_letter
from celery_zklock.zk.adapter import create_node_and_parent_async, created_with_parent

MIN_REPEATS = 5
#: Session timeout of the worker processes' clients: long, so a busy machine expires none.
WORKER_SESSION_TIMEOUT_S = 30.0
#: Settings of every ZooKeeper the benchmark starts (ZooKeeperServer's defaults, spelt out).
ZK_SETTINGS: dict[str, Any] = {
    "force_sync": True,
    "tick_time_ms": 200,
    "container_check_interval_ms": 300,
    "container_max_per_minute": 1_000_000,
    "max_session_timeout_ms": 60_000,
}
#: Modules the forkserver imports once, so forked workers start with them loaded.
PRELOAD = (
    "kazoo.client",
    "kazoo.recipe.lock",
    "celery_zklock",
    "benchmarks.common",
    "benchmarks.naive",
    "benchmarks.contention",
    "benchmarks.herd",
    "benchmarks.scale",
    "benchmarks.sizing",
)

Progress = Callable[[str], None]


def progress(message: str) -> None:
    """Print a progress line to stderr with the time since the run began."""
    print(f"[{time.monotonic() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


_STARTED = time.monotonic()


# ---------------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (``values`` need not be sorted)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of per-repetition figures: ``median``, ``min``, ``max``, the quartiles
    ``q1`` and ``q3`` (``statistics.quantiles``, inclusive method) and ``iqr`` = q3 - q1."""
    if not values:
        raise ValueError("spread of no values")
    ordered = sorted(float(v) for v in values)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {
        "median": median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "n": len(ordered),
    }


def spread_or_none(values: Sequence[float | None]) -> dict[str, float] | None:
    """:func:`spread` of the values if every one is present, else None."""
    present = [v for v in values if v is not None]
    return spread(present) if present and len(present) == len(values) else None


def paired(
    values: Sequence[float | None],
    baseline: Sequence[float | None],
    combine: Callable[[float, float], float | None],
) -> dict[str, float] | None:
    """:func:`spread` of ``combine(value, base)`` per repetition (same index in both lists);
    None if the lists differ in length or any pair lacks a figure."""
    if not values or len(values) != len(baseline):
        return None
    combined: list[float | None] = []
    for value, base in zip(values, baseline, strict=True):
        combined.append(None if value is None or base is None else combine(value, base))
    return spread_or_none(combined)


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: each repetition starts with another contender."""
    if not items:
        return []
    shift = rep % len(items)
    return list(items[shift:]) + list(items[:shift])


# ------------------------------------------------------------------------------------ the stack


#: Section -> its changes to ZK_SETTINGS. The task-level sections run ZooKeeper's own default
#: container check (60 s), as production does: the tests' 300 ms makes the server reap the idle
#: container of a lock name between two tasks, and every fresh key then pays a NoNode retry.
ZK_SETTINGS_OF_SECTION: dict[str, dict[str, Any]] = {
    "celery": {"container_check_interval_ms": 60_000},
    "tasklayer": {"container_check_interval_ms": 60_000},
}


@contextmanager
def zookeeper(section: str | None = None) -> Iterator[ZooKeeperServer]:
    """A fresh standalone ZooKeeper with :data:`ZK_SETTINGS` (and the section's changes),
    stopped on exit."""
    server = ZooKeeperServer(**{**ZK_SETTINGS, **ZK_SETTINGS_OF_SECTION.get(section or "", {})})
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()


#: Requests a section sends a fresh ZooKeeper before it measures (:func:`warm_zookeeper`).
ZK_WARMUP_REQUESTS = 30_000


def warm_zookeeper(hosts: str, requests: int = ZK_WARMUP_REQUESTS, window: int = 200) -> float:
    """Send a fresh ZooKeeper about ``requests`` requests of a lock's kind, untimed; the seconds
    it took.

    A production ZooKeeper has run for days: its JVM has compiled its request path and its
    transaction log is preallocated. A server started for a section has neither, and its first
    few thousand requests answer slower; in section 4 that fell on whichever contender came first
    (its first repetition was the slowest in every full run on record). So the section warms the
    server first with the requests a locked task on a fresh key makes: a ``multi`` creating a
    container and an ephemeral sequential node under it, then the node's delete (here with its
    container's, so the server's container reaper has nothing left to do while the section
    measures), ``window`` of each in flight. Everything it makes is gone when it returns.
    """
    client = KazooClient(hosts=hosts, timeout=WORKER_SESSION_TIMEOUT_S)
    client.start(timeout=30)
    started = time.monotonic()
    try:
        root = "/zklock-bench-warm"
        client.ensure_path(root)
        for first in range(0, max(requests // 2, 1), window):
            creates = []
            for index in range(first, first + window):
                parent = f"{root}/k{index}"
                answer = create_node_and_parent_async(client, parent, f"{parent}/lock-", b"")
                creates.append((parent, answer))
            deletes = []
            for parent, answer in creates:
                node, _ = created_with_parent(answer.get(timeout=30))
                transaction = client.transaction()
                transaction.delete(node)
                transaction.delete(parent)
                deletes.append(transaction.commit_async())
            for deleted in deletes:
                for result in deleted.get(timeout=30):
                    if isinstance(result, Exception):
                        raise result
        client.delete(root)
    finally:
        client.stop()
        client.close()
    return time.monotonic() - started


def mntr(port: int) -> dict[str, str]:
    """ZooKeeper's ``mntr`` answer as a dict (``zk_watch_count``, ``zk_znode_count``, ...);
    empty if the server did not answer."""
    answer = four_letter.ask("127.0.0.1", port, "mntr", timeout=5.0)
    return four_letter.parse("mntr", answer or "")


def watch_count(port: int) -> int:
    """Watches the server holds over all sessions, data and child ones; -1 if unknown.

    From ``mntr`` ``zk_watch_count``: ``wchs`` counts data watches only.
    """
    value = mntr(port).get("zk_watch_count")
    return int(value) if value is not None else -1


#: ``mntr`` counters of watches the server fired, by event type (ZooKeeper >= 3.6).
FIRED_WATCH_COUNTERS = (
    "zk_sum_node_created_watch_count",
    "zk_sum_node_deleted_watch_count",
    "zk_sum_node_changed_watch_count",
    "zk_sum_node_children_watch_count",
)


def fired_watches(port: int) -> int:
    """Watches the server has fired so far, all types together (-1 if unknown)."""
    values = mntr(port)
    if not all(name in values for name in FIRED_WATCH_COUNTERS):
        return -1
    return sum(int(values[name]) for name in FIRED_WATCH_COUNTERS)


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of process ``pid`` (``VmRSS`` in /proc), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# ---------------------------------------------------------------------------------- processes

_context: multiprocessing.context.ForkServerContext | None = None


def mp_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context every worker process of the benchmark is started from."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


class WorkerError(RuntimeError):
    """A benchmark worker process reported an exception (its traceback is the message)."""


@dataclass
class Worker:
    """One worker process and the parent's end of its command pipe."""

    process: multiprocessing.process.BaseProcess
    conn: Any

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def reply(self, timeout: float) -> Any:
        """The worker's next answer; raises WorkerError for an error answer or no answer."""
        if not self.conn.poll(timeout):
            raise WorkerError(
                f"worker pid {self.process.pid} did not answer within {timeout:.0f} s "
                f"(alive: {self.process.is_alive()})"
            )
        kind, payload = self.conn.recv()
        if kind == "error":
            raise WorkerError(f"worker pid {self.process.pid} failed:\n{payload}")
        return payload

    def stop(self, *, tell: bool = True) -> None:
        """Ask the worker to quit (unless told already), wait for it, kill it if it lingers."""
        if tell:
            with suppress(OSError, ValueError):
                self.send("quit")
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def serve_client(
    conn: Any, hosts: str, handle: Callable[[KazooClient, tuple[Any, ...]], Any]
) -> None:
    """Body of a worker process: open one kazoo session, answer ready, then reply
    ``("ok", handle(client, command))`` (or ``("error", traceback)``) to each command until
    ``"quit"``."""
    client = KazooClient(hosts=hosts, timeout=WORKER_SESSION_TIMEOUT_S)
    try:
        client.start(timeout=120)
        conn.send(("ok", None))
        while True:
            command = conn.recv()
            if command[0] == "quit":
                break
            try:
                conn.send(("ok", handle(client, command)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        client.stop()
        client.close()


def start_workers(
    target: Callable[..., None], args_for: Sequence[tuple[Any, ...]], ready_timeout: float
) -> list[Worker]:
    """Start one process per ``args_for`` entry running ``target(conn, *args)``; wait for each
    to answer ready (its first message)."""
    ctx = mp_context()
    workers: list[Worker] = []
    try:
        for args in args_for:
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=target, args=(child_end, *args), daemon=True)
            process.start()
            child_end.close()
            workers.append(Worker(process, parent_end))
        for worker in workers:
            worker.reply(ready_timeout)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Sequence[Worker]) -> None:
    for worker in workers:
        with suppress(OSError, ValueError):
            worker.send("quit")
    for worker in workers:
        worker.stop(tell=False)


def broadcast(workers: Sequence[Worker], command: tuple[Any, ...], timeout: float) -> list[Any]:
    """Send ``command`` to every worker, then collect every answer (in worker order)."""
    for worker in workers:
        worker.send(*command)
    return [worker.reply(timeout) for worker in workers]


# ------------------------------------------------------------------------------ CPU pinning

#: The CPU time unit of /proc/<pid>/stat (clock ticks per second).
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of process ``pid`` (all its threads) from /proc/<pid>/stat; None if gone.

    The kernel scales the two so that their sum is the scheduler's exact runtime, then reports
    it in clock ticks (10 ms): a difference is good to a tick per process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_snapshot(pids: Iterable[int]) -> dict[int, float]:
    """:func:`cpu_seconds` of each live pid of ``pids``."""
    found = {pid: cpu_seconds(pid) for pid in pids}
    return {pid: value for pid, value in found.items() if value is not None}


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes used between two snapshots (a process new in ``after``
    counts whole; one gone from ``after`` is lost, so callers check the pid sets)."""
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def taskset_unavailable(cpus_needed: int) -> str | None:
    """Why processes cannot be pinned here (no ``taskset``, too few CPUs), or None."""
    if shutil.which("taskset") is None:
        return "taskset is not installed (util-linux)"
    allowed = len(os.sched_getaffinity(0))
    if allowed < cpus_needed:
        return f"{allowed} CPU(s) available, pinning needs {cpus_needed}"
    return None


def thread_affinities(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets the threads of ``pid`` may run on (empty if it is gone)."""
    sets: set[frozenset[int]] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return sets
    for tid in tids:
        with suppress(OSError):
            sets.add(frozenset(os.sched_getaffinity(int(tid))))
    return sets


def pin_process(pid: int, cpus: Iterable[int]) -> str:
    """``taskset -a -p -c <cpus> <pid>``: every thread of ``pid`` (threads it starts later
    inherit it) onto ``cpus``; the command run. Raises RuntimeError if taskset fails or a
    thread is left elsewhere."""
    wanted = frozenset(cpus)
    cpu_list = ",".join(str(c) for c in sorted(wanted))
    argv = ["taskset", "-a", "-p", "-c", cpu_list, str(pid)]
    for _ in range(3):  # a thread started during the first pass may have missed it
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {(done.stdout + done.stderr).strip()}")
        if not thread_affinities(pid) - {wanted}:
            break
    else:
        raise RuntimeError(f"{' '.join(argv)}: some threads are not on CPUs {cpu_list}")
    return " ".join(argv)


# ------------------------------------------------------------------------------- the machine


def _command_output(argv: Sequence[str]) -> str:
    """What a command prints (stdout and stderr), or "" if it cannot run."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout + done.stderr).strip()


def machine_info(zk_port: int, redis_version: str | None) -> dict[str, Any]:
    """nproc, CPU model, RAM, load, Python, library and server versions."""
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    srvr = four_letter.parse("srvr", four_letter.ask("127.0.0.1", zk_port, "srvr") or "")
    # Debian's build prints "3.8.0-${mvngit.commit.id}, built on ...": keep the release.
    version = srvr.get("Zookeeper version", "unknown").split(",")[0].split("-")[0]
    versions: dict[str, str] = {}
    for module in ("kazoo", "celery", "redis", "billiard", "kombu"):
        try:
            from importlib.metadata import version as dist_version

            versions[module] = dist_version(module)
        except Exception:
            versions[module] = "unknown"
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "zookeeper_package": _command_output(["dpkg-query", "-W", "-f=${Version}", "zookeeper"]),
        "java": (_command_output(["java", "-version"]).splitlines() or ["unknown"])[0],
        "cpu_model": cpu_model,
        "ram_gib": round(mem_total / 2**30, 1) if mem_total else None,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "zookeeper": version,
        "redis_server": redis_version or "unknown",
        "platform": platform.platform(),
        **{f"{name}_version": value for name, value in versions.items()},
    }
