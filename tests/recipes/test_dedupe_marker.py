"""The enqueue-time dedupe marker (celery_zklock.task.dedupe) on a real ZooKeeper: one winner among
concurrent claimers, release by its owner only, a stale marker replaced by exactly one caller,
and TTL nodes where the server enables them."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from celery import states
from kazoo.client import KazooClient

from celery_zklock.task.dedupe import Marker, claim, marker_path, release
from celery_zklock.testing.plugin import StackFactory
from tests.lockutil import wait_for


def pending(_: str) -> str:
    return states.PENDING


def over_if_dead(task_id: str) -> str:
    return states.FAILURE if task_id == "dead" else states.PENDING


def _claim_together(
    hosts: str, path: str, count: int, owner_state: Callable[[str], str] = pending
) -> list[str]:
    """``count`` clients claim ``path`` at the same moment; each one's answer."""
    clients = [KazooClient(hosts=hosts) for _ in range(count)]
    for client in clients:
        client.start(timeout=15)
    ids = [f"task-{i}" for i in range(count)]
    answers: list[str | None] = [None] * count
    go = threading.Barrier(count)

    def one(i: int) -> None:
        go.wait()
        answers[i] = claim(clients[i], path, ids[i], "queued", 60.0, owner_state)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for client in clients:
        client.stop()
        client.close()
    return [ids[i] if answer is None else answer for i, answer in enumerate(answers)]


@pytest.fixture
def path(lock_root: str) -> str:
    return f"{lock_root}/dedupe/key-{uuid.uuid4().hex[:8]}"


def test_one_winner_among_concurrent_claimers(zk_hosts: str, path: str) -> None:
    owners = _claim_together(zk_hosts, path, 8)
    assert len(set(owners)) == 1  # every caller names the same owner: the one that won


def test_only_the_owner_releases_and_then_a_new_call_wins(
    zk_client: KazooClient, path: str
) -> None:
    assert claim(zk_client, path, "a", "running", 60.0, pending) is None
    assert claim(zk_client, path, "b", "running", 60.0, pending) == "a"
    assert claim(zk_client, path, "a", "running", 60.0, pending) is None  # a retry of a
    assert not release(zk_client, path, "b")
    assert zk_client.exists(marker_path(path)) is not None
    assert release(zk_client, path, "a")
    assert zk_client.exists(marker_path(path)) is None
    assert claim(zk_client, path, "b", "running", 60.0, pending) is None


def test_a_marker_whose_owner_is_over_or_too_old_no_longer_counts(
    zk_client: KazooClient, path: str
) -> None:
    assert claim(zk_client, path, "a", "queued", 60.0, pending) is None
    # The owner finished (its marker was not removed: say its worker died after storing it).
    assert claim(zk_client, path, "b", "queued", 60.0, lambda _: states.SUCCESS) is None
    raw, _ = zk_client.get(marker_path(path))
    found = Marker.decode(raw)
    assert found is not None and found.task_id == "b"
    # Too old by the writer's clock: the bound when neither the server nor the backend can tell.
    old = Marker("b", "queued", 0.0).encode()
    zk_client.set(marker_path(path), old)
    assert claim(zk_client, path, "c", "queued", 60.0, pending) is None


def test_two_callers_judging_a_marker_stale_never_both_win(zk_hosts: str, path: str) -> None:
    client = KazooClient(hosts=zk_hosts)
    client.start(timeout=15)
    try:
        for round_ in range(10):
            key = f"{path}-{round_}"
            assert claim(client, key, "dead", "queued", 60.0, pending) is None
            # Every claimer sees the dead owner's run over: each tries a versioned replace.
            owners = _claim_together(zk_hosts, key, 6, owner_state=over_if_dead)
            winners = {o for o in owners if o != "dead"}
            assert len(winners) == 1, owners
    finally:
        client.stop()
        client.close()


@pytest.fixture
def ttl_server(zk_stack_factory: StackFactory) -> Iterator[str]:
    server = zk_stack_factory.server(extra_jvm_flags=("-Dzookeeper.extendedTypesEnabled=true",))
    yield server.hosts


def test_markers_are_ttl_nodes_where_the_server_has_them(ttl_server: str) -> None:
    client = KazooClient(hosts=ttl_server)
    client.start(timeout=15)
    try:
        path = "/dedupe-ttl/key"
        assert claim(client, path, "a", "queued", 1.0, pending) is None
        assert client.exists(marker_path(path)) is not None
        # Nobody removes it: the server does, once its TTL passed (its reaper runs every 300 ms).
        wait_for(lambda: client.exists(marker_path(path)) is None, 15, "the TTL to pass")
        assert claim(client, path, "b", "queued", 60.0, pending) is None
    finally:
        client.stop()
        client.close()
