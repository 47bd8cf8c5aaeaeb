"""Section 1 of ``python -m benchmarks``: uncontended acquire+release latency of our recipes,
against a floor (a bare ephemeral create + delete), kazoo's Lock and redis-py's Lock.

Also runnable alone: ``python -m benchmarks.recipes [--iterations N] [--repeats R] [--json
PATH]``. The cases and how they are timed: ``docs/benchmarks.md``, section 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock as KazooLock

from benchmarks.common import (
    MIN_REPEATS,
    ZK_SETTINGS,
    machine_info,
    percentile,
    redis_server,
    zookeeper,
)
from celery_zklock import Mutex, RateLimit, ReadWriteLock

DEFAULT_ITERATIONS = 300
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 150
#: The fresh-key mutex should cost at most this many times the floor (p50).
TARGET_RATIO = 1.2
#: ... and be at least this many times faster than kazoo's Lock on fresh keys (p50).
TARGET_VS_KAZOO = 2.0
#: The rate of the admission cases: more than a cycle can reach on one key, so every one is
#: admitted and the reused key keeps about a second of admissions (old ones go at each decision).
RATE = "1000/s"
#: Deadline of one acquire in a cycle; an uncontended acquire that takes this long is a failure.
ACQUIRE_TIMEOUT_S = 10.0

Cycle = Callable[[int], None]


@dataclass(frozen=True)
class Clients:
    """The connections a cycle may use."""

    zk: KazooClient
    redis: redis.Redis


@dataclass(frozen=True)
class Case:
    """One contender: ``make(clients, rep)`` returns the cycle to time for repetition ``rep``."""

    name: str
    description: str
    make: Callable[[Clients, str], Cycle]


def _floor(clients: Clients, rep: str) -> Cycle:
    client = clients.zk
    node = "/bench/floor/n"

    def cycle(_i: int) -> None:
        client.create(node, ephemeral=True)
        client.delete(node)

    return cycle


def _mutex(base: str, *, fresh: bool) -> Callable[[Clients, str], Cycle]:
    def make(clients: Clients, rep: str) -> Cycle:
        client = clients.zk

        def cycle(i: int) -> None:
            path = f"{base}/r{rep}k{i}" if fresh else f"{base}/key"
            Mutex(client, path).acquire(timeout=ACQUIRE_TIMEOUT_S).release()

        return cycle

    return make


def _rw(base: str, side: str, *, fresh: bool) -> Callable[[Clients, str], Cycle]:
    def make(clients: Clients, rep: str) -> Cycle:
        client = clients.zk

        def cycle(i: int) -> None:
            lock = ReadWriteLock(client, f"{base}/r{rep}k{i}" if fresh else f"{base}/key")
            (lock.write if side == "write" else lock.read).acquire(
                timeout=ACQUIRE_TIMEOUT_S
            ).release()

        return cycle

    return make


def _rate(base: str, *, fresh: bool) -> Callable[[Clients, str], Cycle]:
    """One RateLimit admission per cycle, under a rate no cycle reaches (always admitted): the
    decision's turn (a Mutex cycle), the admission node, the read of the others, and on a
    reused key the removal of those older than the period."""

    def make(clients: Clients, rep: str) -> Cycle:
        client = clients.zk

        def cycle(i: int) -> None:
            path = f"{base}/r{rep}k{i}" if fresh else f"{base}/key"
            if not RateLimit(client, path, RATE).acquire(timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(f"RateLimit on {path} did not admit")

        return cycle

    return make


def _kazoo(base: str, *, fresh: bool) -> Callable[[Clients, str], Cycle]:
    def make(clients: Clients, rep: str) -> Cycle:
        client = clients.zk

        def cycle(i: int) -> None:
            lock = KazooLock(client, f"{base}/r{rep}k{i}" if fresh else f"{base}/key")
            if not lock.acquire(timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(f"kazoo Lock on {lock.path} was not acquired")
            lock.release()

        return cycle

    return make


def _redis(base: str, *, fresh: bool) -> Callable[[Clients, str], Cycle]:
    def make(clients: Clients, rep: str) -> Cycle:
        client = clients.redis

        def cycle(i: int) -> None:
            name = f"{base}:r{rep}k{i}" if fresh else f"{base}:key"
            lock = client.lock(name, timeout=60, blocking_timeout=ACQUIRE_TIMEOUT_S)
            if not lock.acquire():
                raise RuntimeError(f"redis-py Lock {name} was not acquired")
            lock.release()

        return cycle

    return make


CASES: tuple[Case, ...] = (
    Case("floor", "bare ephemeral create+delete, existing parent", _floor),
    Case("mutex-fresh", "our Mutex, new key each cycle", _mutex("/bench/ours", fresh=True)),
    Case("mutex-reused", "our Mutex, one reused key", _mutex("/bench/ours-reused", fresh=False)),
    Case(
        "rw-write-fresh",
        "our ReadWriteLock.write, new key",
        _rw("/bench/rw-write", "write", fresh=True),
    ),
    Case(
        "rw-write-reused",
        "our ReadWriteLock.write, one reused key",
        _rw("/bench/rw-write-reused", "write", fresh=False),
    ),
    Case(
        "rw-read-fresh",
        "our ReadWriteLock.read, new key",
        _rw("/bench/rw-read", "read", fresh=True),
    ),
    Case(
        "rw-read-reused",
        "our ReadWriteLock.read, one reused key",
        _rw("/bench/rw-read-reused", "read", fresh=False),
    ),
    Case("rate-fresh", "our RateLimit admission, new key", _rate("/bench/rate", fresh=True)),
    Case(
        "rate-reused",
        "our RateLimit admission, one reused key (1000/s: old ones removed)",
        _rate("/bench/rate-reused", fresh=False),
    ),
    Case("kazoo-fresh", "kazoo Lock, new key each cycle", _kazoo("/bench/kazoo", fresh=True)),
    Case("kazoo-reused", "kazoo Lock, one reused key", _kazoo("/bench/kazoo-reused", fresh=False)),
    Case("redis-fresh", "redis-py Lock, new key each cycle", _redis("bench:redis", fresh=True)),
    Case(
        "redis-reused", "redis-py Lock, one reused key", _redis("bench:redis-reused", fresh=False)
    ),
)
#: Persistent directories that hold the keys (an application's lock roots).
ROOTS = (
    "/bench/floor",
    "/bench/ours",
    "/bench/ours-reused",
    "/bench/rw-write",
    "/bench/rw-write-reused",
    "/bench/rw-read",
    "/bench/rw-read-reused",
    "/bench/rate",
    "/bench/rate-reused",
    "/bench/kazoo",
    "/bench/kazoo-reused",
)


# ----------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Sample:
    """One case in one repetition."""

    p50_ms: float
    p99_ms: float
    ops_per_s: float


def run_batch(cycle: Cycle, iterations: int) -> Sample:
    """Time ``iterations`` cycles one after the other."""
    durations: list[int] = []
    gc.collect()
    clock = time.perf_counter_ns
    started = clock()
    for i in range(iterations):
        t0 = clock()
        cycle(i)
        durations.append(clock() - t0)
    total_ns = clock() - started
    ms = [d / 1e6 for d in durations]
    return Sample(percentile(ms, 50), percentile(ms, 99), iterations / (total_ns / 1e9))


def run(
    clients: Clients,
    cases: Sequence[Case],
    iterations: int,
    repeats: int,
    warmup: int,
    progress: Callable[[str], None],
) -> dict[str, list[Sample]]:
    """Warm up, then ``repeats`` repetitions of every case; samples per case in rep order."""
    for root in ROOTS:
        clients.zk.ensure_path(root)
    if warmup:
        progress(f"recipes: warm-up, {warmup} cycles per case")
        for case in cases:
            run_batch(case.make(clients, "w"), warmup)
    samples: dict[str, list[Sample]] = {case.name: [] for case in cases}
    for rep in range(repeats):
        shift = rep % len(cases)
        order = list(cases[shift:]) + list(cases[:shift])
        started = time.monotonic()
        for case in order:
            samples[case.name].append(run_batch(case.make(clients, str(rep)), iterations))
        progress(
            f"recipes: repetition {rep + 1}/{repeats} done in {time.monotonic() - started:.1f} s"
        )
    return samples


# ----------------------------------------------------------------------------------- reporting


def summarize(cases: Sequence[Case], samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
    """Medians over repetitions per case, with ratios (of medians) to the floor."""
    summary: dict[str, dict[str, Any]] = {}
    for case in cases:
        runs = samples[case.name]
        summary[case.name] = {
            "description": case.description,
            "p50_ms": statistics.median(s.p50_ms for s in runs),
            "p99_ms": statistics.median(s.p99_ms for s in runs),
            "ops_per_s": statistics.median(s.ops_per_s for s in runs),
            "per_repeat": [
                {"p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "ops_per_s": s.ops_per_s} for s in runs
            ],
        }
    floor = summary["floor"]
    for entry in summary.values():
        entry["p50_vs_floor"] = entry["p50_ms"] / floor["p50_ms"]
        entry["p99_vs_floor"] = entry["p99_ms"] / floor["p99_ms"]
        # Paired per repetition: how much the ratio moved between repetitions.
        ratios = [
            r["p50_ms"] / f["p50_ms"]
            for r, f in zip(entry["per_repeat"], floor["per_repeat"], strict=True)
        ]
        entry["p50_vs_floor_range"] = [min(ratios), max(ratios)]
    return summary


def headlines(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours = summary["mutex-fresh"]
    theirs = summary["kazoo-fresh"]
    faster = theirs["p50_ms"] / ours["p50_ms"]
    return {
        "mutex_fresh_p50_ms": ours["p50_ms"],
        "mutex_fresh_vs_floor": ours["p50_vs_floor"],
        "target_vs_floor": TARGET_RATIO,
        "meets_target": ours["p50_vs_floor"] <= TARGET_RATIO,
        "kazoo_fresh_p50_ms": theirs["p50_ms"],
        "kazoo_fresh_vs_floor": theirs["p50_vs_floor"],
        "ours_faster_by": faster,
        "target_vs_kazoo": TARGET_VS_KAZOO,
        "meets_target_vs_kazoo": faster >= TARGET_VS_KAZOO,
    }


def run_section(
    zk_hosts: str,
    redis_url: str,
    *,
    iterations: int,
    repeats: int,
    warmup: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Section 1 of ``python -m benchmarks``: every case, summarized, with the headlines."""
    zk = KazooClient(hosts=zk_hosts, timeout=10.0)
    zk.start(timeout=30)
    red = redis.Redis.from_url(redis_url)
    try:
        samples = run(Clients(zk, red), CASES, iterations, repeats, warmup, progress)
    finally:
        zk.stop()
        zk.close()
        red.close()
    summary = summarize(CASES, samples)
    return {
        "config": {
            "iterations": iterations,
            "repeats": repeats,
            "warmup": warmup,
            "clients": "one kazoo client, one redis-py client, one thread",
        },
        "cases": summary,
        "headlines": headlines(summary),
    }


def render(section: dict[str, Any]) -> str:
    config = section["config"]
    lines = [
        f"{config['iterations']} cycles x {config['repeats']} repetitions per case "
        f"(+{config['warmup']} warm-up); medians over repetitions",
        "",
        f"{'case':<16}{'p50 ms':>9}{'p99 ms':>9}{'ops/s':>9}{'p50/floor':>11}"
        f"{'(range)':>14}{'p99/floor':>11}",
    ]
    for name, entry in section["cases"].items():
        low, high = entry["p50_vs_floor_range"]
        lines.append(
            f"{name:<16}{entry['p50_ms']:>9.3f}{entry['p99_ms']:>9.3f}{entry['ops_per_s']:>9.0f}"
            f"{entry['p50_vs_floor']:>10.2f}x{f'{low:.2f}-{high:.2f}':>14}"
            f"{entry['p99_vs_floor']:>10.2f}x"
        )
    head = section["headlines"]
    lines += [
        "",
        f"mutex fresh-key p50 = {head['mutex_fresh_p50_ms']:.3f} ms = "
        f"{head['mutex_fresh_vs_floor']:.2f} x floor (target <= {TARGET_RATIO}x)",
        f"kazoo Lock fresh-key p50 = {head['kazoo_fresh_p50_ms']:.3f} ms = "
        f"{head['kazoo_fresh_vs_floor']:.2f} x floor; "
        f"ours is {head['ours_faster_by']:.2f} x faster (target >= {TARGET_VS_KAZOO}x)",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recipes",
        description="Acquire+release latency of our lock recipes vs a bare create+delete, "
        "kazoo's Lock and redis-py's Lock, on a private standalone ZooKeeper (fsync on) and "
        "Redis. The whole suite is `python -m benchmarks`.",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"cycles per case per repetition (default {DEFAULT_ITERATIONS})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"repetitions, at least {MIN_REPEATS} (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"warm-up cycles per case, not recorded (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the results as JSON to this file"
    )
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be at least {MIN_REPEATS} (medians over repetitions)")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    with zookeeper() as zk, redis_server() as red:
        redis_version = str(redis.Redis.from_url(red.url).info("server").get("redis_version"))
        machine = machine_info(zk.port, redis_version)
        section = run_section(
            zk.hosts,
            red.url,
            iterations=args.iterations,
            repeats=args.repeats,
            warmup=args.warmup,
            progress=progress,
        )
    report: dict[str, Any] = {
        "benchmark": "recipes",
        "machine": machine,
        "zookeeper_settings": ZK_SETTINGS,
        **section,
        "wall_s": time.monotonic() - started,
    }
    print(render(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwritten to {args.json}")
    print(f"wall {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
