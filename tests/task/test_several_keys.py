"""A task that locks several keys at once (``lock_key={"key": ["src", "dst"]}``) on a real
worker: it excludes the single-key task of the same lock name on each key, two such tasks
listing the keys in opposite orders do not deadlock, a key listed twice counts once, and a key
lost while the other is waited for is waited for again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import Mutex, ZkLockTask, is_skipped, signals
from celery_zklock.locks import MultiLease
from celery_zklock.task import run as run_module
from celery_zklock.testing.witness import check_witness
from tests.lockutil import children, expire_session, wait_for, watches_by_path
from tests.workerproc import workers


def test_two_keys_exclude_the_single_key_task_on_each_without_deadlock(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section, transfer

    with workers(app, "threads", 1, env, tmp) as (worker,):
        queue = worker.queue
        calls = [
            transfer.apply_async(("a", "b", 0.4), queue=queue),
            gated_section.apply_async(("a", 0.3), queue=queue),
            transfer.apply_async(("b", "a", 0.4), queue=queue),
            gated_section.apply_async(("b", 0.3), queue=queue),
            transfer.apply_async(("a", "a", 0.2), queue=queue),
            transfer.apply_async(("b", "a", 0.2), queue=queue),
        ]
        results = [call.get(timeout=60) for call in calls]
    for key, sections in (("a", 5), ("b", 4)):
        report = check_witness(tmp / f"witness-{key}")
        assert report.sections == sections and report.overlaps == [], (key, report)
    both = {gated_section.lock_path("a"), gated_section.lock_path("b")}
    for result in (results[0], results[2], results[5]):
        tokens = result["tokens"]
        assert set(tokens) == both and all(isinstance(t, int) for t in tokens.values()), tokens
    assert set(results[4]["tokens"]) == {gated_section.lock_path("a")}  # listed twice: once


def test_a_busy_key_skips_naming_its_holder(taskenv: tuple[Celery, dict[str, str], Path]) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section, transfer

    with workers(app, "threads", 1, env, tmp) as (worker,):
        holder = gated_section.apply_async(("y", 3.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-y").exists(), 30, "the holder of y to start")
        skipped = transfer.apply_async(
            ("x", "y", 0.1), queue=worker.queue, zklock={"on_busy": "skip"}
        ).get(timeout=30)
        holder.get(timeout=30)
    assert is_skipped(skipped), skipped
    assert skipped["holder"] == holder.id, skipped
    report = check_witness(tmp / "witness-y")
    assert report.sections == 1 and report.overlaps == [], report
    assert not (tmp / "witness-x").exists()  # x was let go with y busy: no section ran on it


def test_a_key_lost_while_the_other_is_waited_for_is_waited_for_again(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient, zk_hosts: str
) -> None:
    """``transfer`` holds key ka and waits for kb; ka's node is deleted (as ``celery zklock break
    --force`` does) and a rival takes ka; kb frees. The body does not run while the rival holds
    ka: the run queues for ka again, like a single key whose node goes while it waits, and runs
    once the rival releases. Before the fix: the body ran beside the rival (the lease not yet
    known lost) or the run ended ``LockLost`` without its body."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_section, transfer

    ka, kb = gated_section.lock_path("ka"), gated_section.lock_path("kb")
    own_session = zk_client.client_id[0]

    def waits_for_kb(holder: str) -> bool:  # a blocking wait watches the holder; a try does not
        watchers = watches_by_path(zk_hosts).get(holder, [])
        return any(int(session, 16) != own_session for session in watchers)

    with workers(app, "threads", 1, env, tmp) as (worker,):
        held_kb = Mutex(zk_client, kb).acquire(timeout=30)
        call = transfer.apply_async(("ka", "kb", 0.1), queue=worker.queue)
        wait_for(lambda: waits_for_kb(held_kb.node), 60, "the transfer to hold ka, wait for kb")
        [node] = children(zk_client, ka)
        zk_client.delete(f"{ka}/{node}")
        held_ka = Mutex(zk_client, ka).acquire(timeout=30)
        held_kb.release()
        wait_for(
            lambda: (
                call.ready() or (len(children(zk_client, ka)) == 2 and not children(zk_client, kb))
            ),
            60,
            "the transfer to end or to queue for ka again",
        )
        assert not call.ready(), call.result
        assert not (tmp / "witness-ka").exists()  # no body yet
        held_ka.release()
        result = call.get(timeout=60)
    assert result["tokens"][ka] > held_ka.token, result
    for key in ("ka", "kb"):
        report = check_witness(tmp / f"witness-{key}")
        assert report.sections == 1 and report.overlaps == [], (key, report)


def test_keys_lost_after_the_grant_before_the_body_end_the_run_as_one_key_does(
    zk_hosts: str, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keys granted, then lost before the body starts (the session expired on the server
    between acquire and the run's look at the lease): as for one key
    (``test_task_release``), the body does not run on the lost leases, ``lock_on_lost`` applies
    (``retry``: Celery's eager retry runs it again), and both grants are released."""
    app = Celery("several-lost", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    real = run_module.MultiLock
    lost: list[MultiLease] = []

    class LosesTheFirstGrant:
        def __init__(self, client: KazooClient, paths: list[str], **kwargs: Any) -> None:
            self._side, self._client = real(client, paths, **kwargs), client

        def __getattr__(self, name: str) -> Any:
            return getattr(self._side, name)

        def acquire(self, **kwargs: Any) -> MultiLease | None:
            lease: MultiLease | None = self._side.acquire(**kwargs)
            if lease is not None and not lost:
                lost.append(lease)
                gone = threading.Event()
                lease.on_lost(lambda reason: gone.set())
                expire_session(zk_hosts, self._client)
                assert gone.wait(30), "the leases were not declared lost"
            return lease

    monkeypatch.setattr(run_module, "MultiLock", LosesTheFirstGrant)
    runs: list[tuple[int, dict[str, int]]] = []
    released: list[object] = []

    @app.task(
        bind=True, base=ZkLockTask, lock_key={"key": ["src", "dst"]}, lock_on_lost="retry",
        max_retries=1, lazy=False,
    )  # fmt: skip
    def both(self: Any, src: str, dst: str) -> str:
        runs.append((self.request.retries, dict(self.lock.tokens)))
        return "ran"

    def on_released(sender: Any, token: object = None, **_: Any) -> None:
        if sender is both:
            released.append(token)

    signals.lock_released.connect(on_released, weak=False)
    try:
        value = both.apply(("x", "y")).get()
    finally:
        signals.lock_released.disconnect(on_released)
    assert value == "ran"
    assert [retries for retries, _ in runs] == [1]  # the body never ran on the lost leases
    assert lost[0].lost and len(lost[0].tokens) == 2
    first, second = tuple(lost[0].tokens.values()), tuple(runs[0][1].values())
    assert released == [first, second]  # both grants released
    for path in runs[0][1]:
        assert children(zk_client, path) == []
