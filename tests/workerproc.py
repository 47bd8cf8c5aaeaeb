"""Start and stop real `celery worker` subprocesses for the task tests."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from kazoo.client import KazooClient

from celery_zklock.testing.celery_worker import (
    CeleryWorker,
    celery_command,
    stop_all,
    wait_until_answering,
)
from tests.lockutil import children, wait_for

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = {"prefork": 2, "solo": 1, "threads": 4, "gevent": 4}
STOP_GRACE = 15.0


class Worker(CeleryWorker):
    """A `celery worker` of tests.taskapp consuming one queue."""

    @property
    def queue(self) -> str:
        return self.queues[0]

    def stop(self, grace: float = STOP_GRACE) -> None:
        # Pool processes get SIGTERM too: a test ends without waiting for its tasks.
        self.signal_group(signal.SIGTERM)
        super().stop(grace)


def start_worker(
    app: Celery,
    pool: str,
    name: str,
    env: dict[str, str],
    log_dir: Path,
    queue: str = "celery",
    concurrency: int | None = None,
) -> Worker:
    """A worker named ``name@<host>`` that answered a ping (``app`` is any app on its broker)."""
    log = log_dir / f"worker-{name}.log"
    log.unlink(missing_ok=True)
    command = celery_command("tests.taskapp", pool, concurrency or CONCURRENCY[pool])
    worker = Worker(command, nodename=f"{name}@%h", queues=[queue], log_path=log, cwd=ROOT, env=env)
    worker.spawn()
    try:
        wait_until_answering(app, [worker], timeout=30)
    except BaseException:
        worker.stop()
        raise
    return worker


@contextmanager
def workers(
    app: Celery,
    pool: str,
    count: int,
    env: dict[str, str],
    log_dir: Path,
    prefix: str = "w",
    queues: list[str] | None = None,
) -> Iterator[list[Worker]]:
    """``count`` workers of ``pool``; worker i consumes ``queues[i]`` (default ``q<i>``)."""
    started: list[Worker] = []
    try:
        for i in range(count):
            queue = queues[i] if queues else f"q{i}"
            started.append(
                start_worker(app, pool, f"{prefix}{i}-{pool}", env, log_dir, queue=queue)
            )
        yield started
    finally:
        stop_all(started, STOP_GRACE)


def contenders(zk: KazooClient, lock: str) -> list[str]:
    """Contender nodes left under every key of lock name ``lock`` (``/taskapp/<lock>``)."""
    parent = f"/taskapp/{lock}"
    return [node for key in children(zk, parent) for node in children(zk, f"{parent}/{key}")]


def held_session(tmp: Path, task_id: str) -> dict[str, Any]:
    """What ``long_hold`` recorded once it held its lock (session, pid, token)."""
    record_file = tmp / f"session-{task_id}"
    wait_for(record_file.exists, 30, "the task to hold its lock")
    return json.loads(record_file.read_text())  # type: ignore[no-any-return]


def held_at_gates(app: Celery) -> int:
    """Messages held at every worker's gate (the workers' own count, asked by broadcast)."""
    from celery_zklock.worker.gate.step import held_messages

    return sum(held.count for held in held_messages(app, timeout=1.0))
