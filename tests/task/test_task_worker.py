"""ZkLockTask in real `celery worker` processes of every pool, with real ZooKeeper and Redis."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import LockLost, is_skipped
from celery_zklock.locks.identity import parse_identity
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.witness import check_witness
from tests.conftest import SESSION_TIMEOUT, Broker
from tests.lockutil import children, expire_session_id, wait_for
from tests.taskapp import read_records
from tests.workerproc import held_session, workers

POOLS = ["prefork", "solo", "threads", "gevent"]


def send(task: Any, queues: list[str], i: int, *args: Any, **options: Any) -> Any:
    return task.apply_async(args, queue=queues[i % len(queues)], **options)


@pytest.mark.parametrize(
    ("pool", "broker"),
    [*((pool, "redis") for pool in POOLS), ("prefork", "amqp"), ("threads", "amqp")],
    indirect=["broker"],
)
def test_skip_wait_and_shared_modes(
    pool: str,
    taskenv: tuple[Celery, dict[str, str], Path],
    broker: Broker,
    zk_client: KazooClient,
) -> None:
    """Every pool on Redis; a prefork and a threads worker on RabbitMQ as well."""
    app, _, tmp = taskenv
    env = broker.env
    from tests.taskapp import exclusive_section, shared_section

    with workers(app, pool, 2, env, tmp) as fleet:
        queues = [w.queue for w in fleet]
        # skip: 40 tasks over 4 keys
        results = [send(exclusive_section, queues, i, f"k{i % 4}", 0.05) for i in range(40)]
        values = [r.get(timeout=60) for r in results]
        skipped = [v for v in values if is_skipped(v)]
        ran = [v for v in values if not is_skipped(v)]
        assert all(r.state == "SUCCESS" for r in results)
        assert len(ran) + len(skipped) == 40 and len(ran) >= 4
        for value in skipped:
            assert value["reason"] == "busy" and "/section/key=k" in value["lock"]
        for key in range(4):
            report = check_witness(tmp / f"witness-k{key}")
            assert report.overlaps == [] and report.unfinished == []
        # wait: one key, every task runs, one at a time
        results = [
            send(exclusive_section, queues, i, "wk", 0.05, zklock={"on_busy": "wait"})
            for i in range(8)
        ]
        values = [r.get(timeout=60) for r in results]
        assert not any(is_skipped(v) for v in values)
        report = check_witness(tmp / "witness-wk")
        assert report.sections == 8 and report.overlaps == []
        tokens = [v["token"] for v in values]
        assert len(set(tokens)) == 8
        # shared: readers overlap, the writer is excluded
        readers = [send(shared_section, queues, i, "sk", 0.4) for i in range(4)]
        writer = send(exclusive_section, queues, 0, "sk", 0.05, zklock={"on_busy": "wait"})
        readers += [send(shared_section, queues, i, "sk", 0.4) for i in range(2)]
        for r in [*readers, writer]:
            assert not is_skipped(r.get(timeout=60))
        report = check_witness(tmp / "witness-sk")
        assert report.sections == 7 and report.overlaps == []
        assert report.max_readers >= 2
    # every lock node is gone once the workers are done
    wait_for(lambda: not zk_client.exists("/taskapp/section"), 15, "lock parents to be reaped")


REVOCATION_BOUND = 4.0
"""Seconds from the client learning of the loss to the task's failure being stored: the body
(60 s) was interrupted, not run to its end. Well under 1 s on a quiet machine (the tests print
it); a CI run at load 9 took 1.35 s in a gevent worker, so the test holds the interruption, not
a latency target (``make bench`` measures those)."""


def revocation_delay(tmp: Path, result: Any) -> float:
    """Seconds from the worker's ``lock_lost`` signal for ``result`` to its stored end."""
    lost = [r for r in read_records(tmp / "lost-events") if r["task_id"] == result.id]
    assert len(lost) == 1, lost
    done = result.date_done
    if isinstance(done, str):
        done = datetime.fromisoformat(done)
    if done.tzinfo is None:
        done = done.replace(tzinfo=timezone.utc)
    return float(done.timestamp() - lost[0]["time"])


@pytest.mark.parametrize("pool", POOLS)
def test_session_expired_from_outside_revokes_the_running_task(
    pool: str, taskenv: tuple[Celery, dict[str, str], Path], zk_hosts: str
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    with workers(app, pool, 2, env, tmp) as (first, second):
        victim = long_hold.apply_async(("rk", 60.0), queue=first.queue)
        record = held_session(tmp, victim.id)
        expire_session_id(zk_hosts, record["session_id"], bytes.fromhex(record["password"]))
        with pytest.raises(LockLost, match="lost"):
            victim.get(timeout=30, propagate=True)
        assert victim.state == "FAILURE"
        delay = revocation_delay(tmp, victim)
        print(f"revocation delay [{pool}]: {delay * 1000:.1f} ms")
        assert delay < REVOCATION_BOUND
        # another worker takes the lock; the victim's worker serves normally after
        other = long_hold.apply_async(("rk", 0.1), queue=second.queue)
        assert other.get(timeout=30) == "finished"
        assert held_session(tmp, other.id)["token"] > record["token"]
        again = long_hold.apply_async(("rk2", 0.1), queue=first.queue)
        assert again.get(timeout=30) == "finished"


def test_prefork_child_paused_past_session_timeout_ends_lock_lost(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """The GC-pause case: SIGSTOP the child longer than the session timeout, then resume."""
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    with workers(app, "prefork", 2, env, tmp) as (first, second):
        victim = long_hold.apply_async(("pk", 60.0), queue=first.queue)
        record = held_session(tmp, victim.id)
        pause_process(record["pid"])
        try:
            # while it is paused, the server expires its session and another worker gets in
            other = long_hold.apply_async(("pk", 0.1), queue=second.queue)
            assert other.get(timeout=SESSION_TIMEOUT * 4) == "finished"
            assert held_session(tmp, other.id)["token"] > record["token"]
        finally:
            os.kill(record["pid"], signal.SIGCONT)
        with pytest.raises(LockLost):
            victim.get(timeout=30, propagate=True)
        delay = revocation_delay(tmp, victim)
        print(f"revocation delay [prefork, paused]: {delay * 1000:.1f} ms")
        assert delay < REVOCATION_BOUND
        again = long_hold.apply_async(("pk2", 0.1), queue=first.queue)
        assert again.get(timeout=30) == "finished"


# Alone (solo): beside the rest of make test one round in 5 still ran on after the fix once
# (2026-11-29, cause not found yet); alone, 25 rounds of 25 were interrupted at once.
@pytest.mark.fault
@pytest.mark.solo
@pytest.mark.parametrize("round_", range(5))
def test_a_prefork_child_paused_past_its_lease_is_interrupted_in_a_blocking_call(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient, round_: int
) -> None:
    """The body sleeps in one blocking call (``time.sleep(60)``); its pool process is
    SIGSTOPped for 0.65 of the session timeout (past its lease's validity, not its session),
    then resumed: the lease counts as lost and the body is interrupted at once, ending LockLost
    a moment after SIGCONT, not after its sleep. Before the fix the interruption was a signal
    to the process, which the kernel gave to the thread that sent it while the main thread
    still had the continue pending: the main thread slept on, its lease lost, for about 55 s
    (6 rounds of 16 here, so the 5 rounds all pass with it about one time in ten)."""
    app, env, tmp = taskenv
    # Not acks_late: stopped right after the loss, the worker could requeue the message of a run
    # whose end its main process had not yet seen (reject_on_worker_lost), for a later test.
    from tests.taskapp import exclusive_section

    key = f"pb{round_}"
    path = exclusive_section.lock_path(key)
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        victim = exclusive_section.apply_async((key, 60.0), queue=worker.queue)
        wait_for(lambda: (tmp / f"witness-{key}").exists(), 30, "the body to start")
        (node,) = children(zk_client, path)
        pid = parse_identity(zk_client.get(f"{path}/{node}")[0]).pid
        assert pid is not None and pid != worker.pid
        pause_process(pid)
        try:
            time.sleep(0.65 * SESSION_TIMEOUT)  # the pause itself: nothing to wait for
        finally:
            os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
        with pytest.raises(LockLost):
            victim.get(timeout=90, propagate=True)
        ended = time.monotonic() - resumed
    assert ended < 10, f"the body ran on {ended:.1f} s after SIGCONT, its lease lost"
