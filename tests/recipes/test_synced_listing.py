"""The listings that decide which nodes of an abandoned attempt to delete come after a ``sync``.

A follower that lags behind the leader may not show yet a node whose create (with an unknown
outcome) went through; a listing without a ``sync`` could miss it, and the node would then live
as long as its session. ``_find_ours`` already synced; ``abandon`` and the orphan purges did not.
The follower-lag rig is not built here: these check, on a real ZooKeeper, that the sync goes out
right before the listing on the same client and that its failure is not ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from celery_zklock.locks.contenders import MUTEX, Contender
from celery_zklock.locks.context import context_for
from celery_zklock.locks.queue import ContenderQueue, OrphanPurge, read_queues
from celery_zklock.zk.calls import Deadline
from tests.lockutil import wait_for

PREFIX = "_c_0f2c9a3e-5b1d-4c7e-9a1f-3d2e4b5c6a7f-"


class SpyClient(KazooClient):
    """Records its syncs, listings and deletes, in the order they are sent; its syncs fail with
    ConnectionLoss while ``fail_syncs`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []
        self.fail_syncs = threading.Event()
        self.failed_sync = threading.Event()

    def sync_async(self, path: str) -> Any:
        self.calls.append(("sync", path))
        if self.fail_syncs.is_set():
            result = self.handler.async_result()
            result.set_exception(ConnectionLoss())
            self.failed_sync.set()
            return result
        return super().sync_async(path)

    def get_children_async(self, path: str, watch: Any = None, include_data: bool = False) -> Any:
        self.calls.append(("list", path))
        return super().get_children_async(path, watch=watch, include_data=include_data)

    def delete_async(self, path: str, version: int = -1) -> Any:
        self.calls.append(("delete", path))
        return super().delete_async(path, version=version)


@pytest.fixture
def spy(zk_hosts: str) -> Iterator[SpyClient]:
    client = SpyClient(zk_hosts, timeout=10)
    client.start(timeout=15)
    try:
        yield client
    finally:
        client.fail_syncs.clear()
        client.stop()
        client.close()


def _orphan(client: SpyClient, parent: str) -> str:
    client.ensure_path(parent)
    node: str = client.create(f"{parent}/{PREFIX}lock-", ephemeral=True, sequence=True)
    client.calls.clear()
    return node


def _on(calls: list[tuple[str, str]], path: str) -> list[tuple[str, str]]:
    return [call for call in calls if call[1] == path or call[1].startswith(f"{path}/")]


def test_abandon_syncs_right_before_its_listing(spy: SpyClient, lock_root: str) -> None:
    """Before the fix: [("list", parent), ("delete", node)]."""
    parent = f"{lock_root}/k"
    node = _orphan(spy, parent)
    ContenderQueue(spy, parent, MUTEX).abandon(PREFIX)
    assert spy.calls == [("sync", parent), ("list", parent), ("delete", node)]
    assert spy.exists(node) is None


def test_abandon_does_not_trust_a_listing_whose_sync_failed(spy: SpyClient, lock_root: str) -> None:
    """The removal goes on in the background, and is done once syncs go through again."""
    parent = f"{lock_root}/k"
    node = _orphan(spy, parent)
    context = context_for(spy)
    spy.fail_syncs.set()
    ContenderQueue(spy, parent, MUTEX).abandon(PREFIX)
    assert (parent, PREFIX) in OrphanPurge.of(context).pending()
    assert spy.exists(node) is not None
    spy.fail_syncs.clear()
    wait_for(lambda: spy.exists(node) is None, 10, "the background purge to remove the node")
    calls = _on(spy.calls, parent)
    assert ("delete", node) in calls
    assert calls[calls.index(("delete", node)) - 2 :][:2] == [("sync", parent), ("list", parent)]


def test_the_orphan_purge_syncs_right_before_its_listing(spy: SpyClient, lock_root: str) -> None:
    """Before the fix: the purge listed without a sync."""
    parent = f"{lock_root}/k"
    node = _orphan(spy, parent)
    purge = OrphanPurge.of(context_for(spy))
    purge.later(parent, PREFIX)
    wait_for(lambda: not purge.pending(), 10, "the purge to finish")
    assert spy.exists(node) is None
    assert _on(spy.calls, parent) == [("sync", parent), ("list", parent), ("delete", node)]


def test_the_queue_reader_syncs_first_and_reads_the_picked_nodes_still_there(
    spy: SpyClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sync ahead of the listings; only the nodes ``pick`` chose are read (the others come
    as listed), a node that went between the listing and its read is left out, and a lock that
    does not exist reads empty."""
    path, missing = f"{lock_root}/k", f"{lock_root}/none"
    spy.ensure_path(path)
    spy.set(path, b"max_leases=3")
    nodes = [
        spy.create(f"{path}/{PREFIX}lock-", b'{"task_id":"t%d"}' % i, ephemeral=True, sequence=True)
        for i in range(4)
    ]
    spy.create(f"{path}/not-a-contender", b"x")
    spy.calls.clear()
    original_get = spy.get_async

    def recorded_get(node: str, watch: Any = None) -> Any:
        spy.calls.append(("get", node))
        return original_get(node, watch=watch)

    monkeypatch.setattr(spy, "get_async", recorded_get)

    def pick(queue: list[Contender]) -> list[Contender]:
        if queue:
            spy.delete(f"{path}/{queue[1].name}")  # goes after the listing, before its read
        return queue[1:]

    read = read_queues(spy, [path, missing], Deadline(10), pick, parent_data=True)
    assert read[1] == (None, [])
    own, found = read[0]
    assert own == b"max_leases=3"
    assert [(f"{path}/{c.name}", c.task_id) for c in found] == [
        (nodes[0], None),  # not picked: as listed
        (nodes[2], "t2"),
        (nodes[3], "t3"),
    ]
    stats = [spy.get(node)[1] for node in nodes[2:]]
    assert [(c.token, c.session) for c in found] == [(0, 0)] + [
        (stat.czxid, stat.ephemeralOwner) for stat in stats
    ]
    assert spy.calls[:2] == [("sync", path), ("list", path)]
    assert ("get", nodes[0]) not in spy.calls and ("get", nodes[1]) in spy.calls
