"""A ZooKeeper outage loses nothing and stalls nothing (issue 44): on real prefork workers with
the library's defaults, a standalone ZooKeeper SIGKILLed for longer than five session timeouts
(and 20 s), then started again on the same port and data. Locked calls ride the outage out at
the workers' gates without pool slots, so plain tasks keep their speed; every call runs once
after the return, none beside another; the holder does not end SUCCESS, and a holder with
``lock_on_lost="retry"`` runs again once ZooKeeper answers (not while it is away)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zklock import LockLost
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.witness import check_witness
from tests.conftest import SESSION_TIMEOUT
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import held_at_gates, workers

pytestmark = pytest.mark.fault  # a minute of real time: make test-faults

OUTAGE = max(5 * SESSION_TIMEOUT, 20.0) + 4.0
"""Seconds ZooKeeper stays down: past five session timeouts and 20 s."""
PLAIN_EVERY = 0.25
"""Seconds between plain tasks sent during the outage."""


def _enters(path: Path) -> Counter[str]:
    """Sections entered per task id in a witness file (a holder is ``<task id>-t<token>``)."""
    if not path.exists():
        return Counter()
    lines = path.read_text().splitlines()
    return Counter(line.split()[1].rsplit("-t", 1)[0] for line in lines if line.startswith("enter"))


def test_locked_calls_ride_a_zookeeper_outage_out(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import exclusive_section, gated_section, gated_step, unlocked_noop

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts}
    queues = ["q0", "q0"]
    with workers(app, "prefork", 2, env, tmp, prefix="outage", queues=queues):
        holder = gated_section.apply_async(("o", 300.0), queue="q0")
        retrying = gated_step.apply_async(("r", 0, 300.0), queue="q0", zklock={"on_lost": "retry"})
        wait_for(lambda: _enters(tmp / "witness-o")[holder.id] == 1, 30, "the holder to hold")
        wait_for(lambda: len(read_records(tmp / "steps-r")) == 1, 30, "the retrying holder")
        waiting = [gated_section.apply_async(("o", 0.2), queue="q0") for _ in range(3)]
        # Its lock_timeout (10 s) passes during the outage: the time ZooKeeper was away does
        # not count (a 90 s drill ended such calls LockTimeout at the return).
        waiting.append(gated_section.apply_async(("o", 0.2), queue="q0", zklock={"timeout": 10}))
        wait_for(lambda: held_at_gates(app) == 4, 30, "the gates to hold the waiting calls")

        server.kill()
        died = time.monotonic()
        plain: list[tuple[float, Any]] = []
        during: list[Any] = []  # gated_section calls (wait when busy)
        skipping: list[Any] = []  # exclusive_section calls (skip when busy) on fresh keys
        while time.monotonic() - died < OUTAGE:  # paced traffic, not a wait for an event
            plain.append((time.time(), unlocked_noop.apply_async(queue="q0")))
            if len(plain) % 10 == 1:
                key = "o" if len(during) % 2 == 0 else f"new{len(during)}"
                during.append(gated_section.apply_async((key, 0.2), queue="q0"))
                skipping.append(
                    exclusive_section.apply_async((f"skip{len(during)}", 0.1), queue="q0")
                )
            time.sleep(PLAIN_EVERY)
        (tmp / "release-r").touch()  # its run after the outage ends at once
        server.restart()
        back = time.time()
        time.sleep(1.0)  # the timeline: fresh keys sent 1 s after the return
        fresh = [gated_section.apply_async((f"fresh{i}", 0.1), queue="q0") for i in range(10)]

        for _, result in plain:
            result.get(timeout=60)
        latencies = sorted(result.result - sent for sent, result in plain)
        for call in [*waiting, *during, *skipping, *fresh]:
            call.get(timeout=max(1.0, back + 120 - time.time()))
        with pytest.raises(LockLost):  # docs/outage.md: the holder ends FAILURE LockLost
            holder.get(timeout=60)
        assert retrying.get(timeout=60) == 0

    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    assert p95 <= 2.0, f"plain tasks during the outage: p95 {p95:.2f}s ({latencies[-5:]})"
    assert holder.state != "SUCCESS"
    locked = [*waiting, *during, *skipping, *fresh]
    assert all(call.state == "SUCCESS" for call in locked), [c.state for c in locked]
    entered: Counter[str] = Counter()
    for witness in tmp.glob("witness-*"):
        report = check_witness(witness)
        assert not report.overlaps, (witness.name, report.overlaps)
        entered.update(_enters(witness))
    assert all(entered[call.id] == 1 for call in locked), {c.id: entered[c.id] for c in locked}
    ends = [
        record["end"] for i in range(10) for record in read_records(tmp / f"gated-done-fresh{i}")
    ]
    assert len(ends) == 10 and max(ends) - back <= 10.0, [round(e - back, 1) for e in ends]
    steps = read_records(tmp / "steps-r")
    starts = [r for r in steps if r["at"] == "start"]
    assert len(starts) == 2 and steps[-1]["at"] == "end", steps  # interrupted, then run again
    assert starts[1]["token"] > starts[0]["token"]


def test_a_run_in_the_pool_that_meets_the_outage_is_sent_back_not_retried_and_runs_once(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    """docs/concepts.md: "a run already in the pool that finds ZooKeeper unreachable sends its
    message back under the same task id (not a retry) and ends without a state". With the gate
    off, a ``wait`` call waits in its pool slot behind a holder; ZooKeeper is stopped: the
    run's wait ends, it is sent back (the ``sent-back`` event), and while ZooKeeper is away the
    call has no final state and is never retried. Once ZooKeeper is back it runs once, SUCCESS,
    beside nobody."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_section

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_GATE": "false"}
    # prefork: the holder's body is interrupted when its lease is lost (a thread's blocking
    # sleep is not, and its node would stay as long as the body runs, the session kept).
    with workers(app, "prefork", 1, env, tmp, prefix="sentback") as (worker,):
        holder = gated_section.apply_async(("sb", 300.0), queue=worker.queue)
        wait_for(lambda: _enters(tmp / "witness-sb")[holder.id] == 1, 30, "the holder to hold")
        waiter = gated_section.apply_async(("sb", 0.1), queue=worker.queue)
        wait_for(lambda: f"event=busy task_id={waiter.id}" in worker.log_text(), 30, "the wait")
        server.kill()
        sent_back = f"event=sent-back task_id={waiter.id}"
        wait_for(lambda: sent_back in worker.log_text(), 6 * SESSION_TIMEOUT, "the send-back")
        assert waiter.state not in ("SUCCESS", "FAILURE", "RETRY"), waiter.state
        server.restart()
        assert "token" in waiter.get(timeout=120)
        with pytest.raises(LockLost):  # the holder lost its lease
            holder.get(timeout=60)
        log = worker.log_text()
    assert not [line for line in log.splitlines() if f"[{waiter.id}] retry" in line]
    assert _enters(tmp / "witness-sb")[waiter.id] == 1
    assert not check_witness(tmp / "witness-sb").overlaps
    done = [r["task_id"] for r in read_records(tmp / "gated-done-sb")]
    assert done.count(waiter.id) == 1, done
