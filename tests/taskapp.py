"""The Celery app that `celery worker` subprocesses run in the task tests.

Configured from the environment the test sets: TASKAPP_BROKER (Redis URL), ZKLOCK_HOSTS,
ZKLOCK_SESSION_TIMEOUT, TASKAPP_DIR (a directory for witness files and session records).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_zklock import ZkLockTask
from celery_zklock.testing.witness import Witness

app = Celery("taskapp")
app.conf.update(
    broker_url=os.environ.get("TASKAPP_BROKER", "redis://127.0.0.1:1/0"),
    result_backend=os.environ.get("TASKAPP_BROKER", "redis://127.0.0.1:1/0"),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    zklock_root="/taskapp",
    broker_connection_retry_on_startup=True,
)
DIR = Path(os.environ.get("TASKAPP_DIR", "/tmp"))


def _section(task: Any, key: str, mode: str, hold_s: float) -> dict[str, Any]:
    lease = task.lock
    witness = Witness(DIR / f"witness-{key}")
    holder = f"{task.request.id}-t{lease.token}"
    with witness.section(holder, "write" if mode == "exclusive" else "read"):
        time.sleep(hold_s)
    return {"token": lease.token, "pid": os.getpid()}


@app.task(bind=True, base=ZkLockTask, lock_name="section", lock_key=["key"], lock_on_busy="skip")
def exclusive_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    return _section(self, key, "exclusive", hold_s)


@app.task(
    bind=True,
    base=ZkLockTask,
    lock_name="section",
    lock_key=["key"],
    lock_mode="shared",
    lock_on_busy="wait",
)
def shared_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    return _section(self, key, "shared", hold_s)


@app.task(bind=True, base=ZkLockTask, lock_name="long", lock_key=["key"], lock_on_busy="wait")
def long_hold(self: Any, key: str, seconds: float) -> str:
    """Records its session (id, password, pid) and then runs until interrupted."""
    client = self.lock._hold.internals.client
    session_id, password = client.client_id
    record = {"session_id": session_id, "password": password.hex(), "pid": os.getpid(),
              "token": self.lock.token}  # fmt: skip
    (DIR / f"session-{self.request.id}").write_text(json.dumps(record))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    return "finished"
