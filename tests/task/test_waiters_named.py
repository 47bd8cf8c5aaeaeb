"""``celery zklock locks`` names every waiter (issue 46, item 3), on real workers: the holder,
the calls queued in ZooKeeper (a worker without the gate, its runs waiting in its pool) and the
calls held at a worker's gate, by task id and worker, in the order they then run; and
``task.lock_holder`` names the holder from the key's arguments alone. The replies of a worker of
an older version (counts only): tests/unit/test_held_replies.py."""

from __future__ import annotations

import json
from pathlib import Path

from celery import Celery
from kazoo.client import KazooClient

from celery_zklock.worker.gate.step import held_messages
from celery_zklock.zk.client import close_clients
from tests.lockutil import children, wait_for
from tests.task.test_commands import NO_GATE, invoke
from tests.taskapp import read_records
from tests.workerproc import start_worker, workers

KEY = "named"


def test_locks_names_the_holder_the_queued_and_the_held_in_run_order(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """One holder and two held at the gated worker's gate; two queued in ZooKeeper by a worker
    without the gate. ``locks --json`` and the table list all five, holder first, then the
    queue, then the gate's line; the runs then start in exactly that order."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    path = gated_step.lock_path(KEY)
    with workers(app, "prefork", 1, env, tmp, prefix="gated") as (gated,):
        ungated = start_worker(app, "prefork", "ungated", {**env, **NO_GATE}, tmp, queue="q1")
        try:
            holder = gated_step.apply_async((KEY, 0, 60.0), queue=gated.queue)
            wait_for(lambda: (tmp / f"steps-{KEY}").exists(), 30, "the holder's body")
            queued = [gated_step.apply_async((KEY, i, 60.0), queue="q1") for i in (1, 2)]
            wait_for(
                lambda: len(children(zk_client, path)) == 3, 30, "two runs queued in ZooKeeper"
            )
            gated_calls = [
                gated_step.apply_async((KEY, i, 60.0), queue=gated.queue) for i in (3, 4)
            ]
            wait_for(lambda: held_count(app, path) == 2, 30, "two calls held at the gate")

            found = gated_step.lock_holder(KEY)  # the key's argument alone
            close_clients()  # the one lock_holder opened in this process
            listed = invoke("locks", "--json", "--task", "tests.taskapp.gated_step")
            shown = invoke("locks")
        finally:
            (tmp / f"release-{KEY}").touch()
        for result in [holder, *queued, *gated_calls]:
            result.get(timeout=60)
        try:
            assert gated_step.lock_holder(KEY) is None  # every run ended
        finally:
            close_clients()
            ungated.stop()

    assert found is not None and (found.task_id, found.worker) == (holder.id, gated.nodename)
    assert listed.exit_code == 0, listed.output
    document = json.loads(listed.output)
    (lock,) = [lock for lock in document["locks"] if lock["path"] == path]
    (held,) = [held for held in document["held"] if held["path"] == path]
    holders = [(n["task_id"], n["worker"]) for n in lock["holders"]]
    waiters = [(n["task_id"], n["worker"], n["position"]) for n in lock["waiters"]]
    at_gate = [(m["task_id"], m["worker"], m["position"]) for m in held["messages"]]
    assert holders == [(holder.id, gated.nodename)]
    assert sorted(w[0] for w in waiters) == sorted(r.id for r in queued)
    assert [w[1:] for w in waiters] == [(ungated.nodename, 1), (ungated.nodename, 2)]
    assert at_gate == [(r.id, gated.nodename, i) for i, r in enumerate(gated_calls, start=1)]
    assert held["count"] == 2 and held["workers"] == [gated.nodename]
    assert all(m["task"] == "tests.taskapp.gated_step" and m["held_for"] >= 0
               for m in held["messages"])  # fmt: skip
    named = [task_id for task_id, *_ in [*holders, *waiters, *at_gate]]
    started = [r["task_id"] for r in read_records(tmp / f"steps-{KEY}") if r["at"] == "start"]
    assert started == named  # the order shown is the order they ran

    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    rows = [next(line for line in lines if task_id in line) for task_id in named]
    assert [lines.index(row) for row in rows] == sorted(lines.index(row) for row in rows)
    assert "holder" in rows[0] and "waiter 1" in rows[1] and "waiter 2" in rows[2]
    assert rows[3].split()[:2] == [path, "1"] and rows[4].split()[0] == "2"
    assert all(ungated.nodename in row for row in rows[1:3])
    assert all(gated.nodename in row for row in (rows[0], *rows[3:]))
    print(shown.output)


def held_count(app: Celery, path: str) -> int:
    """Messages the workers' gates hold for ``path`` now."""
    return sum(h.count for h in held_messages(app, timeout=0.5) if h.path == path)
