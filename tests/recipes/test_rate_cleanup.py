"""RateLimit leaves no node behind on an idle key, on real ZooKeeper: TTL admissions go by the
server where it enables them, persistent ones by the deciding process's sweep (or the next
decision when that process stopped its client); the decision lock and the key's containers go
after them. Old and new versions deciding on one key stay within N."""

from __future__ import annotations

import threading
import time

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import ZnodeStat

from celery_zklock import RateLimit
from celery_zklock.locks.rate import (
    ADMISSION_PREFIX,
    LISTING_BOUND,
    RATE_NODE,
    TTL_ADMISSION_PREFIX,
    Sweeper,
)
from celery_zklock.testing.plugin import StackFactory
from tests.lockutil import children, wait_for
from tests.recipes import rate_before_42
from tests.recipes.test_rate_faults import most_in_any_window_ms, ttl_server

CHECK_INTERVAL = 0.3
"""The test servers' ``znode.container.checkIntervalMs``, in seconds."""


def idle_bound(period: float, levels: int, ttl: bool) -> float:
    """The module docstring's bound on an idle key's nodes: the period, plus the sweep margin
    or the TTL's extra, plus one reaper round for the admissions and one per container level
    (the decision lock's included). Only a hang guard here: ``wait_for`` waits at least its
    floor, as a loaded machine may be slower than the bound (the bound is ZooKeeper's)."""
    extra = LISTING_BOUND if ttl else 1.0
    return period + extra + (levels + 1) * CHECK_INTERVAL


def started(hosts: str) -> KazooClient:
    client = KazooClient(hosts, timeout=10)
    client.start(timeout=15)
    return client


def admission_stats(client: KazooClient, path: str) -> dict[str, ZnodeStat]:
    """The admission nodes under ``path`` by name, with their stats."""
    found = {}
    for name in children(client, path):
        stat = client.exists(f"{path}/{name}")
        if name.startswith(ADMISSION_PREFIX) and stat is not None:
            found[name] = stat
    return found


def test_an_idle_key_leaves_no_node_where_the_server_has_no_ttl_nodes(
    zk_client: KazooClient, lock_root: str
) -> None:
    """As the task layer lays it out (``<root>/<name>/<key>/rate``): five admissions and a
    refusal on ``5/s``, then nothing. The admissions are persistent (this server has no TTL
    nodes); the process sweeps them once old, and the server reaps the decision lock, the rate
    node, the key and the name (containers). Bounded by :func:`idle_bound` (the wait's floor is
    the hang guard)."""
    key = f"{lock_root}/name/key"
    limit = RateLimit(zk_client, f"{key}/{RATE_NODE}", "5/s")
    for _ in range(5):
        assert limit.acquire(blocking=False)
    assert limit.acquire(blocking=False) is False
    names = admission_stats(zk_client, f"{key}/{RATE_NODE}")
    assert len(names) == 5 and not any(n.startswith(TTL_ADMISSION_PREFIX) for n in names), names
    assert f"{key}/{RATE_NODE}" in Sweeper.of(zk_client).pending()
    wait_for(
        lambda: zk_client.exists(f"{lock_root}/name") is None,
        idle_bound(1.0, levels=4, ttl=False),
        "the idle key's nodes to go",
    )
    assert Sweeper.of(zk_client).pending() == {}


def test_a_stopped_deciders_admissions_go_with_the_next_decision(
    zk_hosts: str, zk_client: KazooClient, lock_root: str
) -> None:
    """A process that stopped its client before its sweep leaves its admissions; the next
    decision on the key (another process) removes them once old, and its own sweep the rest."""
    path = f"{lock_root}/key/{RATE_NODE}"
    gone = started(zk_hosts)
    assert RateLimit(gone, path, "2/s").acquire(blocking=False)
    made_at = RateLimit(gone, path, "2/s").admissions()[0]
    gone.stop()
    gone.close()
    limit = RateLimit(zk_client, path, "2/s")
    # Decide again until the stopped one's admission is a period old: it is then deleted.
    while True:
        assert limit.acquire(timeout=30)
        if limit.admitted_at - made_at >= 1.0:  # type: ignore[operator]
            break
    left = {stat.ctime for stat in admission_stats(zk_client, path).values()}
    assert round(made_at * 1000) not in left, (made_at, left)
    wait_for(
        lambda: zk_client.exists(f"{lock_root}/key") is None,
        idle_bound(1.0, levels=3, ttl=False),
        "the idle key's nodes to go",
    )


def test_an_idle_key_leaves_no_node_where_the_server_has_ttl_nodes(
    zk_stack_factory: StackFactory,
) -> None:
    """On a server with ``zookeeper.extendedTypesEnabled=true`` admissions are TTL nodes of one
    period plus LISTING_BOUND, and the server removes them with no client left: the deciding
    client is stopped at once (it has no sweep to do)."""
    ttl_hosts = ttl_server(zk_stack_factory)
    client = started(ttl_hosts)
    key = "/rate-ttl/name/key"
    path = f"{key}/{RATE_NODE}"
    try:
        limit = RateLimit(client, path, "5/s")
        for _ in range(3):
            assert limit.acquire(blocking=False)
        names = admission_stats(client, path)
        assert len(names) == 3 and all(n.startswith(TTL_ADMISSION_PREFIX) for n in names), names
        assert Sweeper.of(client).pending() == {}
    finally:
        client.stop()
        client.close()
    watcher = started(ttl_hosts)
    try:
        wait_for(
            lambda: watcher.exists("/rate-ttl") is None,
            idle_bound(1.0, levels=5, ttl=True),
            "the idle key's nodes to go",
        )
    finally:
        watcher.stop()
        watcher.close()


@pytest.mark.parametrize("ttl", [False, True], ids=["persistent", "ttl"])
def test_old_and_new_versions_deciding_on_one_key_stay_within_n(
    ttl: bool, zk_hosts: str, zk_stack_factory: StackFactory
) -> None:
    """A deploy: two sessions of the version before issue 42 (persistent admissions, no lock
    check, no sweep) and two of this one call ``acquire`` on one ``5/s`` key for 3 s: at most
    5 admission ``ctime``s in any ``[t, t + 1 s)``, each version admitted at least once; then a
    last decision of the new version, and the key's nodes (the old version's persistent ones
    too) all go."""
    hosts = ttl_server(zk_stack_factory) if ttl else zk_hosts
    clients = [started(hosts) for _ in range(4)]
    root = f"/rate-mixed-{ttl}-{time.monotonic_ns()}"
    path = f"{root}/key/{RATE_NODE}"
    admitted: dict[str, list[int]] = {"old": [], "new": []}
    guard = threading.Lock()
    end = time.monotonic() + 3.0

    def caller(client: KazooClient, version: str) -> None:
        kind = rate_before_42.RateLimit if version == "old" else RateLimit
        limit = kind(client, path, "5/s")
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 or not limit.acquire(timeout=remaining):
                return
            with guard:
                admitted[version].append(round(limit.admitted_at * 1000))

    try:
        threads = [
            threading.Thread(target=caller, args=(c, "old" if i % 2 else "new"))
            for i, c in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
        every = admitted["old"] + admitted["new"]
        shown = sorted(c - min(every) for c in every)
        assert most_in_any_window_ms(every, 1000) <= 5, shown
        assert admitted["old"] and admitted["new"], admitted
        for client in clients[1::2]:  # the old version's processes are gone
            client.stop()
        RateLimit(clients[0], path, "5/s").acquire(blocking=False)
        wait_for(
            lambda: clients[0].exists(root) is None,
            idle_bound(1.0, levels=4, ttl=ttl),
            "the mixed key's nodes to go",
        )
    finally:
        for client in clients:
            client.stop()
            client.close()
