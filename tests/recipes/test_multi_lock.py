"""MultiLock on real ZooKeeper: all or nothing, one canonical order (no deadlock whatever order
callers list their paths in), one deadline, nothing left behind."""

from __future__ import annotations

import threading
import time

import pytest
from kazoo.client import KazooClient

from celery_zklock import LockLost, LockTimeout, MultiLock, Mutex
from celery_zklock.errors import LossCode
from celery_zklock.locks.multi import MultiLease
from tests.lockutil import children, expire_session, in_thread, wait_for, watches_by_path


@pytest.mark.parametrize("sessions", [12], indirect=True)
def test_opposite_orders_and_single_mutexes_never_deadlock_or_overlap(
    sessions: list[KazooClient], lock_root: str
) -> None:
    """8 sessions take two paths (half listing them one way, half the other) while 4 take a
    Mutex on one path each, 15 rounds: never two holders of a path, all done well within a
    minute."""
    a, b = f"{lock_root}/acct-1", f"{lock_root}/acct-2"
    inside: dict[str, set[int]] = {a: set(), b: set()}
    guard = threading.Lock()
    violations: list[str] = []
    errors: list[BaseException] = []

    def section(paths: list[str], who: int) -> None:
        with guard:
            for path in paths:
                if inside[path]:
                    violations.append(f"{who} beside {inside[path]} on {path}")
                inside[path].add(who)
        time.sleep(0.005)
        with guard:
            for path in paths:
                inside[path].discard(who)

    def multi(client: KazooClient, who: int, paths: list[str]) -> None:
        try:
            lock = MultiLock(client, paths)
            for _ in range(15):
                lease = lock.acquire(timeout=30)
                assert isinstance(lease, MultiLease)
                with lease:
                    section(sorted(paths), who)
        except BaseException as exc:
            errors.append(exc)

    def single(client: KazooClient, who: int, path: str) -> None:
        try:
            for _ in range(15):
                with Mutex(client, path).acquire(timeout=30):
                    section([path], who)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=multi, args=(sessions[i], i, [a, b] if i % 2 else [b, a]))
        for i in range(8)
    ] + [threading.Thread(target=single, args=(sessions[8 + i], 8 + i, [a, b][i % 2]))
         for i in range(4)]  # fmt: skip
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    took = time.monotonic() - started
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert errors == [] and violations == [], (errors, violations)
    assert took < 30, took


def test_a_timeout_over_three_paths_gives_up_within_its_deadline_and_leaves_nothing(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    paths = [f"{lock_root}/p{i}" for i in range(3)]
    with Mutex(other_client, paths[2]).acquire():  # the last in canonical order
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            MultiLock(zk_client, reversed(paths)).acquire(timeout=1)
        took = time.monotonic() - started
        assert took < 1.8, took
        left = {p: children(zk_client, p) for p in paths}
        assert left[paths[0]] == [] and left[paths[1]] == []
        assert len(left[paths[2]]) == 1  # only the other session's node


def test_a_lease_has_a_token_per_path_and_one_release(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    paths = [f"{lock_root}/x", f"{lock_root}/y", f"{lock_root}/x"]
    lease = MultiLock(zk_client, paths).acquire()
    assert lease is not None
    assert set(lease.tokens) == {paths[0], paths[1]}
    assert all(isinstance(token, int) and token > 0 for token in lease.tokens.values())
    assert Mutex(other_client, paths[1]).acquire(blocking=False) is None  # excludes a Mutex
    lease.release()
    taken = Mutex(other_client, paths[1]).acquire(blocking=False)
    assert taken is not None
    taken.release()


def _lose_first_path(cause: str, zk_hosts: str, client: KazooClient, path: str) -> None:
    """End ``client``'s hold on ``path`` from outside: its session expired on the server, or its
    node deleted (as ``celery zklock break --force`` or an operator would)."""
    if cause == "expire":
        expire_session(zk_hosts, client)
    else:
        [node] = children(client, path)
        client.delete(f"{path}/{node}")


@pytest.mark.parametrize("cause", ["expire", "delete"])
@pytest.mark.parametrize("sessions", [3], indirect=True)
def test_a_path_lost_while_waiting_for_the_next_is_taken_again_in_order(
    sessions: list[KazooClient], zk_hosts: str, lock_root: str, cause: str
) -> None:
    """Holding a and waiting for b, the MultiLock loses a (its session expires, or a's node is
    deleted) and a rival is granted a; then b frees. The acquire does not return while the
    rival holds a: it lets b go and queues for a again, and returns once the rival releases,
    every path held under its current session. Before the fix: ``MultiLease(..., lost=True)``
    (expire) or a lease not even marked lost (delete), with the rival still holding a."""
    ours, blocker, rival = sessions
    a, b = f"{lock_root}/a", f"{lock_root}/b"
    held_b = Mutex(blocker, b).acquire(timeout=10)
    lock = MultiLock(ours, [b, a])
    thread, outcome = in_thread(lambda: lock.acquire(timeout=120))
    held_a = None
    try:
        wait_for(
            lambda: len(children(blocker, a)) == 1 and len(children(blocker, b)) == 2,
            what="the MultiLock to hold a and queue for b",
        )
        first_session = ours.client_id[0]
        _lose_first_path(cause, zk_hosts, blocker if cause == "delete" else ours, a)
        held_a = Mutex(rival, a).acquire(timeout=30)
        # After an expiry the wait for b starts over under the new session: let it queue
        # again before b frees, so that b is granted to the MultiLock's wait, not to a try.
        wait_for(lambda: len(children(blocker, b)) == 2, what="the MultiLock to queue for b")
        held_b.release()
        wait_for(
            lambda: bool(outcome) or (len(children(rival, a)) == 2 and not children(rival, b)),
            what="the MultiLock to return or to queue for a again",
        )
        assert not outcome, f"returned while the rival holds {a}: {outcome}"
        assert children(rival, b) == []  # nothing after a is held while a is waited for
        held_a.release()
        thread.join(60)
    finally:
        for held in (held_a, held_b):
            if held is not None:
                held.release()
        thread.join(60)
    assert "error" not in outcome, repr(outcome)
    lease = outcome["value"]
    assert isinstance(lease, MultiLease) and not lease.lost, lease
    assert held_a is not None and lease.tokens[a] > held_a.token
    session = ours.client_id[0]
    assert (session != first_session) == (cause == "expire")
    for one in lease.leases:
        stat = ours.exists(one.node)
        assert stat is not None and stat.ephemeralOwner == session, one
    lease.release()
    assert children(rival, a) == [] and children(rival, b) == []


def test_a_deleted_path_still_held_elsewhere_at_the_deadline_times_out_and_leaves_nothing(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    """As above (a's node deleted, a rival granted a), but the rival keeps a past the deadline:
    LockTimeout at a, and no node of the attempt left on either path. Before the fix: a lease,
    not marked lost, while the rival held a."""
    a, b = f"{lock_root}/a", f"{lock_root}/b"
    held_b = Mutex(other_client, b).acquire(timeout=10)
    lock = MultiLock(zk_client, [a, b])
    thread, outcome = in_thread(lambda: lock.acquire(timeout=10))
    try:
        wait_for(
            lambda: len(children(other_client, a)) == 1 and len(children(other_client, b)) == 2,
            what="the MultiLock to hold a and queue for b",
        )
        _lose_first_path("delete", "", other_client, a)
        with Mutex(other_client, a).acquire(timeout=30) as held_a:
            held_b.release()
            thread.join(60)
            assert not thread.is_alive()
            assert isinstance(outcome.get("error"), LockTimeout), repr(outcome)
            assert lock.path == a  # it timed out waiting for a again
            assert children(other_client, a) == [held_a.node.rsplit("/", 1)[1]]
            assert children(other_client, b) == []
    finally:
        held_b.release()
        thread.join(60)


def test_a_lease_lost_inside_its_block_raises_lock_lost_at_the_exit(
    zk_client: KazooClient, other_client: KazooClient, zk_hosts: str, lock_root: str
) -> None:
    """Like a Lease's block, a MultiLease's block that ends normally after one of its paths was
    lost raises LockLost at the exit, and everything is released. The acquire has set the break
    watch of every path by the time it returns (no clock tick needed to learn of a deletion).
    Before the fix: no watch yet, and the exit only released."""
    a, b = f"{lock_root}/a", f"{lock_root}/b"
    gone = threading.Event()
    lease = MultiLock(zk_client, [a, b]).acquire(timeout=10)
    assert lease is not None
    watches = watches_by_path(zk_hosts)
    for one in lease.leases:
        assert zk_client.client_id[0] in [int(s, 16) for s in watches.get(one.node, [])], one
    with pytest.raises(LockLost, match="deleted by someone else"), lease:
        lease.on_lost(lambda reason: gone.set())
        other_client.delete(lease.leases[0].node)
        assert gone.wait(30), "the deletion was not reported"
    assert lease.lost_code == LossCode.NODE_DELETED
    assert children(other_client, a) == [] and children(other_client, b) == []
