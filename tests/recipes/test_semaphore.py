"""Semaphore on a real ZooKeeper: at most N holders across processes, herd-free waiting, the
stored limit and its mismatch, and Mutex's acquire contract (try-lock, timeout, no leftovers)."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from celery_zklock import (
    ConfigurationError,
    Lease,
    LockTimeout,
    Mutex,
    Semaphore,
    ZkLockError,
)
from celery_zklock.locks.contenders import LimitMismatch
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.testing.witness import check_witness
from tests.lockutil import children, four_letter, wait_for
from tests.support.semaphores import contend

SPAWN = multiprocessing.get_context("spawn")


def waiters_by_node(hosts: str, client: KazooClient, parent: str) -> dict[str, set[int]]:
    """``wchp``: the sessions watching each child of ``parent``, without the node's own session
    (a holder may watch its own node's data for break requests: that is not a waiter)."""
    watched: dict[str, set[int]] = {}
    current: str | None = None
    for line in four_letter(hosts, "wchp").splitlines():
        if line.startswith("/"):
            current = line.strip() if line.strip().startswith(parent + "/") else None
            if current is not None:
                watched[current] = set()
        elif current is not None and line.strip().startswith("0x"):
            watched[current].add(int(line.strip(), 16))
    for node, sessions in list(watched.items()):
        stat = client.exists(node)
        if stat is not None:
            sessions.discard(stat.ephemeralOwner)
        if not sessions:
            del watched[node]
    return watched


@pytest.fixture
def clients(zk_hosts: str) -> Iterator[list[KazooClient]]:
    """Kazoo clients, one session each, made on demand (``clients.append``) and closed after."""
    made: list[KazooClient] = []
    yield made
    for client in made:
        client.stop()
        client.close()


def new_client(made: list[KazooClient], hosts: str) -> KazooClient:
    client = KazooClient(hosts, timeout=10)
    client.start(timeout=15)
    made.append(client)
    return client


def test_layout_limit_token_and_release(zk_client: KazooClient, lock_root: str) -> None:
    path = f"{lock_root}/exports"
    lease = Semaphore(zk_client, path, max_leases=3).acquire(timeout=5)
    (name,) = children(zk_client, path)
    # Curator's InterProcessSemaphore (v1): a protected mutex-named node
    assert re.fullmatch(r"_c_[0-9a-f-]{36}-lock-\d{10}", name)
    assert lease.node == f"{path}/{name}" and lease.kind == "lease"
    stat = zk_client.exists(lease.node)
    assert stat is not None and lease.token == stat.czxid
    data, parent = zk_client.get(path)
    assert data == b"max_leases=3" and parent.ephemeralOwner == 0  # stored with the lock
    lease.release()
    assert children(zk_client, path) == []
    wait_for(lambda: zk_client.exists(path) is None, 10, "the container to be reaped")


def test_twelve_processes_never_more_than_three_at_once(
    zk_hosts: str, zk_client: KazooClient, lock_root: str, tmp_path: Path
) -> None:
    """12 OS processes, one session each, 8 leases each of N=3: the witness never sees a 4th
    holder and does see 3; a node is watched by at most N waiters at any sample (1 while
    releases follow the queue order, see tests/unit/test_contenders.py); nothing is left."""
    witness = tmp_path / "witness"
    start = SPAWN.Event()
    procs = [
        SPAWN.Process(
            target=contend,
            args=(zk_hosts, lock_root, 3, 8, 0.02, str(witness), f"p{i}", start, i),
        )
        for i in range(12)
    ]
    for proc in procs:
        proc.start()
    most_waiters = 0
    samples = 0
    try:
        start.set()
        while any(proc.is_alive() for proc in procs):
            watched = waiters_by_node(zk_hosts, zk_client, lock_root)
            most_waiters = max([most_waiters, *map(len, watched.values())])
            samples += 1
            for proc in procs:
                proc.join(0.05)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [p.exitcode for p in procs] == [0] * 12
    report = check_witness(witness)
    print(f"semaphore N=3: {report.sections} leases, at most {report.max_readers} at once, "
          f"at most {most_waiters} waiter(s) per node in {samples} samples")  # fmt: skip
    assert report.sections == 96 and report.unfinished == []
    assert report.max_readers == 3
    assert samples > 0 and most_waiters <= 3
    tokens = [int(m[2]) for m in re.finditer(r"^enter (\S+)-t(\d+) ", witness.read_text(), re.M)]
    by_process: dict[str, list[int]] = {}
    for m in re.finditer(r"^enter (p\d+)-\d+-t(\d+) ", witness.read_text(), re.M):
        by_process.setdefault(m[1], []).append(int(m[2]))
    assert len(set(tokens)) == len(tokens) == 96  # every lease its own token
    assert all(t == sorted(t) for t in by_process.values())  # each process's rise
    assert children(zk_client, lock_root) == []


def test_waiters_watch_only_the_node_n_places_ahead(
    zk_hosts: str, zk_client: KazooClient, lock_root: str, clients: list[KazooClient]
) -> None:
    """3 holders, 12 waiters on their own sessions: each of the first 12 nodes is watched by
    exactly one waiter, the one 3 places behind it. Leases released in queue order then grant
    the waiters in queue order, one per release, each token above every earlier grant's."""
    limit, waiters = 3, 12
    first = [
        Semaphore(new_client(clients, zk_hosts), lock_root, limit).acquire(timeout=5)
        for _ in range(limit)
    ]
    granted: list[Lease] = []
    errors: list[BaseException] = []
    guard = threading.Lock()
    release_events: dict[str, threading.Event] = defaultdict(threading.Event)

    def release_event(node: str) -> threading.Event:
        with guard:
            return release_events[node]

    def wait_turn(client: KazooClient) -> None:
        try:
            lease = Semaphore(client, lock_root, limit).acquire(timeout=60)
            with guard:
                granted.append(lease)
            release_event(lease.node).wait(60)
            lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=wait_turn, args=(new_client(clients, zk_hosts),))
        for _ in range(waiters)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: len(waiters_by_node(zk_hosts, zk_client, lock_root)) == waiters,
            30,
            "every waiter to watch",
        )
        nodes = [f"{lock_root}/{n}" for n in sorted(children(zk_client, lock_root), key=seq)]
        assert len(nodes) == limit + waiters
        watched = waiters_by_node(zk_hosts, zk_client, lock_root)
        assert sorted(watched) == sorted(nodes[:waiters])  # no node watched twice
        for index, node in enumerate(nodes[:waiters]):
            (session,) = watched[node]
            behind = zk_client.exists(nodes[index + limit])
            assert behind is not None and session == behind.ephemeralOwner  # N places behind
        assert granted == []
        for index, node in enumerate(nodes[:waiters]):
            lease = next((lease for lease in first if lease.node == node), None)
            if lease is not None:
                lease.release()
            else:
                release_event(node).set()
            wait_for(lambda i=index: len(granted) == i + 1, 10, f"grant {index + 1}")
            assert granted[index].node == nodes[index + limit]  # the waiter N places behind
        for node in nodes[waiters:]:
            release_event(node).set()
        for thread in threads:
            thread.join(30)
        assert errors == []
        tokens = [lease.token for lease in granted]
        assert tokens == sorted(tokens) and min(tokens) > max(lease.token for lease in first)
        assert children(zk_client, lock_root) == []
    finally:
        for node in list(release_events):
            release_event(node).set()
        for lease in first:
            lease.release()


def seq(name: str) -> int:
    return int(name[-10:])


def test_try_lock_and_timeout_like_mutex_leave_no_node(
    zk_client: KazooClient, lock_root: str, clients: list[KazooClient], zk_hosts: str
) -> None:
    first = Semaphore(zk_client, lock_root, 2).acquire(blocking=False)
    assert first is not None
    second = Semaphore(new_client(clients, zk_hosts), lock_root, 2).acquire(blocking=False)
    assert second is not None
    full = children(zk_client, lock_root)
    other = Semaphore(new_client(clients, zk_hosts), lock_root, 2)
    assert other.acquire(blocking=False) is None
    assert children(zk_client, lock_root) == full
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        other.acquire(timeout=0.4)
    assert 0.4 <= time.monotonic() - started < 2.0
    assert children(zk_client, lock_root) == full
    with pytest.raises(ValueError, match="timeout"):
        other.acquire(timeout=-1)
    second.release()
    lease = other.acquire(blocking=False)
    assert lease is not None and lease.token > first.token
    lease.release()
    first.release()
    assert children(zk_client, lock_root) == []


def test_a_waiter_is_granted_when_a_lease_goes(
    zk_client: KazooClient, lock_root: str, clients: list[KazooClient], zk_hosts: str
) -> None:
    first = Semaphore(zk_client, lock_root, 2).acquire(timeout=5)
    second = Semaphore(new_client(clients, zk_hosts), lock_root, 2).acquire(timeout=5)
    result: list[Lease] = []
    waiter = threading.Thread(
        target=lambda: result.append(
            Semaphore(new_client(clients, zk_hosts), lock_root, 2).acquire(timeout=30)
        )
    )
    waiter.start()
    wait_for(lambda: len(children(zk_client, lock_root)) == 3, 10, "the waiter's node")
    assert result == []
    first.release()  # the node 2 places ahead of the waiter
    waiter.join(10)
    (lease,) = result
    assert lease.held and lease.token > second.token
    lease.release()
    second.release()


def test_a_different_limit_raises_naming_both_and_leaves_no_node(
    zk_client: KazooClient, lock_root: str, clients: list[KazooClient], zk_hosts: str
) -> None:
    held = Semaphore(zk_client, lock_root, 3).acquire(timeout=5)
    other = new_client(clients, zk_hosts)
    for blocking in (True, False):
        with pytest.raises(LimitMismatch) as caught:
            Semaphore(other, lock_root, 2).acquire(blocking=blocking, timeout=5)
        assert (caught.value.ours, caught.value.stored) == (2, 3)
        assert "max_leases=2" in str(caught.value) and "max_leases=3" in str(caught.value)
        assert isinstance(caught.value, ConfigurationError)
        assert children(zk_client, lock_root) == [held.node.rsplit("/", 1)[1]]
    assert zk_client.get(lock_root)[0] == b"max_leases=3"
    held.release()
    # The limit lives with the lock: once it is gone, another limit may start it afresh.
    wait_for(lambda: zk_client.exists(lock_root) is None, 10, "the container to be reaped")
    with Semaphore(other, lock_root, 2).acquire(timeout=5):
        assert zk_client.get(lock_root)[0] == b"max_leases=2"


def test_first_contenders_that_disagree_one_limit_wins(
    zk_hosts: str, zk_client: KazooClient, lock_root: str, clients: list[KazooClient]
) -> None:
    """8 contenders on a fresh lock at once, limits 2 and 3 alternating: the limit stored is one
    of them, every contender with the other raises, and those with it are granted or busy."""
    path = f"{lock_root}/fresh"
    limits = [2, 3] * 4
    made = [new_client(clients, zk_hosts) for _ in limits]
    barrier = threading.Barrier(len(limits))
    done = threading.Barrier(len(limits))
    outcomes: list[tuple[int, object]] = []

    def contend_once(client: KazooClient, limit: int) -> None:
        barrier.wait()
        try:
            outcome: object = Semaphore(client, path, limit).acquire(blocking=False)
        except BaseException as exc:
            outcome = exc
        outcomes.append((limit, outcome))
        done.wait(30)  # hold until every contender has had its look
        if isinstance(outcome, Lease):
            outcome.release()

    threads = [
        threading.Thread(target=contend_once, args=(c, n))
        for c, n in zip(made, limits, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stored = {limit for limit, outcome in outcomes if not isinstance(outcome, BaseException)}
    assert len(outcomes) == len(limits) and len(stored) == 1
    (winner,) = stored
    for limit, outcome in outcomes:
        if limit == winner:
            assert outcome is None or isinstance(outcome, Lease), outcome
        else:
            assert isinstance(outcome, LimitMismatch) and outcome.stored == winner, outcome
    # at most the limit granted (a loser's node still queued ahead may make a winner busy)
    assert sum(isinstance(o, Lease) for _, o in outcomes) <= winner
    assert children(zk_client, path) == []


def test_a_lock_node_with_other_data_is_refused(zk_client: KazooClient, lock_root: str) -> None:
    zk_client.create(lock_root, b"10.0.0.7", makepath=True)
    with pytest.raises(LimitMismatch, match="not a semaphore limit"):
        Semaphore(zk_client, lock_root, 2).acquire(timeout=5)
    assert children(zk_client, lock_root) == []


def test_connection_drop_during_create_keeps_one_node_and_stores_the_limit(
    zk_client: KazooClient, lock_root: str
) -> None:
    """The create runs but its answer (and the limit's read) is lost: the node is found again
    by its uuid, and the limit is read again and stored."""
    zk_client.ensure_path(lock_root)
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = KazooClient(proxy.address, timeout=10)
        client.start()
        try:
            # The client must know the parent is there (see the mutex's test of this name); a
            # mutex's lease on the path teaches it that without storing a limit.
            Mutex(client, lock_root).acquire(timeout=5).release()
            assert zk_client.get(lock_root)[0] == b""
            proxy.drop_responses = True
            result: list[object] = []
            thread = threading.Thread(
                target=lambda: result.append(Semaphore(client, lock_root, 4).acquire(timeout=20))
            )
            thread.start()
            wait_for(lambda: len(children(zk_client, lock_root)) == 1, 5, "the create to run")
            proxy.drop_responses = False
            assert proxy.cut() == 1
            thread.join(20)
            (lease,) = result
            assert isinstance(lease, Lease)
            assert children(zk_client, lock_root) == [lease.node.rsplit("/", 1)[1]]
            assert zk_client.get(lock_root)[0] == b"max_leases=4"
            lease.release()
            assert children(zk_client, lock_root) == []
        finally:
            client.stop()
            client.close()


def test_reentrant_per_thread_and_not_mixed_with_a_mutex(
    zk_client: KazooClient, lock_root: str
) -> None:
    outer = Semaphore(zk_client, lock_root, 2).acquire(timeout=5)
    inner = Semaphore(zk_client, lock_root, 2).acquire(timeout=5)
    assert inner.node == outer.node and len(children(zk_client, lock_root)) == 1
    with pytest.raises(ZkLockError, match="a semaphore's path is not a mutex's"):
        Mutex(zk_client, lock_root).acquire(timeout=5)
    inner.release()
    assert zk_client.exists(outer.node) is not None
    outer.release()
    assert children(zk_client, lock_root) == []


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3", None])
def test_bad_limits_are_refused(zk_client: KazooClient, bad: object) -> None:
    with pytest.raises(ValueError, match="max_leases must be a whole number >= 1"):
        Semaphore(zk_client, "/x", bad)  # type: ignore[arg-type]
