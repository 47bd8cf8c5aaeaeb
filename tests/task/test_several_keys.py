"""A task that locks several keys at once (``lock_key={"key": ["src", "dst"]}``) on a real
worker: it excludes the single-key task of the same lock name on each key, two such tasks
listing the keys in opposite orders do not deadlock, a key listed twice counts once, and a key
lost while the other is waited for is waited for again."""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import Mutex, is_skipped
from celery_zklock.testing.witness import check_witness
from tests.lockutil import children, wait_for, watches_by_path
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
