"""The gate's promises under the faults that could break them, on real prefork workers, Redis and
ZooKeeper (issue 42): a call handed out again by the broker never runs twice, a held message is
never handed out again while the worker still has it, released messages hold no memory, order
per key is kept (by one worker exactly, across a warm shutdown, across two workers within a
stated bound), revoked and expired held messages end at once, and a retry's wait counts from
its own receipt."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import Mutex
from celery_zklock.testing.plugin import StackFactory
from tests.conftest import Broker
from tests.lockutil import wait_for
from tests.task.test_gate import held_at_gate, live_of
from tests.task.test_gate_rabbitmq import start as start_gated
from tests.taskapp import read_records
from tests.workerproc import held_at_gates, workers

pytestmark = pytest.mark.fault  # minutes of real time: make test-faults


def _held(app: Celery) -> int:
    return sum(counts["held"] for counts in held_at_gate(app).values())


def settled(app: Celery, redis_url: str, queue: str) -> Callable[[], bool]:
    """A predicate: nothing of ``queue`` is left anywhere, in the broker (queued or delivered
    and unacknowledged) or in a worker (held at its gate, reserved, scheduled or running), so
    no copy of any message can still be handed out."""
    broker = redis.Redis.from_url(redis_url)

    def check() -> bool:
        if broker.llen(queue) or broker.hlen("unacked") or _held(app):
            return False
        inspect = app.control.inspect(timeout=1.0)
        for answer in (inspect.active(), inspect.reserved(), inspect.scheduled()):
            if answer is None or any(answer.values()):
                return False
        return True

    return check


def _active(app: Celery) -> int:
    answer = app.control.inspect(timeout=1.0).active() or {}
    return sum(len(requests) for requests in answer.values())


def starts(tmp: Path, key: str) -> list[dict[str, Any]]:
    return [r for r in read_records(tmp / f"steps-{key}") if r["at"] == "start"]


@pytest.mark.parametrize("tracked", [False, True], ids=["plain", "track_started"])
def test_a_failed_call_handed_out_again_is_not_run_again(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, tracked: bool
) -> None:
    """Repro 1: ``acks_late``, Redis hands the message out again after 4 s while its body (7 s)
    still runs, and the body fails. The copy waits at the gate (the key is busy); it must not
    write a waiting state over the FAILURE, so that it finds the FAILURE and is ignored: the
    body starts once. With ``track_started`` Celery itself writes STARTED over the FAILURE as
    the copy's run starts: the run must have looked before that write."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_failing, gated_failing_tracked

    task = gated_failing_tracked if tracked else gated_failing
    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "4"}
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        call = task.apply_async(("f", 7.0), queue=worker.queue)
        if tracked:  # written by the run once it holds its lock, as the body starts
            wait_for(lambda: call.state == "STARTED", 30, "STARTED while the body runs")
        with pytest.raises(ValueError):
            call.get(timeout=60, propagate=True)
        wait_for(
            lambda: (
                "event=duplicate-ignored" in worker.log_text()
                or len(read_records(tmp / "starts-f")) > 1
            ),
            60,
            "the copy to be ignored (or to run)",
        )
        wait_for(settled(app, redis_url, worker.queue), 60, "every copy to be dealt with")
    assert [r["task_id"] for r in read_records(tmp / "starts-f")] == [call.id]
    assert call.state == "FAILURE"


@pytest.mark.parametrize("ignore_result", [False, True], ids=["stored", "ignored"])
def test_a_held_eta_call_is_not_handed_out_twice(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, ignore_result: bool
) -> None:
    """Repro 2 (ETA): a call with ``countdown=4`` is fetched at once and counts against a 6 s
    visibility timeout from then; it reaches the gate at its ETA, behind a holder of 9 s. Its
    hold bound counts from the fetch, so it goes back to the broker before Redis hands it out
    again: its body completes once, with results stored and ignored."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "6"}
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        gated_step.apply_async(("eta", -1, 9.0), queue=worker.queue)
        wait_for(lambda: len(starts(tmp, "eta")) == 1, 30, "the holder to start")
        call = gated_step.apply_async(
            ("eta", 0, 0.1), queue=worker.queue, countdown=4, ignore_result=ignore_result
        )
        wait_for(lambda: len(starts(tmp, "eta")) >= 2, 60, "the ETA call to run")
        wait_for(settled(app, redis_url, worker.queue), 60, "every copy to be dealt with")
    runs = Counter(r["task_id"] for r in starts(tmp, "eta"))
    assert runs[call.id] == 1, runs


def test_held_calls_past_the_bound_go_back_to_the_broker_not_into_a_busy_pool(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str
) -> None:
    """Repro 2 (bound): ``zklock_gate_max_hold=2`` under a 10 s visibility timeout, a holder of
    9 s and four waiters of 1 s (results ignored). Past the bound the waiters must not all go
    into the pool, where they would sit unacknowledged past the visibility timeout and be run
    twice: they go back to the broker, and each body starts once."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "10", "ZKLOCK_GATE_MAX_HOLD": "2"}
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        gated_step.apply_async(("bound", -1, 9.0), queue=worker.queue)
        wait_for(lambda: len(starts(tmp, "bound")) == 1, 30, "the holder to start")
        calls = [
            gated_step.apply_async(("bound", i, 1.0), queue=worker.queue, ignore_result=True)
            for i in range(4)
        ]
        wait_for(lambda: len(starts(tmp, "bound")) >= 5, 90, "the waiters to run")
        wait_for(settled(app, redis_url, worker.queue), 60, "every copy to be dealt with")
    runs = Counter(r["task_id"] for r in starts(tmp, "bound"))
    assert all(runs[c.id] == 1 for c in calls), runs
    assert "go back to the broker" in worker.log_text()  # given back, not sent to the pool


def test_released_messages_hold_no_memory(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """Repro 3: every held message's timer entry (and, through it, its request) stayed in the
    worker's timer until its bound (48 min by default) after it was dispatched. After a
    warm-up on one hot key, 300 more gated calls leave as many live requests and timer entries
    as the warm-up did."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    def burst(count: int) -> None:
        calls = [
            gated_step.apply_async(("mem", 0, 0.0), queue=worker.queue, ignore_result=True)
            for _ in range(count)
        ]
        wait_for(lambda: len(starts(tmp, "mem")) >= done + count, 120, "the burst to run")
        assert len(calls) == count

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        done = 0
        burst(100)
        done = 100
        warm = live_of(app)
        burst(300)
        after = live_of(app)
    assert after["timer_entries"] <= warm["timer_entries"] + 2, (warm, after)
    assert after["requests"] <= warm["requests"] + 2, (warm, after)


def test_one_worker_starts_held_calls_in_order_and_a_warm_shutdown_keeps_it(
    taskenv: tuple[Celery, dict[str, str], Path], broker: Broker
) -> None:
    """Repro 4: four calls held behind a holder when the worker gets a warm shutdown go back to
    the broker, rejected with requeue in the order received, and each runs once on the next
    worker. RabbitMQ keeps their order exactly. On Redis the order is kombu's (see
    docs/waiting.md, "Order"): it is asserted there only that each runs once, once nothing of
    the queue is left (Redis's visibility timeout is an hour here: a copy left unacknowledged
    would run only after the test, so the test looks for one instead)."""
    _, env, tmp = taskenv
    sender, queue = broker.sender, broker.queues[0]
    env = broker.env

    with workers(sender, "prefork", 1, env, tmp, queues=[queue]) as (worker,):
        broker.send("gated_step", ("warm", -1, 60.0), queue)
        wait_for(lambda: len(starts(tmp, "warm")) == 1, 30, "the holder to start")
        calls = [broker.send("gated_step", ("warm", i, 0.1), queue).id for i in range(4)]
        wait_for(lambda: _held(sender) == 4, 30, "the gate to hold the four")
        worker.request_stop()
        (tmp / "release-warm").touch()  # the warm shutdown waits for the holder's body
        worker.wait(60)
    (tmp / "release-warm").unlink()
    # The next worker consumes only once its gate is connected: before that its gate lets
    # locked calls through to the pool, where two of them would race for the free lock.
    following = start_gated(sender, "next", env, tmp, 600.0)
    try:
        wait_for(lambda: len(starts(tmp, "warm")) == 5, 60, "the four to run")
        if broker.name == "redis":
            wait_for(settled(sender, broker.url, queue), 60, "every copy to be dealt with")
    finally:
        following.stop()
    runs = Counter(r["task_id"] for r in starts(tmp, "warm"))
    assert all(runs[call] == 1 for call in calls) and len(runs) == 5, runs
    order = [r["seq"] for r in starts(tmp, "warm")][1:]
    if broker.name == "amqp":
        assert order == [0, 1, 2, 3]
    else:
        assert sorted(order) == [0, 1, 2, 3], order


def test_two_workers_keep_each_ones_order_and_are_overtaken_only_by_the_others_calls(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """Two workers share a queue and 20 calls on one key. Each worker starts the calls it
    received in the order it received them (the order sent); a call can be overtaken only by
    calls the other worker received. How many is a matter of timing (docs/waiting.md, "Order"),
    so no count is asserted."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    with workers(app, "prefork", 2, env, tmp, queues=["q0", "q0"]):
        gated_step.apply_async(("two", -1, 1.0), queue="q0")
        for i in range(20):
            gated_step.apply_async(("two", i, 0.05), queue="q0")
        wait_for(lambda: len(starts(tmp, "two")) == 21, 120, "the calls to run")
    begun = [r for r in starts(tmp, "two") if r["seq"] >= 0]
    order = [r["seq"] for r in begun]
    assert sorted(order) == list(range(20)), order
    by_worker: dict[str, list[int]] = {}
    for record in begun:
        by_worker.setdefault(record["worker"], []).append(record["seq"])
    for seqs in by_worker.values():
        assert seqs == sorted(seqs), by_worker  # each worker: exactly the order received
    for position, seq in enumerate(order):
        overtakers = [s for s in order[:position] if s > seq]
        mine = next(w for w, seqs in by_worker.items() if seq in seqs)
        others = {s for w, seqs in by_worker.items() if w != mine for s in seqs}
        assert set(overtakers) <= others, (seq, overtakers, by_worker)


def test_revoked_and_expired_held_calls_end_at_once(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """Repro 8: a held call that is revoked, and one whose ``expires`` passes, end REVOKED
    while the key is still busy (they stayed held until it freed)."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        holder = gated_step.apply_async(("rev", -1, 120.0), queue=worker.queue)
        wait_for(lambda: len(starts(tmp, "rev")) == 1, 30, "the holder to start")
        revoked = gated_step.apply_async(("rev", 0, 0.1), queue=worker.queue)
        expiring = gated_step.apply_async(("rev", 1, 0.1), queue=worker.queue, expires=3)
        wait_for(lambda: _held(app) == 2, 30, "the gate to hold both")
        revoked.revoke()
        wait_for(lambda: revoked.state == "REVOKED", 30, "the revoked call to end")
        wait_for(lambda: expiring.state == "REVOKED", 30, "the expired call to end")
        assert not holder.ready() and _held(app) == 0
        (tmp / "release-rev").touch()
        holder.get(timeout=30)
    assert [r["seq"] for r in starts(tmp, "rev")] == [-1]


def test_a_retry_waits_its_own_lock_timeout(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """Repro 9: a call received by a gated worker retries (4 s later, past its 3 s
    ``lock_timeout``) on a worker without the gate, where the key is busy. Its wait counts from
    its own receipt: it waits for the key and runs (it timed out at once, on the first
    attempt's receipt time)."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_retrying

    with (
        workers(app, "prefork", 1, env, tmp, prefix="gated", queues=["q0"]),
        workers(app, "prefork", 1, {**env, "ZKLOCK_GATE": "false"}, tmp, prefix="plain",
                queues=["q1"]) as (plain,),
    ):  # fmt: skip
        # A per-call override, as users send them: its header travels with the retry.
        call = gated_retrying.apply_async(("r", 4.0, "q1"), queue="q0", zklock={"timeout": 3})
        wait_for(lambda: read_records(tmp / "attempts-r"), 30, "the first attempt")
        lease = Mutex(zk_client, gated_retrying.lock_path("r", 0, "")).acquire(timeout=10)
        try:
            wait_for(lambda: "event=busy" in plain.log_text(), 60, "the retry to wait")
        finally:
            lease.release()
        result = call.get(timeout=30)
    assert result.get("retries") == 1, result


def test_a_retry_waits_its_own_lock_timeout_at_a_gate_that_gave_its_first_attempt_back(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """A gate gives a held call back to the broker at its bound (5 s) and remembers when the
    call first came, so that its ``lock_timeout`` (15 s) goes on from there if it comes back.
    Another worker fetches it and runs it, and its retry comes to the first gate, the key busy
    again: the retry's wait counts from its own receipt (keyed by task id alone, the gate gave
    the retry the first attempt's place, and it timed out 2 s after it came)."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_retrying

    path = gated_retrying.lock_path("gb", 0, "")
    lease = Mutex(zk_client, path).acquire(timeout=10)
    gated = {**env, "ZKLOCK_GATE_MAX_HOLD": "5"}
    with workers(app, "prefork", 1, gated, tmp, prefix="gave", queues=["gb0,gba"]) as (first,):
        call = gated_retrying.apply_async(("gb", 3.0, "gba"), queue="gb0", zklock={"timeout": 15})
        wait_for(lambda: held_at_gates(app) == 1, 30, "the first attempt to be held")
        app.control.cancel_consumer("gb0", destination=[first.nodename], reply=True)
        wait_for(lambda: "go back to the broker" in first.log_text(), 30, "the give-back")
        plain = {**env, "ZKLOCK_GATE": "false"}
        with workers(app, "prefork", 1, plain, tmp, prefix="fetched", queues=["gb0"]) as (other,):
            wait_for(lambda: "event=busy" in other.log_text(), 30, "the first attempt to wait")
            lease.release()
            wait_for(lambda: read_records(tmp / "attempts-gb"), 30, "the first attempt's body")
            lease = Mutex(zk_client, path).acquire(timeout=10)  # once that run let it go
            wait_for(lambda: call.state == "RETRY", 30, "the first attempt to end")
            received = f"[{call.id}] received"
            wait_for(lambda: first.log_text().count(received) == 2, 30, "the retry at the gate")
            came = time.monotonic()
            time.sleep(6.0)  # the retry waits 15 s from here: the key is let go well within it
            lease.release()
            result = call.get(timeout=30)
            waited = time.monotonic() - came
    assert result.get("retries") == 1, f"{result} after {waited:.1f} s at the gate"


def test_while_zookeeper_is_away_a_new_call_waits_behind_the_held_ones(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    """Repro 4 (disconnected): ZooKeeper stops while the gate holds a call; a call of the same
    key received meanwhile waits behind it at the gate (it went straight to the pool, ahead
    of the held one). A 20 s session timeout keeps the gate from handing them over before
    the test looks. When ZooKeeper answers again the line goes on in order (docs/waiting.md):
    the held call's body starts before the later one's, each once."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_SESSION_TIMEOUT": "20"}
    with workers(app, "prefork", 1, env, tmp, prefix="away") as (worker,):
        gated_step.apply_async(("away", -1, 120.0), queue=worker.queue)
        wait_for(lambda: len(starts(tmp, "away")) == 1, 30, "the holder to start")
        gated_step.apply_async(("away", 0, 0.1), queue=worker.queue)
        wait_for(lambda: _held(app) == 1, 30, "the first call to be held")
        server.kill()  # its data kept: the sessions live on at the restart below
        later = gated_step.apply_async(("away", 1, 0.1), queue=worker.queue)
        wait_for(lambda: f"[{later.id}] received" in worker.log_text(), 30, "its receipt")
        assert _held(app) == 2
        (tmp / "release-away").touch()
        server.restart()
        assert later.get(timeout=60) == 1
    assert [r["seq"] for r in starts(tmp, "away")] == [-1, 0, 1]


def test_an_ignored_copy_leaves_its_waiting_original_in_the_broker(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, zk_client: KazooClient
) -> None:
    """The fleet's lost calls: Redis hands a message out again under the delivery tag it had
    (kombu keeps one unacknowledged record per tag), so a copy's acknowledgement removes the
    record of its original too. A call waits for a key the test holds, in the pool, with a 10 s
    visibility timeout (longer than a copy waits for its original's node, 7 s, so that no
    further copy is handed out meanwhile); its copy finds the original's node and is ignored;
    then the worker is killed. The original must still be in the broker: a new worker runs it
    once the key is free (before the fix it was gone, and the call never ran)."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "10", "ZKLOCK_GATE": "false"}
    lease = Mutex(zk_client, gated_step.lock_path("copy", 0, 0.1)).acquire(timeout=10)
    try:
        with workers(app, "prefork", 1, env, tmp, prefix="first") as (worker,):
            call = gated_step.apply_async(("copy", 0, 0.1), queue=worker.queue)
            wait_for(lambda: "event=duplicate-ignored" in worker.log_text(), 60, "a copy ignored")
            # Once the worker's main process has dealt with the copy's end, only the original
            # is active (the copy's message acknowledged, or not, by then).
            wait_for(lambda: _active(app) == 1, 30, "the worker to be done with the copy")
            worker.kill()
    finally:
        lease.release()
    with workers(app, "prefork", 1, env, tmp, prefix="after") as (after,):
        assert call.get(timeout=60) == 0
        wait_for(settled(app, redis_url, after.queue), 60, "every copy to be dealt with")
    assert [r["task_id"] for r in starts(tmp, "copy")] == [call.id]
