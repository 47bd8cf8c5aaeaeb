"""lock_mode="semaphore" with lock_limit: at most N runs per key on real prefork workers, other
keys unaffected; the busy policies, revocation on loss and the signals through the same run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import (
    ConfigurationError,
    LockBusy,
    LockLost,
    LockTimeout,
    ZkLockTask,
    is_skipped,
    signals,
)
from celery_zklock.testing.celery_worker import stop_all
from celery_zklock.testing.witness import check_witness
from tests.lockutil import expire_session, expire_session_id, task_client, wait_for
from tests.task.test_task_delivery import all_deliveries_ended, decided
from tests.taskapp import read_records
from tests.workerproc import STOP_GRACE, Worker, contenders, start_worker, workers


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("semaphore-direct", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


@pytest.fixture
def prefork4(taskenv: tuple[Celery, dict[str, str], Path]) -> Iterator[list[Worker]]:
    """Two prefork workers of concurrency 4, consuming q0 and q1."""
    app, env, tmp = taskenv
    fleet: list[Worker] = []
    try:
        for i in range(2):
            fleet.append(
                start_worker(app, "prefork", f"s{i}-prefork", env, tmp, f"q{i}", concurrency=4)
            )
        yield fleet
    finally:
        stop_all(fleet, STOP_GRACE)


def test_at_most_two_per_key_and_other_keys_unaffected(
    taskenv: tuple[Celery, dict[str, str], Path], prefork4: list[Worker], zk_client: KazooClient
) -> None:
    """24 runs over keys a and b on 8 pool processes: each key's witness never sees a third run
    and sees two; the witness of both keys sees four at once (both keys at two together)."""
    _, _, tmp = taskenv
    from tests.taskapp import limited_section

    results = [
        limited_section.apply_async(("ab"[i % 2], 0.3), queue=f"q{i // 2 % 2}") for i in range(24)
    ]
    values = [r.get(timeout=90) for r in results]
    assert all(r.state == "SUCCESS" for r in results)
    assert not any(is_skipped(v) for v in values)  # lock_on_busy="wait"
    assert len({v["token"] for v in values}) == 24
    assert len({v["pid"] for v in values}) > 2  # really spread over pool processes
    for key in "ab":
        report = check_witness(tmp / f"witness-limited-{key}")
        assert report.sections == 12 and report.unfinished == []
        assert report.max_readers == 2, (key, report)
    both = check_witness(tmp / "witness-all")
    assert both.sections == 24 and both.max_readers == 4
    wait_for(lambda: not zk_client.exists("/taskapp/limited"), 15, "the lock parents to go")


def test_skip_when_full_revocation_on_loss_frees_a_slot(
    taskenv: tuple[Celery, dict[str, str], Path], prefork4: list[Worker], zk_hosts: str
) -> None:
    """Two runs hold key h; a third is skipped naming a holder. The session of one holder is
    expired from outside: that run ends LockLost, the other keeps running, and the freed slot
    is granted to the next call."""
    _, _, tmp = taskenv
    from tests.taskapp import limited_held

    holders = [limited_held.apply_async(("h", 60.0), queue=f"q{i}") for i in range(2)]
    wait_for(lambda: len(read_records(tmp / "starts-h")) == 2, 30, "two runs to hold key h")
    skipped = limited_held.apply_async(("h", 0.1), queue="q0").get(timeout=30)
    assert is_skipped(skipped) and skipped["reason"] == "busy"
    assert skipped["holder"] in {h.id for h in holders}
    victim = next(r for r in read_records(tmp / "starts-h") if r["task_id"] == holders[0].id)
    expire_session_id(zk_hosts, victim["session_id"], bytes.fromhex(victim["password"]))
    with pytest.raises(LockLost):
        holders[0].get(timeout=30, propagate=True)
    assert [r["task_id"] for r in read_records(tmp / "lost-events")] == [holders[0].id]
    newcomer = limited_held.apply_async(("h", 0.1), queue="q1")
    assert not is_skipped(newcomer.get(timeout=30))  # the lost run's slot, next to the other
    assert holders[1].state == "STARTED" or not holders[1].ready()
    (tmp / "release-h").touch()
    assert holders[1].get(timeout=30)["token"] > 0
    tokens = [r["token"] for r in read_records(tmp / "starts-h")]
    assert len(tokens) == 3 and tokens[2] > max(tokens[:2])


def test_busy_policies_signals_and_loss_in_process(app: Celery, zk_hosts: str) -> None:
    """Direct calls in threads of one process (one session): two hold, the third is skipped,
    raises or times out as asked; a per-call limit is refused; the session's loss ends both
    bodies with LockLost; acquired/busy/lost/released are sent with mode 'semaphore'."""
    sent: list[tuple[str, dict[str, Any]]] = []
    guard = threading.Lock()

    def receiver(name: str) -> Any:
        def receive(sender: Any, **fields: Any) -> None:
            with guard:
                sent.append((name, fields))

        return receive

    receivers = {
        name: receiver(name)
        for name in ("lock_acquired", "lock_busy", "lock_lost", "lock_released")
    }
    for name, receive in receivers.items():
        getattr(signals, name).connect(receive, weak=False)
    inside = threading.Semaphore(0)
    leave = threading.Event()
    clients: list[KazooClient] = []

    @app.task(
        bind=True, base=ZkLockTask, lock_key=["n"], lock_mode="semaphore", lock_limit=2,
        lock_on_busy="skip", lazy=False,
    )  # fmt: skip
    def limited(self: Any, n: int) -> str:
        clients.append(task_client(self))
        inside.release()
        while not leave.is_set():  # interruptible: the revocation lands between these waits
            leave.wait(0.01)
        return "ran"

    outcomes: list[BaseException | str] = []

    def run() -> None:
        try:
            outcomes.append(limited(1))
        except BaseException as exc:
            outcomes.append(exc)

    runners = [threading.Thread(target=run) for _ in range(2)]
    try:
        for runner in runners:
            runner.start()
            assert inside.acquire(timeout=10)
        skipped = limited(1)
        assert is_skipped(skipped) and skipped["reason"] == "busy"
        with pytest.raises(LockBusy, match="is held"):
            limited.apply((1,), zklock={"on_busy": "raise"}).get()
        with pytest.raises(LockTimeout):
            limited.apply((1,), zklock={"on_busy": "wait", "timeout": 0.3}).get()
        with pytest.raises(ConfigurationError, match="fixed by the task"):
            limited.apply((1,), zklock={"limit": 3})
        expire_session(zk_hosts, clients[0])  # both holders' session: both bodies interrupted
        for runner in runners:
            runner.join(10)
    finally:
        leave.set()
        for runner in runners:
            runner.join(10)
        for name, receive in receivers.items():
            getattr(signals, name).disconnect(receive)
    assert len(outcomes) == 2 and all(isinstance(o, LockLost) for o in outcomes), outcomes
    names = [name for name, _ in sent]
    assert names.count("lock_acquired") == 2 and names.count("lock_busy") == 3
    assert names.count("lock_lost") == 2 and names.count("lock_released") == 2
    acquired = [fields for name, fields in sent if name == "lock_acquired"]
    assert all(f["mode"] == "semaphore" for f in acquired)
    assert acquired[0]["token"] != acquired[1]["token"]
    busy = [fields["policy"] for name, fields in sent if name == "lock_busy"]
    assert busy == ["skip", "raise", "wait"]


def test_copy_of_a_semaphore_original_never_runs_beside_it(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """A copy of a running message (Redis visibility timeout) fits in the semaphore's second
    slot: granted, it looks ahead of its node, finds its original and is ignored while the
    original runs (it would run its body beside it after a 2 s look for a result otherwise)."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late_limited

    # Without the gate: with a 1 s visibility timeout it gives every held copy back to the
    # broker at 0.8 s, again and again while the original runs, so no copy would wait in the
    # queue beside the original, which is the case under test.
    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "1", "ZKLOCK_GATE": "false"}
    with workers(app, "threads", 1, env, tmp, prefix="dupsem") as (worker,):
        original = acked_late_limited.apply_async(("sem", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-sem"), 30, "the original to start")
        wait_for(
            lambda: (
                decided(worker, original.id, ("duplicate-ignored",)) >= 1
                or len(read_records(tmp / "starts-sem")) > 1
            ),
            30,
            "a copy to be ignored or to run",
        )
        assert decided(worker, original.id, ("same-delivery-waits",)) >= 1
        (tmp / "release-sem").touch()
        assert original.get(timeout=60)["token"] > 0
        wait_for(lambda: all_deliveries_ended(worker, original.id), 60, "every copy")
    assert [s["task_id"] for s in read_records(tmp / "starts-sem")] == [original.id]
    wait_for(lambda: not contenders(zk_client, "late_limited"), 10, "the lock nodes to go")
