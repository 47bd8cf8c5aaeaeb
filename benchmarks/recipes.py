"""Acquire+release latency of our lock recipes, against a floor and against kazoo's Lock.

Run: ``python -m benchmarks.recipes [--iterations N] [--repeats R] [--json PATH]``.

It starts its own standalone ZooKeeper (:class:`celery_zklock.testing.ZooKeeperServer` with its
defaults: fsync on, container check every 300 ms), connects one kazoo client, and times one
uncontended acquire+release cycle at a time, for:

``floor``
    a bare ephemeral create + delete of one node under an existing parent: two writes, two round
    trips, nothing a lock could leave out.
``mutex-fresh`` / ``mutex-reused``
    our :class:`~celery_zklock.Mutex` on a new key each cycle (``/bench/ours/r<rep>k<i>``: the
    key's container does not exist yet, as with per-argument task keys) and on one reused key.
``rw-write-fresh`` / ``rw-read-fresh``
    the write and read sides of our :class:`~celery_zklock.ReadWriteLock`, new key each cycle.
``kazoo-fresh`` / ``kazoo-reused``
    ``kazoo.recipe.lock.Lock`` on a new key each cycle and on one reused key.

Every cycle builds its lock object anew (as a task does per call); the directories that hold the
keys (``/bench/ours`` ...) exist beforehand as persistent nodes, like an application's lock root.
One *repetition* runs every case for ``--iterations`` cycles, one case after the other, in an
order rotated per repetition, so drifts in machine load land on every case alike. Each
repetition yields p50, p99 (nearest rank) and ops/s per case; the report shows the medians over
repetitions, and ratios to the floor are ratios of those medians. A warm-up repetition (not
recorded) runs first.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kazoo
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock as KazooLock

from celery_zklock import Mutex, ReadWriteLock
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.testing.zookeeper import srvr

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "recipes.json"
DEFAULT_ITERATIONS = 300
DEFAULT_REPEATS = 5
MIN_REPEATS = 5
DEFAULT_WARMUP = 150
#: The fresh-key mutex should cost at most this many times the floor (p50).
TARGET_RATIO = 1.3
#: Deadline of one acquire in a cycle; an uncontended acquire that takes this long is a failure.
ACQUIRE_TIMEOUT_S = 10.0

Cycle = Callable[[int], None]


@dataclass(frozen=True)
class Case:
    """One contender: ``make(client, rep)`` returns the cycle to time for repetition ``rep``."""

    name: str
    description: str
    make: Callable[[KazooClient, str], Cycle]


def _floor(client: KazooClient, rep: str) -> Cycle:
    node = "/bench/floor/n"

    def cycle(_i: int) -> None:
        client.create(node, ephemeral=True)
        client.delete(node)

    return cycle


def _mutex(base: str, *, fresh: bool) -> Callable[[KazooClient, str], Cycle]:
    def make(client: KazooClient, rep: str) -> Cycle:
        def cycle(i: int) -> None:
            path = f"{base}/r{rep}k{i}" if fresh else f"{base}/key"
            Mutex(client, path).acquire(timeout=ACQUIRE_TIMEOUT_S).release()

        return cycle

    return make


def _rw(base: str, side: str) -> Callable[[KazooClient, str], Cycle]:
    def make(client: KazooClient, rep: str) -> Cycle:
        def cycle(i: int) -> None:
            lock = ReadWriteLock(client, f"{base}/r{rep}k{i}")
            (lock.write if side == "write" else lock.read).acquire(
                timeout=ACQUIRE_TIMEOUT_S
            ).release()

        return cycle

    return make


def _kazoo(base: str, *, fresh: bool) -> Callable[[KazooClient, str], Cycle]:
    def make(client: KazooClient, rep: str) -> Cycle:
        def cycle(i: int) -> None:
            lock = KazooLock(client, f"{base}/r{rep}k{i}" if fresh else f"{base}/key")
            if not lock.acquire(timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(f"kazoo Lock on {lock.path} was not acquired")
            lock.release()

        return cycle

    return make


CASES: tuple[Case, ...] = (
    Case("floor", "bare ephemeral create+delete, existing parent", _floor),
    Case("mutex-fresh", "our Mutex, new key each cycle", _mutex("/bench/ours", fresh=True)),
    Case("mutex-reused", "our Mutex, one reused key", _mutex("/bench/ours-reused", fresh=False)),
    Case("rw-write-fresh", "our ReadWriteLock.write, new key", _rw("/bench/rw-write", "write")),
    Case("rw-read-fresh", "our ReadWriteLock.read, new key", _rw("/bench/rw-read", "read")),
    Case("kazoo-fresh", "kazoo Lock, new key each cycle", _kazoo("/bench/kazoo", fresh=True)),
    Case("kazoo-reused", "kazoo Lock, one reused key", _kazoo("/bench/kazoo-reused", fresh=False)),
)
#: Persistent directories that hold the keys (an application's lock roots).
ROOTS = (
    "/bench/floor",
    "/bench/ours",
    "/bench/ours-reused",
    "/bench/rw-write",
    "/bench/rw-read",
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


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


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
    ms = sorted(d / 1e6 for d in durations)
    return Sample(percentile(ms, 50), percentile(ms, 99), iterations / (total_ns / 1e9))


def run(
    client: KazooClient,
    cases: Sequence[Case],
    iterations: int,
    repeats: int,
    warmup: int,
    progress: Callable[[str], None],
) -> dict[str, list[Sample]]:
    """Warm up, then ``repeats`` repetitions of every case; samples per case in rep order."""
    for root in ROOTS:
        client.ensure_path(root)
    if warmup:
        progress(f"warm-up: {warmup} cycles per case")
        for case in cases:
            run_batch(case.make(client, "w"), warmup)
    samples: dict[str, list[Sample]] = {case.name: [] for case in cases}
    for rep in range(repeats):
        shift = rep % len(cases)
        order = list(cases[shift:]) + list(cases[:shift])
        started = time.monotonic()
        for case in order:
            samples[case.name].append(run_batch(case.make(client, str(rep)), iterations))
        progress(
            f"repetition {rep + 1}/{repeats} done in {time.monotonic() - started:.1f} s "
            f"(order: {', '.join(c.name for c in order)})"
        )
    return samples


# ----------------------------------------------------------------------------------- reporting


def machine_info(zk_port: int) -> dict[str, Any]:
    """nproc, CPU model, Python, kazoo and ZooKeeper versions."""
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    answer = srvr(zk_port) or ""
    version = re.search(r"^Zookeeper version: (.+)$", answer, re.MULTILINE)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "kazoo": getattr(kazoo, "__version__", "unknown"),
        "zookeeper": version.group(1).strip() if version else "unknown",
        "platform": platform.platform(),
    }


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
    return {
        "mutex_fresh_p50_ms": ours["p50_ms"],
        "mutex_fresh_vs_floor": ours["p50_vs_floor"],
        "target_vs_floor": TARGET_RATIO,
        "meets_target": ours["p50_vs_floor"] <= TARGET_RATIO,
        "kazoo_fresh_p50_ms": theirs["p50_ms"],
        "kazoo_fresh_vs_floor": theirs["p50_vs_floor"],
        "ours_faster_by": theirs["p50_ms"] / ours["p50_ms"],
    }


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    config = report["config"]
    lines = [
        f"machine: {machine['nproc']} CPUs ({machine['cpu_model']}), Python {machine['python']}, "
        f"kazoo {machine['kazoo']}, ZooKeeper {machine['zookeeper']}",
        f"config: standalone ZooKeeper, fsync on, one client; {config['iterations']} cycles x "
        f"{config['repeats']} repetitions per case (+{config['warmup']} warm-up); "
        "medians over repetitions",
        "",
        f"{'case':<16}{'p50 ms':>9}{'p99 ms':>9}{'ops/s':>9}{'p50/floor':>11}"
        f"{'(range)':>14}{'p99/floor':>11}",
    ]
    for name, entry in report["cases"].items():
        low, high = entry["p50_vs_floor_range"]
        lines.append(
            f"{name:<16}{entry['p50_ms']:>9.3f}{entry['p99_ms']:>9.3f}{entry['ops_per_s']:>9.0f}"
            f"{entry['p50_vs_floor']:>10.2f}x{f'{low:.2f}-{high:.2f}':>14}"
            f"{entry['p99_vs_floor']:>10.2f}x"
        )
    head = report["headlines"]
    lines += [
        "",
        f"mutex fresh-key p50 = {head['mutex_fresh_p50_ms']:.3f} ms = "
        f"{head['mutex_fresh_vs_floor']:.2f} x floor (target <= {TARGET_RATIO}x)",
        f"kazoo Lock fresh-key p50 = {head['kazoo_fresh_p50_ms']:.3f} ms = "
        f"{head['kazoo_fresh_vs_floor']:.2f} x floor; "
        f"ours is {head['ours_faster_by']:.2f} x faster",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recipes",
        description="Acquire+release latency of our lock recipes vs a bare create+delete "
        "and kazoo's Lock, on a private standalone ZooKeeper (fsync on).",
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
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help="where to write the results (default benchmarks/results/recipes.json)",
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
    with ZooKeeperServer() as server:
        client = KazooClient(hosts=server.hosts)
        client.start(timeout=15)
        try:
            machine = machine_info(server.port)
            samples = run(client, CASES, args.iterations, args.repeats, args.warmup, progress)
        finally:
            client.stop()
            client.close()
    summary = summarize(CASES, samples)
    report: dict[str, Any] = {
        "benchmark": "recipes",
        "machine": machine,
        "config": {
            "iterations": args.iterations,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "zookeeper": "standalone, ZooKeeperServer defaults (fsync on)",
            "statistic": "median over repetitions of per-repetition p50/p99 (nearest rank) "
            "and ops/s; ratios are ratios of those medians",
        },
        "cases": summary,
        "headlines": headlines(summary),
        "wall_s": time.monotonic() - started,
    }
    print(render(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten to {args.json} (wall {report['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
