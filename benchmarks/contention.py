"""Section 2 of ``python -m benchmarks``: many processes on one key; grants per second and
handoff latency, ours vs kazoo's Lock.

``n`` worker processes (one ZooKeeper session each) loop acquire/release on one key per run and
note grant and release times on one clock (``CLOCK_MONOTONIC``); the parent merges them.
Method: ``docs/benchmarks.md``, section 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock as KazooLock

from benchmarks.common import (
    WORKER_SESSION_TIMEOUT_S,
    Progress,
    Worker,
    broadcast,
    median,
    median_or_none,
    paired,
    percentile,
    rotated,
    serve_client,
    spread,
    spread_or_none,
    start_workers,
    stop_workers,
)
from celery_zklock import Mutex
from celery_zklock.testing import ZooKeeperServer

RECIPES = ("ours", "kazoo")
ROOT = "/bench/contention"
#: Seconds between the parent's "go" and the start time: every worker is asleep by then.
START_DELAY_S = 0.5
WARMUP_S = 0.5


def _locker(client: KazooClient, recipe: str, path: str) -> tuple[Callable[[float], Any], Any]:
    """(acquire(timeout) -> handle, release(handle)) for one recipe on ``path``."""
    if recipe == "ours":
        mutex = Mutex(client, path)

        def acquire_ours(timeout: float) -> Any:
            return mutex.acquire(timeout=timeout)

        def release_ours(lease: Any) -> None:
            lease.release()

        return acquire_ours, release_ours
    lock = KazooLock(client, path)

    def acquire_kazoo(timeout: float) -> Any:
        if not lock.acquire(timeout=timeout):
            raise RuntimeError(f"kazoo Lock {path}: not acquired within {timeout:.0f} s")
        return lock

    def release_kazoo(held: Any) -> None:
        held.release()

    return acquire_kazoo, release_kazoo


def _contend(
    client: KazooClient, recipe: str, path: str, start_at: float, stop_at: float
) -> list[tuple[float, float]]:
    acquire, release = _locker(client, recipe, path)
    clock = time.monotonic
    pairs: list[tuple[float, float]] = []
    while clock() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - clock())))
    while True:
        now = clock()
        if now >= stop_at:
            break
        held = acquire(stop_at - now + 60.0)
        granted = clock()
        released = clock()
        release(held)
        pairs.append((granted, released))
    return pairs


def _worker(conn: Any, hosts: str) -> None:
    serve_client(conn, hosts, _handle)


def _handle(client: KazooClient, command: tuple[Any, ...]) -> Any:
    _, recipe, path, start_at, stop_at = command
    return _contend(client, recipe, path, start_at, stop_at)


def _analyse(
    pairs: Sequence[tuple[float, float]], start_at: float, stop_at: float
) -> dict[str, Any]:
    ordered = sorted(pairs)
    inside = [p for p in ordered if start_at <= p[0] <= stop_at]
    handoffs_ms: list[float] = []
    overlaps = 0
    for (_, released), (granted, _) in pairwise(ordered):
        if granted < released:
            overlaps += 1
        if start_at <= granted <= stop_at:
            handoffs_ms.append((granted - released) * 1000.0)
    return {
        "grants": len(inside),
        "grants_per_s": len(inside) / (stop_at - start_at),
        "handoff_mean_ms": sum(handoffs_ms) / len(handoffs_ms) if handoffs_ms else None,
        "handoff_p99_ms": percentile(handoffs_ms, 99) if handoffs_ms else None,
        "overlaps": overlaps,
    }


def _one_run(workers: Sequence[Worker], recipe: str, path: str, duration: float) -> dict[str, Any]:
    start_at = time.monotonic() + START_DELAY_S
    stop_at = start_at + duration
    answers = broadcast(workers, ("run", recipe, path, start_at, stop_at), timeout=duration + 300)
    pairs = [pair for answer in answers for pair in answer]
    return _analyse(pairs, start_at, stop_at)


def _summarise(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians (the targets' figures) and spreads per recipe; ours / kazoo per repetition."""
    entry: dict[str, Any] = {
        recipe: {
            "grants_per_s": median([s["grants_per_s"] for s in runs]),
            "handoff_mean_ms": median_or_none([s["handoff_mean_ms"] for s in runs]),
            "handoff_p99_ms": median_or_none([s["handoff_p99_ms"] for s in runs]),
            "grants_spread": spread([s["grants_per_s"] for s in runs]),
            "handoff_mean_spread": spread_or_none([s["handoff_mean_ms"] for s in runs]),
            "handoff_p99_spread": spread_or_none([s["handoff_p99_ms"] for s in runs]),
            "overlaps": sum(s["overlaps"] for s in runs),
            "per_repeat": runs,
        }
        for recipe, runs in samples.items()
    }
    ours, kazoo = samples["ours"], samples["kazoo"]
    entry["ours_vs_kazoo"] = {
        "grants_ratio": paired(
            [s["grants_per_s"] for s in ours],
            [s["grants_per_s"] for s in kazoo],
            lambda a, b: a / b if b else None,
        ),
        "handoff_p99_ratio": paired(
            [s["handoff_p99_ms"] for s in ours],
            [s["handoff_p99_ms"] for s in kazoo],
            lambda a, b: a / b if b else None,
        ),
    }
    return entry


def run_section(
    server: ZooKeeperServer,
    *,
    process_counts: Sequence[int],
    duration: float,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """Section 2: for each process count, ``repeats`` runs of each recipe."""
    admin = KazooClient(hosts=server.hosts, timeout=WORKER_SESSION_TIMEOUT_S)
    admin.start(timeout=60)
    results: dict[str, dict[str, Any]] = {}
    try:
        for recipe in RECIPES:
            admin.ensure_path(f"{ROOT}/{recipe}")
        for count in process_counts:
            progress(f"contention: starting {count} processes")
            workers = start_workers(_worker, [(server.hosts,)] * count, ready_timeout=300)
            try:
                for recipe in RECIPES:
                    _one_run(workers, recipe, f"{ROOT}/{recipe}/n{count}w", WARMUP_S)
                samples: dict[str, list[dict[str, Any]]] = {recipe: [] for recipe in RECIPES}
                for rep in range(repeats):
                    for recipe in rotated(RECIPES, rep):
                        path = f"{ROOT}/{recipe}/n{count}r{rep}"
                        sample = _one_run(workers, recipe, path, duration)
                        samples[recipe].append(sample)
                        progress(
                            f"contention: n={count} {recipe} rep {rep + 1}/{repeats}: "
                            f"{sample['grants_per_s']:.0f} grants/s, handoff mean "
                            f"{sample['handoff_mean_ms'] or float('nan'):.2f} ms, p99 "
                            f"{sample['handoff_p99_ms'] or float('nan'):.2f} ms"
                        )
            finally:
                stop_workers(workers)
            results[str(count)] = _summarise(samples)
    finally:
        admin.stop()
        admin.close()
    return {
        "config": {
            "process_counts": list(process_counts),
            "duration_s": duration,
            "repeats": repeats,
            "hold": "none (acquire, note times, release)",
            "clock": "time.monotonic (CLOCK_MONOTONIC, shared by all processes)",
        },
        "results": results,
    }
