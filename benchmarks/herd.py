"""Section 3 of ``python -m benchmarks``: watch notifications per release with many waiters on
one lock, ours vs the naive recipe of :mod:`benchmarks.naive`.

Worker processes hold the waiting sessions and count the watch events each one receives; the
parent releases the lock at the slowest pace (every queued waiter's watch armed again before
each release). Method: ``docs/benchmarks.md``, section 3.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler

from benchmarks.common import (
    Progress,
    Worker,
    broadcast,
    fired_watches,
    median,
    mp_context,
    rotated,
    start_workers,
    stop_workers,
    wait_for,
    watch_count,
)
from benchmarks.naive import HOLDER_WATCHES as NAIVE_HOLDER_WATCHES
from benchmarks.naive import NaiveLock
from celery_zklock import Lease, Mutex
from celery_zklock.testing import ZooKeeperServer

RECIPES = ("ours", "naive")
HOLDER_WATCHES = {"ours": 0, "naive": NAIVE_HOLDER_WATCHES}
#: Target: notifications per release for our exclusive waiters, at every waiter count.
TARGET_PER_RELEASE = 1.0
SESSION_TIMEOUT_S = 30.0
#: Longest wait for our holder's break watch: it is set at the first renewal after R = T/8.
BREAK_WATCH_WAIT_S = 3 * SESSION_TIMEOUT_S / 8 + 5.0
#: Longest wait of one step (all armed, one paced release, joining the waiters).
STEP_TIMEOUT_S = 180.0
ACQUIRE_TIMEOUT_S = 900.0
ROOT = "/bench/herd"


# ---------------------------------------------------------------------------- worker process


@dataclass
class _Run:
    recipe: str
    path: str
    waiters: int
    releases: int
    baseline: int
    holder_watches: int
    port: int
    go: threading.Event = field(default_factory=threading.Event)
    finishing: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pace_timeouts: int = 0


def _granted(run: _Run, grants: Any, release: Callable[[], None]) -> None:
    """A waiter got the lock: pace (see the module doc), then release, or hold until finish."""
    with grants.get_lock():
        grants.value += 1
        number = int(grants.value)
    if not run.finishing.is_set():
        if number < run.releases:
            expected = run.baseline + (run.waiters - number) + run.holder_watches
            armed = wait_for(
                lambda: run.finishing.is_set() or watch_count(run.port) >= expected,
                STEP_TIMEOUT_S,
                interval=0.002,
            )
            if not armed:
                run.pace_timeouts += 1
        else:
            run.finishing.wait()
    release()


def _waiter(run: _Run, client: KazooClient, grants: Any) -> None:
    try:
        if run.recipe == "ours":
            lease: Lease = Mutex(client, run.path).acquire(timeout=ACQUIRE_TIMEOUT_S)
            _granted(run, grants, lease.release)
        else:
            lock = NaiveLock(client, run.path)
            lock.enqueue()
            run.go.wait()
            if lock.wait(abort=run.finishing):
                _granted(run, grants, lock.release)
    except Exception:
        run.errors.append(traceback.format_exc())


def _worker(conn: Any, hosts: str, sessions: int, grants: Any) -> None:
    """One worker process: ``sessions`` kazoo clients, commands from the parent on ``conn``."""
    counts: dict[int, int] = {}
    original = ConnectionHandler._read_watch_event

    def counted(self: ConnectionHandler, buffer: bytes, offset: int) -> Any:
        key = id(self.client)
        counts[key] = counts.get(key, 0) + 1
        return original(self, buffer, offset)

    ConnectionHandler._read_watch_event = counted
    clients: list[KazooClient] = []
    try:
        for _ in range(sessions):
            client = KazooClient(hosts=hosts, timeout=SESSION_TIMEOUT_S)
            client.start(timeout=120)
            clients.append(client)
        conn.send(("ok", len(clients)))
        run: _Run | None = None
        active: list[KazooClient] = []
        while True:
            command = conn.recv()
            try:
                kind = command[0]
                if kind == "quit":
                    break
                if kind == "run":
                    _, recipe, path, n_active, waiters, releases, baseline, port = command
                    run = _Run(
                        recipe, path, waiters, releases, baseline, HOLDER_WATCHES[recipe], port
                    )
                    active = clients[:n_active]
                    for client in active:
                        thread = threading.Thread(
                            target=_waiter, args=(run, client, grants), daemon=True
                        )
                        thread.start()
                        run.threads.append(thread)
                    conn.send(("ok", None))
                elif kind == "go":
                    assert run is not None
                    run.go.set()
                    conn.send(("ok", None))
                elif kind == "snapshot":
                    conn.send(("ok", [counts.get(id(client), 0) for client in active]))
                elif kind == "finish":
                    assert run is not None
                    run.finishing.set()
                    run.go.set()
                    conn.send(("ok", None))
                elif kind == "join":
                    assert run is not None
                    deadline = time.monotonic() + STEP_TIMEOUT_S
                    for thread in run.threads:
                        thread.join(max(0.0, deadline - time.monotonic()))
                    stuck = sum(thread.is_alive() for thread in run.threads)
                    conn.send(
                        (
                            "ok",
                            {
                                "stuck": stuck,
                                "errors": run.errors[:3],
                                "error_count": len(run.errors),
                                "pace_timeouts": run.pace_timeouts,
                            },
                        )
                    )
                else:
                    raise ValueError(f"unknown command {kind!r}")
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        for client in clients:
            try:
                client.stop()
                client.close()
            except Exception:
                pass


# -------------------------------------------------------------------------------------- parent


def _share(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _children(client: KazooClient, path: str) -> int:
    try:
        return len(client.get_children(path))
    except Exception:
        return -1


def _one_run(
    server: ZooKeeperServer,
    holder: KazooClient,
    workers: Sequence[Worker],
    grants: Any,
    recipe: str,
    waiters: int,
    releases: int,
    rep: int,
) -> dict[str, Any]:
    port = server.port
    path = f"{ROOT}/{recipe}/n{waiters}r{rep}"
    holder_watches = HOLDER_WATCHES[recipe]
    baseline = watch_count(port)
    with grants.get_lock():
        grants.value = 0
    held: Lease | NaiveLock
    # Our holder's lease, once held for a renewal interval, gets a data watch on its own node
    # (the lease clock's break watch, docs/operating.md): wait for it, so that every count
    # below knows it is there; it fires at the holder's release, before the waiters' turns.
    holder_break_watch = 0
    # Our waiter next in line also watches its own node (it is granted on the holder's deletion
    # alone); it removes that watch when granted, so it never fires: no notification.
    next_in_line_watch = 0
    if recipe == "ours":
        held = Mutex(holder, path).acquire(timeout=60)
        holder_break_watch = next_in_line_watch = 1
        if not wait_for(lambda: watch_count(port) == baseline + 1, BREAK_WATCH_WAIT_S, 0.05):
            raise RuntimeError(
                f"herd ours n={waiters}: the holder's break watch was not set within "
                f"{BREAK_WATCH_WAIT_S:.0f} s ({watch_count(port)} watches, {baseline} before)"
            )
    else:
        naive = NaiveLock(holder, path)
        if not naive.acquire():
            raise RuntimeError("the naive holder was not granted its lock")
        held = naive
    shares = _share(waiters, len(workers))
    for worker, share in zip(workers, shares, strict=True):
        worker.send("run", recipe, path, share, waiters, releases, baseline, port)
    for worker in workers:
        worker.reply(STEP_TIMEOUT_S)
    if not wait_for(lambda: _children(holder, path) == waiters + 1, STEP_TIMEOUT_S, 0.05):
        raise RuntimeError(
            f"herd {recipe} n={waiters}: {_children(holder, path)} contenders queued, "
            f"expected {waiters + 1}"
        )
    broadcast(workers, ("go",), STEP_TIMEOUT_S)
    # The holder's own watch, if the recipe keeps one, fired when the waiters joined.
    armed = baseline + waiters + holder_break_watch + next_in_line_watch
    if not wait_for(lambda: watch_count(port) == armed, STEP_TIMEOUT_S, 0.02):
        raise RuntimeError(
            f"herd {recipe} n={waiters}: {watch_count(port)} watches armed, expected {armed}"
        )
    before = broadcast(workers, ("snapshot",), STEP_TIMEOUT_S)
    fired_before = fired_watches(port)
    started = time.monotonic()
    held.release()
    settled = baseline + (waiters - releases) + holder_watches
    done = wait_for(
        lambda: grants.value >= releases and watch_count(port) >= settled,
        STEP_TIMEOUT_S * max(1, releases // 10),
        0.01,
    )
    elapsed = time.monotonic() - started
    time.sleep(0.2)  # events still in flight would land now
    after = broadcast(workers, ("snapshot",), STEP_TIMEOUT_S)
    fired_after = fired_watches(port)
    broadcast(workers, ("finish",), STEP_TIMEOUT_S)
    joined = broadcast(workers, ("join",), STEP_TIMEOUT_S + 30)
    deltas = [
        a - b
        for worker_after, worker_before in zip(after, before, strict=True)
        for a, b in zip(worker_after, worker_before, strict=True)
    ]
    total = sum(deltas)
    problems: list[str] = []
    if not done:
        problems.append(f"only {grants.value} of {releases} grants within the deadline")
    for answer in joined:
        if answer["stuck"]:
            problems.append(f"{answer['stuck']} waiter threads did not finish")
        if answer["error_count"]:
            problems.append(f"{answer['error_count']} waiter errors: {answer['errors'][0]}")
        if answer["pace_timeouts"]:
            problems.append(f"{answer['pace_timeouts']} releases not paced (watch re-arm timeout)")
    left = _children(holder, path)
    if left > 0:
        problems.append(f"{left} contender nodes left after the run")
    return {
        "notifications": total,
        "releases": releases,
        "per_release": total / releases,
        "max_per_session": max(deltas) if deltas else 0,
        # The server's own count of watches it fired meanwhile, less our holder's break watch
        # (it fires at the holder's release): a cross-check.
        "server_fired": fired_after - fired_before - holder_break_watch
        if fired_before >= 0 and fired_after >= 0
        else None,
        "sessions_notified": sum(1 for d in deltas if d),
        "seconds": elapsed,
        "problems": problems,
    }


def run_section(
    server: ZooKeeperServer,
    *,
    waiter_counts: Sequence[int],
    releases: int,
    repeats: int,
    processes: int,
    progress: Progress,
) -> dict[str, Any]:
    """Section 3: every waiter count, both recipes, ``repeats`` repetitions each."""
    total = max(waiter_counts)
    grants = mp_context().Value("i", 0)
    progress(f"herd: opening {total} sessions in {processes} processes")
    opened = time.monotonic()
    workers = start_workers(
        _worker,
        [(server.hosts, share, grants) for share in _share(total, processes)],
        ready_timeout=600,
    )
    progress(f"herd: {total} sessions open in {time.monotonic() - opened:.1f} s")
    holder = KazooClient(hosts=server.hosts, timeout=SESSION_TIMEOUT_S)
    holder.start(timeout=60)
    results: dict[str, dict[str, Any]] = {}
    try:
        holder.ensure_path(f"{ROOT}/ours")
        holder.ensure_path(f"{ROOT}/naive")
        for waiters in waiter_counts:
            count_releases = min(releases, waiters)
            samples: dict[str, list[dict[str, Any]]] = {recipe: [] for recipe in RECIPES}
            for rep in range(repeats):
                for recipe in rotated(RECIPES, rep):
                    sample = _one_run(
                        server, holder, workers, grants, recipe, waiters, count_releases, rep
                    )
                    samples[recipe].append(sample)
                    progress(
                        f"herd: n={waiters} {recipe} rep {rep + 1}/{repeats}: "
                        f"{sample['per_release']:.2f} notifications/release "
                        f"({sample['seconds']:.1f} s)"
                        + (f" PROBLEMS: {sample['problems']}" if sample["problems"] else "")
                    )
            results[str(waiters)] = {
                recipe: {
                    "per_release": median([s["per_release"] for s in runs]),
                    "max_per_session": max(s["max_per_session"] for s in runs),
                    "releases_per_run": count_releases,
                    "per_repeat": runs,
                }
                for recipe, runs in samples.items()
            }
    finally:
        holder.stop()
        holder.close()
        stop_workers(workers)
    return {
        "config": {
            "waiter_counts": list(waiter_counts),
            "releases_per_run": releases,
            "repeats": repeats,
            "processes": processes,
            "sessions": total,
            "session_timeout_s": SESSION_TIMEOUT_S,
        },
        "results": results,
    }
