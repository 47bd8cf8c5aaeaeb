"""What a run stores in its contender node: the JSON json.dumps gives, built once per part."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from types import SimpleNamespace
from typing import Any

from celery_zklock.delivery import identity


def expected(task: Any, request: Any, pid: int) -> bytes:
    return json.dumps(
        {
            "task_id": request.id,
            "task": task.name,
            "retries": int(request.retries or 0),
            "worker": request.hostname or socket.gethostname(),
            "pid": pid,
        },
        separators=(",", ":"),
    ).encode()


def test_identity_is_the_json_of_its_fields_for_every_task_worker_and_run() -> None:
    tasks = [SimpleNamespace(name=name) for name in ("a.b", 'q"uote\\d', "ünï\u2028", "")]
    for task in tasks:
        for hostname in ("w1@host", "w2@host", 'h"\\é', None):
            for task_id, retries in (("id-1", 0), ("id-2", 3), ("é\n", None), (None, 1)):
                request = SimpleNamespace(id=task_id, hostname=hostname, retries=retries)
                assert identity(task, request) == expected(task, request, os.getpid())


def _identity_in_child(queue: Any) -> None:
    request = SimpleNamespace(id="child", hostname="w@host", retries=0)
    queue.put((identity(SimpleNamespace(name="t"), request), os.getpid()))


def test_a_forked_child_names_its_own_pid() -> None:
    """A prefork child inherits the parent's cached parts: its identity still has its own pid."""
    task = SimpleNamespace(name="t")
    request = SimpleNamespace(id="child", hostname="w@host", retries=0)
    assert identity(task, request) == expected(task, request, os.getpid())  # cached here
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_identity_in_child, args=(queue,))
    child.start()
    data, child_pid = queue.get(timeout=30)
    child.join(30)
    assert child_pid != os.getpid()
    assert data == expected(task, request, child_pid)
