"""Section 7 of ``python -m benchmarks``: the CPU the task layer adds over the recipe's own cycle.

A locked task call in a worker is the recipe's acquire and release plus the task layer around
them (options, key, identity, policy, interruption, events). This section times, in one process,
the CPU per call (``time.process_time``: all threads, kazoo's included) of four contenders on
one client, ZooKeeper pinned to one CPU and this process to the other:

- ``recipe``: a write-side ``Mutex`` acquire (try-lock) and release on a fresh key shaped like a
  task's, with a node payload of the same size as a task's identity;
- ``zklock``: a ``ZkLockTask`` no-op on a fresh key, called as a prefork worker calls it (Celery's
  worker optimisations installed, the worker's request pushed, ``__call__`` then the body);
- ``plain``: a plain no-op task called the same way (a worker calls its ``run`` directly);
- ``recipe+plain``: the ``recipe`` cycle, then the ``plain`` call: what a call costs without the
  task layer, Celery's part (the request, the call) run as cold as in ``zklock``.

The task layer is ``zklock - (recipe+plain)``, paired per repetition; ``zklock - recipe`` (which
also counts Celery's part of the call) is reported beside it. How it is measured and why:
``docs/benchmarks.md``, section 7.

``--contenders`` (:mod:`benchmarks.variants`) adds nothing here: its one variant, ``control``,
is a section-4 worker.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery import Celery, Task
from celery.app.task import Context
from celery.app.trace import reset_worker_optimizations, setup_worker_optimizations

from benchmarks import variants
from benchmarks.common import (
    Progress,
    mntr,
    paired,
    pin_process,
    rotated,
    spread,
    taskset_unavailable,
    thread_affinities,
)
from celery_zklock import Mutex, ZkLockTask
from celery_zklock.locks.contenders import WRITE
from celery_zklock.locks.identity import identity
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.zk.client import close_clients, get_client
from celery_zklock.zk.settings import settings_of

#: The most CPU the task layer may add per call over the recipe's own cycle (ms, median).
TARGET_TASK_LAYER_MS = 0.05
#: ZooKeeper's CPU, and this process's (its threads inherit it).
ZK_CPU, CALLER_CPU = 0, 1
CONTENDERS = ("recipe", "zklock", "plain", "recipe+plain")
LOCKED_TASK = "bench.task_layer.locked"
PLAIN_TASK = "bench.task_layer.plain"

Call = Callable[[int], None]


def _noop(self: Task, n: int) -> int:
    return n


def _app(zk: ZooKeeperServer) -> Celery:
    app = Celery("bench-task-layer", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = zk.hosts
    app.conf.task_ignore_result = True
    app.task(name=LOCKED_TASK, base=ZkLockTask, bind=True, shared=False)(_noop)
    app.task(name=PLAIN_TASK, bind=True, shared=False)(_noop)
    return app


def _worker_request(task_id: str, n: int) -> dict[str, Any]:
    """The fields a worker's request carries for a task sent with ``delay(n)``."""
    return {
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "hostname": "bench@task-layer",
        "delivery_info": {
            "exchange": "",
            "routing_key": "celery",
            "priority": 0,
            "redelivered": False,
        },
        "reply_to": str(uuid.uuid4()),
        "correlation_id": task_id,
        "args": (n,),
        "kwargs": {},
    }


def _as_worker(task: Task) -> Call:
    """Calls ``task`` the way Celery's tracer does in a worker (``celery.app.trace``)."""
    stack = task.request_stack
    # The tracer calls __call__ only when a task class defines its own (ZkLockTask does).
    fun = task if type(task).__call__ is not Task.__call__ else task.run

    def call(n: int) -> None:
        task_id = str(uuid.uuid4())
        stack.push(
            Context(_worker_request(task_id, n), args=(n,), kwargs={}, called_directly=False)
        )
        try:
            fun(n)
        finally:
            stack.pop()

    return call


def _recipe(app: Celery, payload: bytes) -> Call:
    client = get_client(settings_of(app).client)
    root = f"{settings_of(app).root}/bench.task_layer.recipe"

    def call(n: int) -> None:
        # A key as long as a task's (`n=<n>~<32 hex>`), never used before.
        lease = Mutex(client, f"{root}/n={n}~{n:032x}", kind=WRITE).acquire(
            blocking=False, data=payload
        )
        if lease is None:
            raise RuntimeError("an uncontended fresh key was busy")
        lease.release()

    return call


def _both(first: Call, then: Call) -> Call:
    """Calls ``first`` then ``then`` with the same number."""

    def call(n: int) -> None:
        first(n)
        then(n)

    return call


@contextmanager
def _pinned(zk: ZooKeeperServer) -> Iterator[dict[str, Any]]:
    """ZooKeeper on :data:`ZK_CPU`, this thread (and the threads it starts) on
    :data:`CALLER_CPU`; the layout, with the reason when pinning is not possible."""
    layout: dict[str, Any] = {"pinned": False}
    reason = taskset_unavailable(2)
    before = os.sched_getaffinity(0)
    if reason is None and zk.pid is not None:
        try:
            layout["commands"] = [pin_process(zk.pid, [ZK_CPU])]
            os.sched_setaffinity(0, {CALLER_CPU})
            layout.update(pinned=True, zk_cpu=ZK_CPU, caller_cpu=CALLER_CPU)
        except (RuntimeError, OSError) as exc:
            reason = str(exc)
    if reason is not None:
        layout["reason"] = f"not pinned: {reason}"
    try:
        yield layout
    finally:
        os.sched_setaffinity(0, before)


def _measure(call: Call, numbers: Iterator[int], calls: int, zk_port: int) -> dict[str, float]:
    gc.collect()
    packets_before = int(mntr(zk_port)["zk_packets_received"])
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call(next(numbers))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    # The mntr request itself is one packet.
    packets = int(mntr(zk_port)["zk_packets_received"]) - packets_before - 1
    return {
        "cpu_ms": cpu / calls * 1e3,
        "wall_ms": wall / calls * 1e3,
        "zk_requests": packets / calls,
    }


def run_section(
    zk: ZooKeeperServer,
    *,
    calls: int,
    warmup: int,
    repeats: int,
    progress: Progress,
    variant_names: Sequence[str] = (),
) -> dict[str, Any]:
    """Time the four contenders interleaved in an order rotated per repetition
    (``variant_names``, :mod:`benchmarks.variants`, are checked; none adds one here)."""
    variants.check(list(variant_names))
    contenders = CONTENDERS
    app = _app(zk)
    setup_worker_optimizations(app, hostname="bench@task-layer")
    numbers = itertools.count()  # every call of every contender takes a key never used
    try:
        with _pinned(zk) as layout:
            close_clients()  # the client's threads start on the caller's CPU
            locked, plain = app.tasks[LOCKED_TASK], app.tasks[PLAIN_TASK]
            probe = Context(_worker_request(str(uuid.uuid4()), 0), called_directly=False)
            recipe, plain_call = _recipe(app, identity(locked, probe)), _as_worker(plain)
            cases: dict[str, Call] = {
                "recipe": recipe,
                "zklock": _as_worker(locked),
                "plain": plain_call,
                "recipe+plain": _both(recipe, plain_call),
            }

            for call in cases.values():
                for _ in range(warmup):
                    call(next(numbers))
            if layout["pinned"]:
                layout["caller_thread_cpus"] = sorted(
                    sorted(cpus) for cpus in thread_affinities(os.getpid())
                )
            figures: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            for rep in range(repeats):
                for name in rotated(contenders, rep):
                    figures[name].append(_measure(cases[name], numbers, calls, zk.port))
                cpu = ", ".join(f"{n} {figures[n][-1]['cpu_ms']:.3f} ms" for n in contenders)
                progress(f"task layer rep {rep + 1}: CPU per call {cpu}")
    finally:
        close_clients()
        reset_worker_optimizations(app)

    def series(name: str, figure: str) -> list[float]:
        return [rep[figure] for rep in figures[name]]

    results = {
        name: {
            "cpu_ms_per_call": spread(series(name, "cpu_ms")),
            "wall_ms_per_call": spread(series(name, "wall_ms")),
            "zk_requests_per_call": spread(series(name, "zk_requests")),
            "per_repetition": figures[name],
        }
        for name in contenders
    }
    return {
        "config": {
            "calls": calls,
            "warmup": warmup,
            "repeats": repeats,
            "layout": layout,
        },
        "results": results,
        "task_layer_cpu_ms": paired(
            series("zklock", "cpu_ms"), series("recipe+plain", "cpu_ms"), lambda a, b: a - b
        ),
        "task_layer_wall_ms": paired(
            series("zklock", "wall_ms"), series("recipe+plain", "wall_ms"), lambda a, b: a - b
        ),
        "over_recipe_cpu_ms": paired(
            series("zklock", "cpu_ms"), series("recipe", "cpu_ms"), lambda a, b: a - b
        ),
    }
