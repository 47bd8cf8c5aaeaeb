"""Section 4 of ``python -m benchmarks``: task-level speed on one real worker laid out as in
production, plain vs ZkLockTask vs celery-singleton and celery-once.

ZooKeeper runs on a CPU of its own, the worker (prefork, concurrency 2) and Redis on the other.
For each batch the publisher sends every task to a new queue the worker does not consume yet,
then tells the worker to consume it (``add_consumer``) and waits: throughput is the worker's
drain rate. Per batch: tasks/s, the worker's CPU per task (its process tree, /proc), and each
task's span in the worker from ``task_prerun`` to ``task_postrun`` (:mod:`benchmarks.celery_app`).
Method: ``docs/benchmarks.md``, section 4.

``--contenders`` (:mod:`benchmarks.variants`) adds ``zklock-skip/<variant>`` for each variant
named (``zklock-wait/<variant>`` for one of the wait path): the same task on a worker of its own
started the same way with the variant applied
(``celery -A benchmarks.variants:app``), its batches interleaved with the others'. Only one
worker consumes at a time; the others sit idle on the idle queue.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import ResultSet

from benchmarks import variants
from benchmarks.celery_app import (
    CPU_BODY_S,
    CPU_PLAIN,
    CPU_ZKLOCK_SKIP,
    ONCE,
    PLAIN,
    QUEUE_PREFIX,
    SINGLETON,
    SLEEP_BODY_S,
    SLEEP_PLAIN,
    SPANS_PREFIX,
    ZKLOCK_SHARED,
    ZKLOCK_SKIP,
    ZKLOCK_WAIT,
    create_app,
)
from benchmarks.common import (
    ZK_WARMUP_REQUESTS,
    Progress,
    cpu_snapshot,
    cpu_used,
    mntr,
    paired,
    percentile,
    pin_process,
    spread,
    taskset_unavailable,
    thread_affinities,
    warm_zookeeper,
)
from benchmarks.contenders import Contender, Tally, section_settings
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.testing.celery_worker import CeleryWorker, celery_command, wait_until_answering
from celery_zklock.testing.processes import make_temp_dir, remove_temp_dir
from celery_zklock.zk.client import close_clients
from workers.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent

CONTENDERS: tuple[Contender, ...] = (
    Contender("plain", PLAIN, "celery", "plain no-op task", baseline=None),
    Contender(
        "plain-sleep",
        SLEEP_PLAIN,
        "celery",
        f"plain task, body sleeps {SLEEP_BODY_S * 1000:g} ms (as long as a locked no-op, unlocked)",
    ),
    Contender("zklock-skip", ZKLOCK_SKIP, "celery-zklock", 'ZkLockTask, lock_on_busy="skip"'),
    Contender("zklock-wait", ZKLOCK_WAIT, "celery-zklock", 'ZkLockTask, lock_on_busy="wait"'),
    Contender(
        "zklock-shared",
        ZKLOCK_SHARED,
        "celery-zklock",
        'ZkLockTask, lock_mode="shared", one key for all (each task a reader)',
    ),
    Contender("celery-singleton", SINGLETON, "celery-singleton", "Singleton (Redis lock)"),
    Contender("celery-once", ONCE, "celery-once", "QueueOnce (Redis lock)"),
    Contender(
        "cpu5-plain",
        CPU_PLAIN,
        "celery",
        f"plain task, body burns {CPU_BODY_S * 1000:g} ms CPU",
        baseline=None,
    ),
    Contender(
        "cpu5-zklock-skip",
        CPU_ZKLOCK_SKIP,
        "celery-zklock",
        f"ZkLockTask skip, body burns {CPU_BODY_S * 1000:g} ms CPU",
        baseline="cpu5-plain",
    ),
)
POOL = "prefork"
CONCURRENCY = 2
#: The queue the worker consumes between batches; nothing is ever sent to it.
IDLE_QUEUE = f"{QUEUE_PREFIX}idle"
WORKER_READY_TIMEOUT_S = 120.0
CONTROL_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.02
#: Seconds of idle CPU measured after the warm-up.
IDLE_SECONDS = 3.0

# Targets (checked on the medians by benchmarks.report).
#: zklock-skip no-op throughput over plain's.
TARGET_VS_PLAIN = 0.6
#: Worker CPU (ms) a locked no-op task may add over a plain one.
TARGET_CPU_ADDED_MS = 0.6
#: cpu5-zklock-skip throughput over cpu5-plain's.
TARGET_CPU_TASK_VS_PLAIN = 0.9

#: Figures per repetition that the report gives as median and spread.
FIGURES = (
    "tasks_per_s",
    "cpu_ms_per_task",
    "span_p50_ms",
    "span_p99_ms",
    "zk_cpu_ms_per_task",
    "redis_cpu_ms_per_task",
    "zk_fsyncs_per_task",
    "zk_fsync_mean_ms",
)


class BatchFailed(RuntimeError):
    pass


@dataclass
class Bench:
    """What a batch needs: the publishing app, the worker, the servers' pids, a Redis client."""

    app: Celery
    worker: CeleryWorker
    redis: redis.Redis
    zk_pid: int | None
    redis_pid: int | None
    zk_port: int | None = None

    def fsyncs(self) -> tuple[int, float] | None:
        """ZooKeeper's transaction-log fsyncs so far and their total ms (``mntr``), or None."""
        if self.zk_port is None:
            return None
        values = mntr(self.zk_port)
        try:
            return int(values["zk_cnt_fsynctime"]), float(values["zk_sum_fsynctime"])
        except (KeyError, ValueError):
            return None


# ------------------------------------------------------------------------------------ layout


def _layout(zk_pid: int | None, redis_pid: int | None) -> dict[str, Any]:
    """Pin ZooKeeper (every JVM thread) to the first allowed CPU and Redis to the second; the
    worker is started under ``taskset`` on the second. Returns the layout for the config, with
    what Redis's affinity was (restored by :func:`_restore`)."""
    allowed = sorted(os.sched_getaffinity(0))
    layout: dict[str, Any] = {
        "pinned": False,
        "cpus_available": allowed,
        "publisher": "unpinned (this process; it only polls Redis while the worker drains)",
    }
    reason = taskset_unavailable(2)
    if reason is None and (zk_pid is None or redis_pid is None):
        reason = "the ZooKeeper or Redis process id is unknown"
    if reason is not None:
        layout["reason"] = f"not pinned: {reason}"
        return layout
    assert zk_pid is not None and redis_pid is not None
    zk_cpu, worker_cpu = allowed[0], allowed[1]
    layout["redis_affinity_before"] = sorted(os.sched_getaffinity(redis_pid))
    try:
        commands = [pin_process(zk_pid, [zk_cpu]), pin_process(redis_pid, [worker_cpu])]
    except (OSError, RuntimeError) as exc:
        _restore(layout, redis_pid)
        layout["reason"] = f"not pinned: {exc}"
        return layout
    layout.update(
        pinned=True,
        zookeeper_cpu=zk_cpu,
        worker_cpu=worker_cpu,
        redis_cpu=worker_cpu,
        commands=[*commands, f"taskset -c {worker_cpu} python -m celery ... worker"],
    )
    return layout


def _restore(layout: dict[str, Any], redis_pid: int | None) -> None:
    """Give Redis (shared with the other sections) back its affinity."""
    before = layout.get("redis_affinity_before")
    if before and redis_pid is not None:
        with suppress(OSError, RuntimeError):
            pin_process(redis_pid, before)


def _start_worker(
    settings: Settings, log_dir: Path, layout: dict[str, Any], variant: str | None = None
) -> CeleryWorker:
    app = variants.WORKER_APP if variant else "benchmarks.celery_app:app"
    command = celery_command(app, POOL, CONCURRENCY, loglevel="warning")
    if layout["pinned"]:
        # taskset execs the worker: same pid, and the pool processes inherit the CPU.
        command = ["taskset", "-c", str(layout["worker_cpu"]), *command]
    env = settings.to_env()
    if variant:
        env[variants.VARIANT_ENV] = variant
    worker = CeleryWorker(
        command,
        nodename=f"bench-{variant or 'main'}-{uuid.uuid4().hex[:8]}@%h",
        log_path=log_dir / f"worker-{variant or 'main'}.log",
        queues=[IDLE_QUEUE],
        cwd=REPO_ROOT,
        env=env,
    )
    worker.spawn()
    return worker


def _worker_affinity(worker: CeleryWorker) -> dict[str, Any]:
    """The CPUs every thread of the worker's processes may run on (a check of the pinning)."""
    pids = sorted(worker.process_ids())
    sets = {cpus for pid in pids for cpus in thread_affinities(pid)}
    return {"processes": len(pids), "cpu_sets": sorted(sorted(s) for s in sets)}


# ------------------------------------------------------------------------------------ a batch


def _control(bench: Bench, command: str, queue: str) -> None:
    """``add_consumer`` / ``cancel_consumer`` of ``queue`` on our worker, waiting for its reply."""
    method = getattr(bench.app.control, command)
    replies = method(
        queue, destination=[bench.worker.nodename], reply=True, timeout=CONTROL_TIMEOUT_S
    )
    answer = next(
        (r[bench.worker.nodename] for r in replies or [] if bench.worker.nodename in r), None
    )
    if not answer or "ok" not in answer:
        raise BatchFailed(f"{command} {queue}: the worker answered {replies!r}")


def _batch(bench: Bench, contender: Contender, tag: str, count: int) -> dict[str, Any]:
    """Publish ``count`` tasks to a new queue, let the worker drain it, measure."""
    queue = f"{QUEUE_PREFIX}{tag}-{uuid.uuid4().hex[:6]}"
    spans_key = SPANS_PREFIX + queue
    task = bench.app.tasks[contender.task]
    sent = time.monotonic()
    results = [task.apply_async((f"{tag}-{i}",), queue=queue) for i in range(count)]
    publish_s = time.monotonic() - sent
    fsyncs_before = bench.fsyncs()
    worker_pids = bench.worker.process_ids()
    servers = [pid for pid in (bench.zk_pid, bench.redis_pid) if pid is not None]
    before = cpu_snapshot(worker_pids)
    servers_before = cpu_snapshot(servers)
    started = time.monotonic()
    _control(bench, "add_consumer", queue)
    deadline = started + 60.0 + count * 0.2
    while int(bench.redis.llen(spans_key)) < count:
        if time.monotonic() > deadline:
            raise BatchFailed(
                f"{contender.label}: {bench.redis.llen(spans_key)} of {count} tasks ran within "
                f"{deadline - started:.0f} s; worker log:\n{bench.worker.log_tail(20)}"
            )
        time.sleep(POLL_INTERVAL_S)
    after = cpu_snapshot(bench.worker.process_ids())
    servers_after = cpu_snapshot(servers)
    fsyncs_after = bench.fsyncs()
    _control(bench, "cancel_consumer", queue)
    raw = bench.redis.lrange(spans_key, 0, -1)
    bench.redis.delete(spans_key, f"_kombu.binding.{queue}")
    spans = [json.loads(item) for item in raw]
    values = ResultSet(results, app=bench.app).join_native(timeout=120, propagate=False)
    failures = [v for v in values if isinstance(v, BaseException)]
    if failures:
        raise BatchFailed(
            f"{len(failures)} of {count} {contender.label} tasks failed: {failures[0]!r}"
        )
    early = sum(1 for begin, _end, _state, _skipped in spans if begin < started)
    if len(spans) != count or early:
        raise BatchFailed(
            f"{contender.label}: {len(spans)} spans for {count} tasks, {early} begun before "
            "the worker was told to consume"
        )
    bad = [state for _b, _e, state, _s in spans if state != "SUCCESS"]
    if bad:
        raise BatchFailed(f"{contender.label}: {len(bad)} tasks ended {bad[0]}")
    first = min(begin for begin, _end, _state, _skipped in spans)
    last = max(end for _begin, end, _state, _skipped in spans)
    durations = [(end - begin) * 1000.0 for begin, end, _state, _skipped in spans]
    worker_cpu = cpu_used(before, after)
    zk_cpu = cpu_used(
        {p: v for p, v in servers_before.items() if p == bench.zk_pid},
        {p: v for p, v in servers_after.items() if p == bench.zk_pid},
    )
    redis_cpu = cpu_used(
        {p: v for p, v in servers_before.items() if p == bench.redis_pid},
        {p: v for p, v in servers_after.items() if p == bench.redis_pid},
    )
    fsync_count = fsync_ms = None
    if fsyncs_before is not None and fsyncs_after is not None:
        fsync_count = fsyncs_after[0] - fsyncs_before[0]
        fsync_ms = fsyncs_after[1] - fsyncs_before[1]
    return {
        "tasks": count,
        "publish_s": publish_s,
        "drain_s": last - first,
        "consume_delay_ms": (first - started) * 1000.0,
        "tasks_per_s": count / (last - first),
        "cpu_ms_per_task": worker_cpu * 1000.0 / count,
        "zk_cpu_ms_per_task": zk_cpu * 1000.0 / count if bench.zk_pid else None,
        "redis_cpu_ms_per_task": redis_cpu * 1000.0 / count if bench.redis_pid else None,
        "span_p50_ms": percentile(durations, 50),
        "span_p99_ms": percentile(durations, 99),
        "span_mean_ms": sum(durations) / count,
        "zk_fsyncs_per_task": None if fsync_count is None else fsync_count / count,
        "zk_fsync_mean_ms": fsync_ms / fsync_count
        if fsync_ms is not None and fsync_count
        else None,
        "skipped": sum(1 for _b, _e, _s, skipped in spans if skipped),
        "worker_processes": len(after),
        "worker_processes_changed": set(before) != set(after),
    }


def _idle_cpu(bench: Bench, seconds: float) -> dict[str, float | None]:
    """CPU ms per second the worker tree, ZooKeeper and Redis use while no task runs: what a
    batch's window holds besides its tasks (the worker takes up a queue within ~1 s)."""
    pids = {
        "worker": sorted(bench.worker.process_ids()),
        "zookeeper": [bench.zk_pid] if bench.zk_pid else [],
        "redis": [bench.redis_pid] if bench.redis_pid else [],
    }
    before = {name: cpu_snapshot(found) for name, found in pids.items()}
    time.sleep(seconds)
    after = {name: cpu_snapshot(found) for name, found in pids.items()}
    return {
        f"{name}_ms_per_s": cpu_used(before[name], after[name]) * 1000.0 / seconds
        if pids[name]
        else None
        for name in pids
    }


# ------------------------------------------------------------------------------------ section


def run_section(
    zk_server: ZooKeeperServer,
    redis_url: str,
    *,
    batch: int,
    warmup: int,
    repeats: int,
    progress: Progress,
    variant_names: Sequence[str] = (),
) -> dict[str, Any]:
    """Section 4: one pinned worker, every contender, ``repeats`` batches each, rotated; one
    more worker per name in ``variant_names`` (:mod:`benchmarks.variants`) for its contender."""
    policies = {
        name: "wait" if name in variants.ON_WAIT_TASK else "skip"
        for name in variants.check(list(variant_names))
    }
    extra = {f"zklock-{policy}/{name}": name for name, policy in policies.items()}
    contenders = CONTENDERS + tuple(
        Contender(
            label,
            ZKLOCK_WAIT if policies[name] == "wait" else ZKLOCK_SKIP,
            "celery-zklock",
            f'ZkLockTask, lock_on_busy="{policies[name]}", {variants.VARIANTS[name]}',
        )
        for label, name in extra.items()
    )
    settings = section_settings(
        zk_server, redis_url, "/bench-celery", pool=POOL, concurrency=CONCURRENCY
    )
    app = create_app(settings)
    client = redis.Redis.from_url(redis_url)
    redis_pid = int(client.info("server")["process_id"])
    zk_pid = zk_server.pid
    layout = _layout(zk_pid, redis_pid)
    progress(
        "celery: "
        + (
            f"ZooKeeper on CPU {layout['zookeeper_cpu']}, worker and Redis on CPU "
            f"{layout['worker_cpu']}"
            if layout["pinned"]
            else layout["reason"]
        )
    )
    warmed_s = warm_zookeeper(zk_server.hosts)
    progress(f"celery: ZooKeeper warmed with {ZK_WARMUP_REQUESTS} requests in {warmed_s:.1f} s")
    log_dir = make_temp_dir("zklock-bench-celery-")
    worker: CeleryWorker | None = None
    variant_workers: dict[str, CeleryWorker] = {}
    tally = Tally()
    idle: dict[str, float | None] = {}
    try:
        worker = _start_worker(settings, log_dir, layout)
        for label, name in extra.items():
            variant_workers[label] = _start_worker(settings, log_dir, layout, name)
        started = time.monotonic()
        wait_until_answering(app, [worker, *variant_workers.values()], WORKER_READY_TIMEOUT_S)
        progress(f"celery: worker ready in {time.monotonic() - started:.1f} s")
        bench = Bench(app, worker, client, zk_pid, redis_pid, zk_server.port)
        benches = {label: replace(bench, worker=w) for label, w in variant_workers.items()}

        def run(contender: Contender, tag: str, size: int) -> dict[str, Any]:
            return _batch(benches.get(contender.label, bench), contender, tag, size)

        measured = tally.warm_up(contenders, app.tasks, run, warmup)
        layout["worker_affinity"] = _worker_affinity(worker)
        idle = _idle_cpu(bench, IDLE_SECONDS)
        progress(f"celery: warm-up done; measuring {', '.join(c.label for c in measured)}")
        for rep, done in tally.repeat(measured, repeats, run, batch):
            progress(
                f"celery: repetition {rep + 1}/{repeats}: "
                + ", ".join(
                    f"{label} {sample['tasks_per_s']:.0f}/s {sample['cpu_ms_per_task']:.2f} ms CPU"
                    for label, sample in done
                )
            )
    finally:
        for stopping in [worker, *variant_workers.values()]:
            if stopping is not None:
                stopping.stop(grace=10.0)
        _restore(layout, redis_pid)
        remove_temp_dir(log_dir)
        close_clients()
        client.close()
        app.close()
    results = _summarise(tally, repeats, contenders)
    return {
        "config": {
            "batch": batch,
            "warmup": warmup,
            "zookeeper_warmup": f"{ZK_WARMUP_REQUESTS} requests of a locked task's kind before "
            "the worker starts (benchmarks.common.warm_zookeeper), untimed",
            "repeats": repeats,
            "worker": f"1 celery worker, {POOL} pool, concurrency {CONCURRENCY}, the fleet's "
            "settings (prefetch 1, late acks, track started, Redis broker and backend), "
            "log level warning, no max tasks per child",
            "keys": "distinct per task (a lock is never busy); zklock-shared: one key, readers",
            "layout": layout,
            "publishing": "each batch to a new queue the worker does not consume; then "
            "add_consumer (reply awaited) starts the drain; cancel_consumer after",
            "tasks_per_s": "batch / (last task's postrun - first task's prerun): the worker "
            "takes up a new queue at its next BRPOP (kombu polls with a 1 s BRPOP), so the "
            "clock starts when the first task starts",
            "span": "task_prerun -> task_postrun in the pool process (lock acquire, body, "
            "release, result store, on_success/after_return)",
            "cpu": "utime+stime from /proc/<pid>/stat of the worker's process tree (main and "
            "pool processes), ZooKeeper's JVM and Redis, from before add_consumer to after the "
            "last span arrived, per task",
            "cpu_body_ms": CPU_BODY_S * 1000.0,
            "idle_cpu": idle,
        },
        "results": results,
    }


def _summarise(
    tally: Tally, repeats: int, contenders: Sequence[Contender] = CONTENDERS
) -> dict[str, dict[str, Any]]:
    """Median and spread of every figure; ratios and differences to the baseline per
    repetition (the two contenders' batches of the same repetition)."""
    results: dict[str, dict[str, Any]] = {}
    complete: dict[str, list[dict[str, Any]]] = {}
    for contender in contenders:
        runs = tally.samples.get(contender.label, [])
        ok = tally.status.get(contender.label) == "ok" and len(runs) == repeats
        if ok:
            complete[contender.label] = runs
        changed = sum(1 for r in runs if r["worker_processes_changed"])
        state = tally.status.get(contender.label, "not measured")
        if changed:  # a pool process replaced mid-batch: its CPU is missing from that batch
            state += f"; worker process tree changed in {changed} batch(es)"
        entry: dict[str, Any] = {
            "status": state,
            "what": contender.what,
            "package": contender.package,
            "baseline": contender.baseline,
            "skipped": sum(r["skipped"] for r in runs),
            "per_repeat": runs,
        }
        for name in FIGURES:
            values = [r[name] for r in runs]
            entry[name] = spread(values) if ok and None not in values else None
        results[contender.label] = entry
    for contender in contenders:
        entry = results[contender.label]
        ours = complete.get(contender.label)
        base = complete.get(contender.baseline) if contender.baseline else None
        for name, figure, combine in (
            ("vs_baseline", "tasks_per_s", _ratio),
            ("cpu_ms_added", "cpu_ms_per_task", _difference),
            ("span_p50_added_ms", "span_p50_ms", _difference),
            ("span_p99_added_ms", "span_p99_ms", _difference),
        ):
            entry[name] = (
                paired([r[figure] for r in ours], [r[figure] for r in base], combine)
                if ours is not None and base is not None
                else None
            )
    return results


def _ratio(value: float, base: float) -> float | None:
    return value / base if base else None


def _difference(value: float, base: float) -> float:
    return value - base


def contenders() -> Sequence[str]:
    return [c.label for c in CONTENDERS]
