"""The Celery app of the task-level benchmarks (sections 4 and 6): the fleet's configuration, the
benchmark tasks, and the worker-side timing of each task's run.

A worker runs it as ``celery -A benchmarks.celery_app:app worker`` (launched by
:func:`celery_zklock.testing.celery_worker.celery_command`), configured from the ``ZKLOCK_*``
environment when first needed, as :mod:`workers.app` is. The no-op tasks take one argument
``key``: a plain task (the baseline), :class:`~celery_zklock.ZkLockTask` with ``lock_on_busy``
``skip`` and ``wait`` (keyed by ``key``), ``lock_mode="shared"`` on one key for every call,
``lock_dedupe="queued"`` (a ZooKeeper marker claimed when the task is sent; section 6),
``celery_singleton.Singleton`` and ``celery_once.QueueOnce`` (both take a Redis lock when the
task is sent and release it in the worker). Two more burn 5 ms of CPU in their body, plain and
ZkLockTask (skip). A third-party base that cannot be imported is left out, with the reason in
:data:`UNAVAILABLE`.

The span of a task (section 4): in the worker's pool process, from Celery's ``task_prerun``
signal to its ``task_postrun`` signal (``time.monotonic``, ``CLOCK_MONOTONIC``, one clock for
every process). Between the two Celery runs ``Task.__call__`` (where ``ZkLockTask`` acquires,
runs the body and releases), stores the result and runs ``on_success``/``after_return`` (where
celery-singleton and celery-once release their Redis locks). Our receivers are moved to run
first on prerun and last on postrun, so other receivers' work is inside the span. Each pool
process keeps its spans in memory and a thread of its own pushes them to Redis every
:data:`FLUSH_INTERVAL_S` (one ``RPUSH`` per queue), so recording costs no Redis round trip per
task. Only tasks from queues named ``zklock-bench-...`` are recorded (``SPANS_PREFIX + queue``).
"""

from __future__ import annotations

import json
import threading
import time
from importlib import import_module
from typing import Any, Final

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_process_init

from celery_zklock import ZkLockTask, is_skipped
from celery_zklock.testing import introspect  # noqa: F401  (the zklock_live command: gate_memory)
from workers.app import celery_config
from workers.app import create_app as create_fleet_app
from workers.settings import Settings

PLAIN: Final = "bench.plain"
ZKLOCK_SKIP: Final = "bench.zklock_skip"
ZKLOCK_WAIT: Final = "bench.zklock_wait"
ZKLOCK_SHARED: Final = "bench.zklock_shared"
ZKLOCK_DEDUPE: Final = "bench.zklock_dedupe"
SINGLETON: Final = "bench.singleton"
ONCE: Final = "bench.once"
CPU_PLAIN: Final = "bench.cpu5_plain"
CPU_ZKLOCK_SKIP: Final = "bench.cpu5_zklock_skip"
SLEEP_PLAIN: Final = "bench.sleep_plain"
#: CPU seconds the body of the CPU-bound tasks burns.
CPU_BODY_S: Final = 0.005
#: Seconds the body of SLEEP_PLAIN sleeps: about what a lock adds to a no-op's span in section
#: 4 (3.6 ms at p50 on the machine of 2026-11-29), so that it shows what a task that long costs
#: a worker without a lock.
SLEEP_BODY_S: Final = 0.0036
#: The one key every call of ZKLOCK_SHARED takes (as a reader).
SHARED_KEY: Final = "all"
#: Task name -> why it could not be registered (its package is missing or broken).
UNAVAILABLE: dict[str, str] = {}

#: Queues whose tasks the worker times; their spans go to the Redis list SPANS_PREFIX + queue.
QUEUE_PREFIX: Final = "zklock-bench-"
SPANS_PREFIX: Final = "zklock-bench:spans:"
FLUSH_INTERVAL_S: Final = 0.1


def bench_config(settings: Settings) -> dict[str, Any]:
    """The fleet's Celery configuration plus what celery-singleton and celery-once read."""
    return {
        **celery_config(settings),
        "singleton_backend_url": settings.broker_url,
        "ONCE": {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": settings.broker_url, "default_timeout": 3600},
        },
    }


def noop(key: str) -> None:
    """The body of every plain benchmark task."""
    return None


def noop_bound(self: Any, key: str) -> None:
    """The body of the bound (ZkLockTask) benchmark tasks."""
    return None


def burn_cpu(key: str) -> None:
    """Burn :data:`CPU_BODY_S` of this thread's CPU time."""
    clock = time.thread_time
    deadline = clock() + CPU_BODY_S
    while clock() < deadline:
        pass


def burn_cpu_bound(self: Any, key: str) -> None:
    burn_cpu(key)


def sleep_body(key: str) -> None:
    """Sleep :data:`SLEEP_BODY_S`: a plain task as long in the pool as a locked no-op."""
    time.sleep(SLEEP_BODY_S)


def register_tasks(app: Celery) -> None:
    app.task(name=PLAIN, shared=False)(noop)
    app.task(name=CPU_PLAIN, shared=False)(burn_cpu)
    app.task(name=SLEEP_PLAIN, shared=False)(sleep_body)
    locked: dict[str, Any] = {
        "bind": True,
        "base": ZkLockTask,
        "shared": False,
        "lock_key": ["key"],
        "lock_mode": "exclusive",
    }
    app.task(name=ZKLOCK_SKIP, lock_on_busy="skip", **locked)(noop_bound)
    app.task(name=ZKLOCK_WAIT, lock_on_busy="wait", lock_timeout=30.0, **locked)(noop_bound)
    app.task(name=ZKLOCK_DEDUPE, lock_on_busy="skip", lock_dedupe="queued", **locked)(noop_bound)
    app.task(name=CPU_ZKLOCK_SKIP, lock_on_busy="skip", **locked)(burn_cpu_bound)
    # Every call a reader of one key: readers never wait for each other.
    app.task(
        name=ZKLOCK_SHARED,
        bind=True,
        base=ZkLockTask,
        shared=False,
        lock_key=lambda key: SHARED_KEY,
        lock_mode="shared",
        lock_on_busy="skip",
    )(noop_bound)
    # Imported by name: both packages are optional (the bench extra) and untyped.
    try:
        singleton = import_module("celery_singleton").Singleton
        app.task(name=SINGLETON, base=singleton, shared=False)(noop)
    except Exception as exc:
        UNAVAILABLE[SINGLETON] = f"celery-singleton: {type(exc).__name__}: {exc}"
    try:
        queue_once = import_module("celery_once").QueueOnce
        app.task(name=ONCE, base=queue_once, shared=False)(noop)
    except Exception as exc:
        UNAVAILABLE[ONCE] = f"celery-once: {type(exc).__name__}: {exc}"


def create_app(settings: Settings | None = None) -> Celery:
    """The benchmark app, made as :func:`workers.app.create_app` makes the fleet's."""
    return create_fleet_app(settings, main="benchmarks", config=bench_config, tasks=register_tasks)


app = create_app()


# ------------------------------------------------------------------- spans, in the pool process


class SpanRecorder:
    """The spans of this pool process's tasks, pushed to Redis by a thread of their own."""

    def __init__(self) -> None:
        self.started: dict[str, tuple[float, str]] = {}
        self.pending: list[tuple[str, str]] = []
        self.guard = threading.Lock()
        self.thread: threading.Thread | None = None

    def begin(self, task_id: str, queue: str) -> None:
        self.started[task_id] = (time.monotonic(), queue)

    def end(self, task_id: str, state: str | None, retval: Any) -> None:
        ended = time.monotonic()
        begun = self.started.pop(task_id, None)
        if begun is None:
            return
        started, queue = begun
        record = json.dumps(
            [started, ended, state, bool(is_skipped(retval))], separators=(",", ":")
        )
        with self.guard:
            self.pending.append((queue, record))

    def start_flushing(self, redis_url: str) -> None:
        if self.thread is not None:
            return
        self.thread = threading.Thread(
            target=self._flush_forever, args=(redis_url,), name="bench-spans", daemon=True
        )
        self.thread.start()

    def _flush_forever(self, redis_url: str) -> None:
        import redis  # the worker has it (the broker's transport)

        client = redis.Redis.from_url(redis_url)
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            with self.guard:
                batch, self.pending = self.pending, []
            if not batch:
                continue
            by_queue: dict[str, list[str]] = {}
            for queue, record in batch:
                by_queue.setdefault(queue, []).append(record)
            pipe = client.pipeline(transaction=False)
            for queue, records in by_queue.items():
                pipe.rpush(SPANS_PREFIX + queue, *records)
            pipe.execute()


_recorder = SpanRecorder()


def _queue_of(task: Any) -> str | None:
    request = getattr(task, "request", None)
    info = getattr(request, "delivery_info", None) or {}
    queue = info.get("routing_key")
    return queue if isinstance(queue, str) and queue.startswith(QUEUE_PREFIX) else None


def _on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    queue = _queue_of(task)
    if task_id is not None and queue is not None:
        _recorder.begin(task_id, queue)


def _on_postrun(
    task_id: str | None = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    if task_id is not None:
        _recorder.end(task_id, state, retval)


def _reorder(signal: Any, receiver: Any, *, first: bool) -> None:
    """Move ``receiver`` to the front (``first``) or the back of ``signal``'s receivers, so the
    span holds every other receiver's work. Best effort: Celery's Signal keeps a list of
    ``(lookup key, reference)`` pairs and a per-sender cache."""
    receivers = getattr(signal, "receivers", None)
    if not isinstance(receivers, list):
        return
    with getattr(signal, "lock", threading.Lock()):
        ours = [entry for entry in receivers if _resolves_to(entry, receiver)]
        others = [entry for entry in receivers if not _resolves_to(entry, receiver)]
        receivers[:] = ours + others if first else others + ours
        cache = getattr(signal, "sender_receivers_cache", None)
        if cache is not None and hasattr(cache, "clear"):
            cache.clear()


def _resolves_to(entry: Any, receiver: Any) -> bool:
    """Whether a receivers entry is ``receiver`` (connected with ``weak=False``: no weakref)."""
    try:
        return bool(entry[1] is receiver)
    except (TypeError, IndexError):
        return False


def _on_process_init(**_: Any) -> None:
    _reorder(task_prerun, _on_prerun, first=True)
    _reorder(task_postrun, _on_postrun, first=False)
    _recorder.start_flushing(str(app.conf.broker_url))


task_prerun.connect(_on_prerun, weak=False, dispatch_uid="zklock-bench-prerun")
task_postrun.connect(_on_postrun, weak=False, dispatch_uid="zklock-bench-postrun")
worker_process_init.connect(_on_process_init, weak=False, dispatch_uid="zklock-bench-init")
