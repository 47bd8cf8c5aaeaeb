"""``lock_on_busy="preempt"`` on a real prefork worker: the newest call wins, and the older
body has exited before the newer one enters; a preempted run's retry never preempts back (the
calls' generations, :mod:`celery_zklock.task.generation`), also beside a holder or a retry of a
version that wrote no generation."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import LockLost, LockTimeout, Mutex, Preempted, is_skipped
from celery_zklock.errors import LossCode
from celery_zklock.locks.identity import parse_identity
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.witness import check_witness
from tests.lockutil import children, wait_for
from tests.workerproc import workers


def test_a_newer_call_ends_the_holder_first(taskenv: tuple[Celery, dict[str, str], Path]) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        older = gated_section.apply_async(("pk", 30.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-pk").exists(), 30, "the older body to start")
        sent = time.monotonic()
        newer = gated_section.apply_async(
            ("pk", 0.2), queue=worker.queue, zklock={"on_busy": "preempt"}
        )
        with pytest.raises(Preempted, match="preempted by a newer call") as lost:
            older.get(timeout=30)
        ended = time.monotonic() - sent
        assert isinstance(lost.value, LockLost)  # what code written for round 3 catches
        assert newer.id in str(lost.value)  # it names the preempting task
        token = newer.get(timeout=30)["token"]
        log = worker.log_text()
    assert ended < 10, ended
    # The intended outcome pages nobody: Celery's line is INFO without a traceback, and the
    # one WARNING is the lock's own, naming the newer call.
    ends = [line for line in log.splitlines() if f"[{older.id}]" in line and "raised" in line]
    assert len(ends) == 1 and "INFO" in ends[0] and "raised expected: Preempted" in ends[0], ends
    assert "Traceback" not in log
    lost_lines = [line for line in log.splitlines() if f"task_id={older.id}" in line
                  and "event=lost" in line]  # fmt: skip
    assert len(lost_lines) == 1 and "WARNING" in lost_lines[0], lost_lines
    assert "code=preempted" in lost_lines[0] and newer.id in lost_lines[0], lost_lines
    report = check_witness(tmp / "witness-pk")
    assert report.sections == 2 and report.overlaps == [], report
    assert token > 0


def test_a_paused_holder_is_waited_for_up_to_lock_timeout_and_never_overlapped(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """docs/multilock-and-preempt.md: "a holder that does not answer (a paused process) is
    waited for up to ``lock_timeout``, then ``lock_on_timeout`` applies", and "the two bodies
    never overlap". The holder's pool process is SIGSTOPped; a newer ``preempt`` call with a
    2 s ``lock_timeout`` (half the session timeout) ends LockTimeout without entering; the
    holder, resumed, ends LockLost (the break, or its lease clock that ran out meanwhile),
    alone in its section."""
    app, env, tmp = taskenv
    # Not acks_late: stopped right after the loss, the worker could requeue the message of a run
    # whose end its main process had not yet seen (reject_on_worker_lost), for a later test.
    from tests.taskapp import exclusive_section

    path = exclusive_section.lock_path("pp")
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        older = exclusive_section.apply_async(("pp", 30.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-pp").exists(), 30, "the older body to start")
        (node,) = children(zk_client, path)
        pid = parse_identity(zk_client.get(f"{path}/{node}")[0]).pid
        assert pid is not None and pid != worker.pid
        pause_process(pid)
        try:
            newer = exclusive_section.apply_async(
                ("pp", 0.2), queue=worker.queue, zklock={"on_busy": "preempt", "timeout": 2}
            )
            with pytest.raises(LockTimeout):
                newer.get(timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(LockLost):  # broken, or its lease clock ran out during the pause
            older.get(timeout=60)
    report = check_witness(tmp / "witness-pp")
    assert report.sections == 1 and report.overlaps == [], report


def starts(tmp: Path, key: str) -> list[tuple[str, int]]:
    """The attempts of ``preempting_section`` on ``key`` whose body started: (task id, retries)."""
    from tests.taskapp import read_records

    return [(r["task_id"], r["retries"]) for r in read_records(tmp / f"preempt-starts-{key}")]


def test_a_preempted_run_that_retries_never_preempts_the_newer_call(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """Issue 42's livelock: two calls of an 8 s body, ``lock_on_lost="retry"``,
    ``max_retries=None``. The older call is preempted once; its retry finds the newer call
    holding and is skipped as superseded; the newer body runs to its end, once."""
    app, env, tmp = taskenv
    from tests.taskapp import preempting_section

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        older = preempting_section.apply_async(("ll", 8.0), queue=worker.queue)
        wait_for(lambda: starts(tmp, "ll"), 30, "the older body to start")
        newer = preempting_section.apply_async(("ll", 8.0), queue=worker.queue)
        # Hang guard: the newer call ends, or the two keep preempting each other (a third body
        # starting is already one preemption too many).
        wait_for(lambda: newer.ready() or len(starts(tmp, "ll")) > 2, 120, "the newer call")
        assert starts(tmp, "ll") == [(older.id, 0), (newer.id, 0)]
        assert newer.get(timeout=10)["token"] > 0
        superseded = older.get(timeout=30)
        assert is_skipped(superseded), superseded
        assert (superseded["reason"], superseded["holder"]) == ("superseded", newer.id)
        assert starts(tmp, "ll") == [(older.id, 0), (newer.id, 0)]
    report = check_witness(tmp / "witness-ll")
    assert report.sections == 2 and report.overlaps == [], report


# -- beside a version that writes no generation ----------------------------------------------


def old_identity(task_id: str) -> bytes:
    """The data an older version's run stores in its contender node: no ``generation``."""
    fields = {"task_id": task_id, "task": "tests.taskapp.preempting_section", "retries": 0,
              "worker": "old@host", "pid": 1}  # fmt: skip
    return json.dumps(fields, separators=(",", ":")).encode()


def test_a_holder_of_an_older_version_is_preempted(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """A holder whose node has no generation (an older version's run, or a holder that is not
    a task run) counts as older than any call: it is preempted, as before generations."""
    app, env, tmp = taskenv
    from tests.taskapp import preempting_section

    path = preempting_section.lock_path("ov")
    lease = Mutex(zk_client, path).acquire(timeout=10, data=old_identity("old-run"))
    lost = threading.Event()
    lease.on_lost(lambda _reason: lost.set())
    try:
        with workers(app, "prefork", 1, env, tmp) as (worker,):
            newer = preempting_section.apply_async(("ov", 0.2), queue=worker.queue)
            assert lost.wait(60), "the old holder was never preempted"
            assert lease.lost_code is LossCode.BROKEN
            broken = parse_identity(zk_client.get(lease.node)[0]).broken
            assert broken is not None and newer.id in str(broken["by"])
            assert not newer.ready()  # granted only once the holder let go
            lease.release()
            assert newer.get(timeout=60)["token"] > lease.token
    finally:
        lease.release()
    assert starts(tmp, "ov") == [(newer.id, 0)]


def test_a_retry_of_an_older_version_never_preempts_and_is_superseded(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """A retry of a call that never had a generation (sent by an older version, first run by
    an older version's worker) counts as older than any call with one: it does not preempt
    the newer holder of its task, and is skipped as superseded."""
    app, env, tmp = taskenv
    from tests.taskapp import preempting_section

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        newer = preempting_section.apply_async(("or", 6.0), queue=worker.queue)
        wait_for(lambda: starts(tmp, "or"), 30, "the newer body to start")
        old_retry = app.send_task(
            preempting_section.name, ("or", 0.2), queue=worker.queue, retries=1
        )
        outcome: Any = old_retry.get(timeout=60)
        assert is_skipped(outcome) and outcome["reason"] == "superseded", outcome
        assert outcome["holder"] == newer.id
        assert newer.get(timeout=60)["token"] > 0
    assert starts(tmp, "or") == [(newer.id, 0)]
    assert children(zk_client, preempting_section.lock_path("or")) == []


@pytest.mark.fault
def test_a_call_sent_by_name_and_handed_out_again_never_preempts_a_newer_call(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """docs/multilock-and-preempt.md: a call sent by name has no generation and takes one when
    its first attempt runs; "a call never preempts a newer one". Its worker is SIGKILLed
    mid-body, a newer call (``apply_async``) takes the key, and Redis hands the first call
    out again after its visibility timeout (15 s). That run must not count as newer than the
    newer call: it took a new generation of its own there and preempted it (the first call's
    generation lived only in its dead run's memory). It is superseded, and the newer body
    runs to its end."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_section

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "15"}
    preempting = {"zklock": {"on_busy": "preempt"}}
    with workers(app, "prefork", 1, env, tmp, prefix="a", queues=["rg"]) as (first,):
        older = app.send_task(gated_section.name, ("rg", 60.0), queue="rg", headers=preempting)
        wait_for(lambda: (tmp / "witness-rg").exists(), 30, "the older body")
        first.kill()  # SIGKILL to its main and pool processes, mid-body
    with workers(app, "prefork", 1, env, tmp, prefix="b", queues=["rg"]):
        newer = gated_section.apply_async(("rg", 25.0), queue="rg")
        try:
            assert newer.get(timeout=60)["token"] > 0
        except Preempted as preempted:
            pytest.fail(f"the older call, handed out again, preempted the newer: {preempted}")
        outcome = older.get(timeout=30)  # its second delivery's run
    assert is_skipped(outcome) and outcome["reason"] == "superseded", outcome
    assert outcome["holder"] == newer.id, outcome
