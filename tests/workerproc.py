"""Start and stop real `celery worker` subprocesses for the task tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from celery import Celery
from kazoo.client import KazooClient

from tests.lockutil import wait_for

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = {"prefork": 2, "solo": 1, "threads": 4, "gevent": 4}


class Worker:
    """A `celery worker` subprocess in its own process group."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, queue: str, log: Path) -> None:
        self.proc = proc
        self.name = name
        self.queue = queue
        self.log = log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        # a killed prefork parent can leave children in its group: reap the whole group
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_worker(
    app: Celery,
    pool: str,
    name: str,
    env: dict[str, str],
    log_dir: Path,
    queue: str = "celery",
    concurrency: int | None = None,
) -> Worker:
    log = log_dir / f"worker-{name}.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.taskapp", "worker",
        "-P", pool, "-c", str(concurrency or CONCURRENCY[pool]), "-n", f"{name}@%h", "-Q", queue,
        "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "info",
    ]  # fmt: skip
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    worker = Worker(proc, name, queue, log)
    # Wait for *this* worker's answer: another test's workers may share the broker.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {name} exited {proc.returncode}: {log.read_text()[-2000:]}")
        replies = app.control.ping(timeout=0.5)
        if any(f"{name}@" in host for reply in replies for host in reply):
            return worker
    worker.stop()
    raise RuntimeError(f"worker {name} did not answer a ping in 30 s: {log.read_text()[-2000:]}")


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
        for worker in started:
            worker.stop()


def contenders(zk: KazooClient, lock: str) -> list[str]:
    """Contender nodes left under every key of lock name ``lock`` (``/taskapp/<lock>``)."""
    parent = f"/taskapp/{lock}"
    if not zk.exists(parent):
        return []
    found: list[str] = []
    for key in zk.get_children(parent):
        try:
            found += zk.get_children(f"{parent}/{key}")
        except Exception:  # the key's container was reaped meanwhile
            continue
    return found


def held_session(tmp: Path, task_id: str) -> dict[str, Any]:
    """What ``long_hold`` recorded once it held its lock (session, pid, token)."""
    record_file = tmp / f"session-{task_id}"
    wait_for(record_file.exists, 30, "the task to hold its lock")
    return json.loads(record_file.read_text())  # type: ignore[no-any-return]
