"""Enqueue-time deduplication (``lock_dedupe``) with real callers, a real broker and real
workers: one message per key among concurrent callers, ``queued`` against ``running``,
``lock_dedupe_raise``, and every crash leaving the key usable again within the ttl."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zklock.task.dedupe import AlreadyQueued
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import ROOT, workers

TTL = 3.0
"""The dedupe ttl of these tests' workers and callers (TASKAPP_DEDUPE_TTL)."""


@pytest.fixture
def env(
    taskenv: tuple[Celery, dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    _, env, _ = taskenv
    monkeypatch.setenv("TASKAPP_DEDUPE_TTL", str(TTL))
    return {**env, "TASKAPP_DEDUPE_TTL": str(TTL)}


def _call_in_child(key: str, queue: str, barrier: Any, out: Any) -> None:
    from tests.taskapp import deduped

    barrier.wait(30)
    out.put(deduped.apply_async((key, 0.1), queue=queue).id)


def _deduped() -> Any:
    import importlib

    import tests.taskapp

    # TASKAPP_DEDUPE_TTL is read when the task is defined: the module must see this test's value.
    return importlib.reload(tests.taskapp).deduped


def test_one_message_among_eight_concurrent_callers(
    taskenv: tuple[Celery, dict[str, str], Path], env: dict[str, str], redis_url: str
) -> None:
    app, _, tmp = taskenv
    key, queue = f"dd-{uuid.uuid4().hex[:6]}", f"ddq-{uuid.uuid4().hex[:6]}"
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(8), context.Queue()
    callers = [
        context.Process(target=_call_in_child, args=(key, queue, barrier, out)) for _ in range(8)
    ]
    for caller in callers:
        caller.start()
    ids = [out.get(timeout=60) for _ in callers]
    for caller in callers:
        caller.join(30)
    assert len(set(ids)) == 1, ids  # all eight got the one message's id
    broker = redis.Redis.from_url(redis_url)
    assert broker.llen(queue) == 1  # and exactly one message reached the broker
    deduped = _deduped()
    with workers(app, "threads", 1, env, tmp, queues=[queue]):
        (tmp / f"release-{key}").touch()
        assert deduped.AsyncResult(ids[0]).get(timeout=30)["token"] > 0
        again = deduped.apply_async((key, 0.1), queue=queue)
        assert again.id != ids[0]  # the run ended: a new call sends again
        assert again.get(timeout=30)["token"] > 0


def test_queued_against_running_and_raise(
    taskenv: tuple[Celery, dict[str, str], Path], env: dict[str, str]
) -> None:
    app, _, tmp = taskenv
    deduped = _deduped()
    with workers(app, "threads", 1, env, tmp) as (worker,):
        for mode in ("queued", "running"):
            key = f"dd-{mode}-{uuid.uuid4().hex[:6]}"
            call = {"queue": worker.queue, "zklock": {"dedupe": mode}}
            first = deduped.apply_async((key, 60.0), **call)
            wait_for(lambda k=key: bool(read_records(tmp / f"starts-{k}")), 30, "the run")
            second = deduped.apply_async((key, 0.1), **call)
            if mode == "queued":
                assert second.id != first.id  # the first one started: its marker went
                assert second.get(timeout=30)["reason"] == "busy"  # sent, and skipped on its lock
            else:
                assert second.id == first.id  # still running: deduplicated
                with pytest.raises(AlreadyQueued) as raised:
                    deduped.apply_async(
                        (key, 0.1), queue=worker.queue,
                        zklock={"dedupe": mode, "dedupe_raise": True},
                    )  # fmt: skip
                assert raised.value.task_id == first.id and first.id in str(raised.value)
            (tmp / f"release-{key}").touch()
            assert first.get(timeout=30)["token"] > 0
            third = deduped.apply_async((key, 0.1), **call)
            assert third.id not in (first.id, second.id)  # over: the key sends again
            (tmp / f"release-{key}").touch()
            assert third.get(timeout=30)["token"] > 0


def _accepted_after(deduped: Any, key: str, owner: str, **call: Any) -> float:
    """Seconds until a call for ``key`` sends a message of its own (not ``owner``'s)."""
    started = time.monotonic()
    while deduped.apply_async((key, 0.1), **call).id == owner:
        assert time.monotonic() - started < TTL + 10, "the key stayed deduplicated"
        time.sleep(0.2)
    return time.monotonic() - started


KILLED_CALLER = """
import os, signal, sys
from celery.app.task import Task
import tests.taskapp as app
# The process dies between its marker and its send.
Task.apply_async = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
app.deduped.apply_async((sys.argv[1], 0.1), queue=sys.argv[2])
"""


def test_a_caller_killed_between_marker_and_send(env: dict[str, str]) -> None:
    deduped = _deduped()
    key, queue = f"dd-kill-{uuid.uuid4().hex[:6]}", f"ddq-{uuid.uuid4().hex[:6]}"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_CALLER, key, queue], cwd=ROOT,
        env={**os.environ, **env}, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL
    owner = deduped.apply_async((key, 0.1), queue=queue).id  # the dead caller's marker counts
    took = _accepted_after(deduped, key, owner, queue=queue)
    print(f"killed caller: key accepted again after {took:.1f} s (ttl {TTL:g} s)")
    assert took <= TTL + 1


def test_a_purged_queue(env: dict[str, str], redis_url: str) -> None:
    deduped = _deduped()
    key, queue = f"dd-purge-{uuid.uuid4().hex[:6]}", f"ddq-{uuid.uuid4().hex[:6]}"
    owner = deduped.apply_async((key, 0.1), queue=queue).id
    broker = redis.Redis.from_url(redis_url)
    assert broker.delete(queue) == 1  # purged: the message is gone, its marker is not
    took = _accepted_after(deduped, key, owner, queue=queue)
    print(f"purged queue: key accepted again after {took:.1f} s (ttl {TTL:g} s)")
    assert took <= TTL + 1


def test_a_worker_killed_mid_run(
    taskenv: tuple[Celery, dict[str, str], Path], env: dict[str, str]
) -> None:
    app, _, tmp = taskenv
    deduped = _deduped()
    key = f"dd-wkill-{uuid.uuid4().hex[:6]}"
    with workers(app, "threads", 1, env, tmp) as (worker,):
        call: dict[str, Any] = {"queue": worker.queue, "zklock": {"dedupe": "running"}}
        owner = deduped.apply_async((key, 60.0), **call)
        wait_for(lambda: bool(read_records(tmp / f"starts-{key}")), 30, "the run to start")
        worker.signal_group(signal.SIGKILL)
        killed_at = time.monotonic()
        took = _accepted_after(deduped, key, owner.id, **call)
    print(f"worker killed: key accepted again {took:.1f} s after (ttl {TTL:g} s)")
    assert time.monotonic() - killed_at <= TTL + 10
    assert took <= TTL + 1
