"""MultiLock on real ZooKeeper: all or nothing, one canonical order (no deadlock whatever order
callers list their paths in), one deadline, nothing left behind."""

from __future__ import annotations

import threading
import time

import pytest
from kazoo.client import KazooClient

from celery_zklock import LockTimeout, MultiLock, Mutex
from celery_zklock.locks.multi import MultiLease
from tests.lockutil import children


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
