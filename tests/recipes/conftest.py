"""Fixtures shared by the recipe tier (``redis_client``, which the tools tier uses too, is in
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from celery_zklock.testing.proxy import TcpProxy


@pytest.fixture
def other_client(zk_hosts: str) -> Iterator[KazooClient]:
    """A second session on the test ZooKeeper (``zk_client``'s is the first): another
    contender, since a second acquire by one thread on one client re-enters its lock."""
    client = KazooClient(zk_hosts, timeout=10)
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


@pytest.fixture
def sessions(request: pytest.FixtureRequest, zk_hosts: str) -> Iterator[list[KazooClient]]:
    """Started sessions on the test ZooKeeper, one contender each: as many as the test's
    ``sessions`` parametrisation says (``indirect``), else 4; stopped and closed after."""
    count = getattr(request, "param", 4)
    clients = [KazooClient(zk_hosts, timeout=10) for _ in range(count)]
    for client in clients:
        client.start(timeout=15)
    yield clients
    for client in clients:
        client.stop()
        client.close()


@pytest.fixture
def proxy(zk_hosts: str) -> Iterator[TcpProxy]:
    """A started :class:`TcpProxy` in front of the test ZooKeeper (its first host); stopped
    after the test."""
    host, _, port = zk_hosts.split(",")[0].rpartition(":")
    with TcpProxy(host, int(port)) as started:
        yield started
