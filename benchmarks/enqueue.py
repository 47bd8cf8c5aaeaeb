"""Section 6 of ``python -m benchmarks``: what ``apply_async`` costs the caller with enqueue-time
dedupe, ZkLockTask's ``lock_dedupe`` (a ZooKeeper marker) against plain ``apply_async``,
celery-singleton and celery-once (Redis keys).

No worker runs: the messages stay in the queue, which is purged after every timed batch, and
the batch's markers and Redis keys are removed, so every batch starts from the same state.
Method: ``docs/benchmarks.md``, section 6.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import redis
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NotEmptyError

from benchmarks.celery_app import (
    ONCE,
    PLAIN,
    SINGLETON,
    ZKLOCK_DEDUPE,
    ZKLOCK_SKIP,
    create_app,
)
from benchmarks.common import Progress, median, mntr, percentile, ratio
from benchmarks.contenders import Contender, Tally, section_settings
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.zk.client import close_clients

ROOT = "/bench-enqueue"
#: Redis key patterns of the two Redis libraries' locks (their defaults).
REDIS_LOCK_PATTERNS = ("SINGLETONLOCK_*", "qo_*")


CONTENDERS: tuple[Contender, ...] = (
    Contender("plain", PLAIN, "celery", "plain task; sends"),
    Contender("zklock", ZKLOCK_SKIP, "celery-zklock", "ZkLockTask, no dedupe; sends"),
    Contender(
        "zklock-dedupe-new",
        ZKLOCK_DEDUPE,
        "celery-zklock",
        'lock_dedupe="queued", a new key each call: claims a marker, sends',
    ),
    Contender(
        "zklock-dedupe-hit",
        ZKLOCK_DEDUPE,
        "celery-zklock",
        'lock_dedupe="queued", one key already queued: returns its AsyncResult, sends nothing',
        hit=True,
    ),
    Contender(
        "celery-singleton",
        SINGLETON,
        "celery-singleton",
        "Singleton, a new key each call: SET NX, sends",
    ),
    Contender(
        "celery-singleton-hit",
        SINGLETON,
        "celery-singleton",
        "Singleton, one key already queued: SET NX fails, GET, sends nothing",
        hit=True,
    ),
    Contender("celery-once", ONCE, "celery-once", "QueueOnce, a new key each call: SET NX, sends"),
    Contender(
        "celery-once-hit",
        ONCE,
        "celery-once",
        "QueueOnce graceful, one key already queued: SET NX fails, PTTL, sends nothing",
        hit=True,
        options={"once": {"graceful": True}},
    ),
)
#: Figures per repetition that the report gives as median (min - max).
FIGURES = ("p50_ms", "p99_ms", "mean_ms", "cpu_ms")
#: Counts per call that the servers saw (the report gives their median).
PER_CALL_COUNTS = (
    "sent_per_call",
    "zk_requests_per_call",
    "zk_fsyncs_per_call",
    "redis_commands_per_call",
)


class BatchFailed(RuntimeError):
    pass


class Probes:
    """What the server side saw: the queue's length, ZooKeeper's requests, Redis's commands."""

    def __init__(self, app: Celery, zk_port: int, redis_url: str) -> None:
        self.app = app
        self.zk_port = zk_port
        self.redis = redis.Redis.from_url(redis_url)
        self.queue = str(app.conf.task_default_queue)

    def queued(self) -> int:
        with self.app.connection_for_write() as conn:
            # not passive: with Redis that only reads the length (a passive declare of an
            # empty queue fails: Redis keeps no empty list)
            return int(conn.default_channel.queue_declare(queue=self.queue)[1])

    def purge(self) -> None:
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_purge(self.queue)

    def zk_counters(self) -> tuple[int, int]:
        """Requests ZooKeeper received and transaction-log fsyncs it did so far."""
        values = mntr(self.zk_port)
        return int(values.get("zk_packets_received", -1)), int(values.get("zk_cnt_fsynctime", -1))

    def redis_commands(self) -> int:
        """Commands Redis processed so far (this INFO itself not yet counted)."""
        return int(self.redis.info("stats")["total_commands_processed"])

    def clear_redis_locks(self) -> int:
        keys = [key for pattern in REDIS_LOCK_PATTERNS for key in self.redis.scan_iter(pattern)]
        if keys:
            self.redis.delete(*keys)
        return len(keys)

    def close(self) -> None:
        self.redis.close()


def clear_tree(client: KazooClient, root: str) -> int:
    """Delete every node under ``root`` (not ``root``), deepest first; how many went."""
    levels: list[list[str]] = []
    current = [root]
    while current:
        below: list[str] = []
        for path in current:
            with suppress(NoNodeError):
                below += [f"{path.rstrip('/')}/{c}" for c in client.get_children(path)]
        if below:
            levels.append(below)
        current = below
    removed = 0
    for level in reversed(levels):
        pending = [client.delete_async(path) for path in level]
        for result in pending:
            try:
                result.get(timeout=60)
                removed += 1
            except (NoNodeError, NotEmptyError):  # a container reaped, a node still busy
                pass
    return removed


def _batch(
    app: Celery,
    contender: Contender,
    tag: str,
    calls: int,
    probes: Probes,
    zk: KazooClient,
) -> dict[str, Any]:
    """``calls`` timed ``apply_async`` calls, the server side's counts, then the clean-up."""
    task = app.tasks[contender.task]
    owner = None
    if contender.hit:
        owner = task.apply_async((f"{tag}-one",))
        keys = [f"{tag}-one"] * calls
    else:
        keys = [f"{tag}-{i}" for i in range(calls)]
    call: Callable[..., Any] = task.apply_async
    options = contender.options
    results: list[Any] = []
    durations: list[int] = []
    queued_before = probes.queued()
    zk_before, fsyncs_before = probes.zk_counters()
    redis_before = probes.redis_commands()
    gc.collect()
    clock = time.perf_counter_ns
    cpu_started = time.process_time_ns()
    started = clock()
    for key in keys:
        t0 = clock()
        results.append(call((key,), **options))
        durations.append(clock() - t0)
    total_ns = clock() - started
    cpu_ns = time.process_time_ns() - cpu_started
    redis_after = probes.redis_commands()
    zk_after, fsyncs_after = probes.zk_counters()
    sent = probes.queued() - queued_before
    ids = {getattr(r, "id", None) for r in results}
    results.clear()  # the AsyncResults unsubscribe from their result channels: untimed
    zk_nodes = clear_tree(zk, ROOT)
    redis_keys = probes.clear_redis_locks()
    probes.purge()
    expected = 0 if contender.hit else calls
    if sent != expected:
        raise BatchFailed(f"{contender.label}: {sent} messages sent by {calls} calls")
    if contender.hit and owner is not None and contender.task != ONCE and ids != {owner.id}:
        raise BatchFailed(f"{contender.label}: deduplicated calls returned other ids than {owner}")
    if not contender.hit and len(ids) != calls:
        raise BatchFailed(f"{contender.label}: {len(ids)} distinct task ids from {calls} calls")
    ms = [d / 1e6 for d in durations]
    return {
        "calls": calls,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": total_ns / calls / 1e6,
        "cpu_ms": cpu_ns / calls / 1e6,
        "sent_per_call": sent / calls,
        "zk_requests_per_call": (zk_after - zk_before) / calls,
        "zk_fsyncs_per_call": (fsyncs_after - fsyncs_before) / calls,
        # minus the first INFO, which Redis counts once it answered
        "redis_commands_per_call": (redis_after - redis_before - 1) / calls,
        "zk_nodes_left": zk_nodes,
        "redis_lock_keys": redis_keys,
    }


def _spread(runs: Sequence[dict[str, Any]], name: str) -> dict[str, float]:
    values = [r[name] for r in runs]
    return {"median": median(values), "min": min(values), "max": max(values)}


def run_section(
    zk_server: ZooKeeperServer,
    redis_url: str,
    *,
    calls: int,
    warmup: int,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """Section 6: every contender, ``repeats`` timed batches of ``calls`` calls each."""
    app = create_app(section_settings(zk_server, redis_url, ROOT))
    probes = Probes(app, zk_server.port, redis_url)
    zk = KazooClient(hosts=zk_server.hosts, timeout=30.0)
    zk.start(timeout=60)
    tally = Tally()

    def run(contender: Contender, tag: str, size: int) -> dict[str, Any]:
        return _batch(app, contender, tag, size, probes, zk)

    try:
        probes.purge()
        measured = tally.warm_up(CONTENDERS, app.tasks, run, warmup)
        progress(f"enqueue: warm-up done; measuring {', '.join(c.label for c in measured)}")
        for rep, done in tally.repeat(measured, repeats, run, calls):
            progress(
                f"enqueue: repetition {rep + 1}/{repeats}: p50 "
                + ", ".join(f"{label} {sample['p50_ms']:.3f} ms" for label, sample in done)
            )
    finally:
        probes.close()
        zk.stop()
        zk.close()
        close_clients()  # the app's kazoo session, before this section's ZooKeeper stops
        app.close()
    results: dict[str, dict[str, Any]] = {}
    for contender in CONTENDERS:
        runs = tally.samples.get(contender.label, [])
        ok = tally.status.get(contender.label) == "ok" and len(runs) == repeats
        entry: dict[str, Any] = {
            "status": tally.status.get(contender.label, "not measured"),
            "what": contender.what,
            "package": contender.package,
            "per_repeat": runs,
        }
        for name in FIGURES:
            entry[name] = _spread(runs, name) if ok else None
        for name in PER_CALL_COUNTS:
            entry[name] = median([r[name] for r in runs]) if ok else None
        results[contender.label] = entry
    plain = results["plain"]
    for entry in results.values():
        for name in ("p50_ms", "cpu_ms"):
            ours, base = entry[name], plain[name]
            both = ours is not None and base is not None
            entry[f"{name}_over_plain"] = ours["median"] - base["median"] if both else None
            entry[f"{name}_vs_plain"] = ratio(
                ours["median"] if ours else None, base["median"] if base else None
            )
    return {
        "config": {
            "calls": calls,
            "warmup": warmup,
            "repeats": repeats,
            "caller": "one process, one thread, sequential calls; no worker (messages purged)",
            "zookeeper_ttl_nodes": False,
        },
        "results": results,
    }


def contenders() -> Sequence[str]:
    return [c.label for c in CONTENDERS]
