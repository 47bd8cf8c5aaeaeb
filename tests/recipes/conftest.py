"""Fixtures shared by the recipe tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kazoo.client import KazooClient


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client of the test Redis, closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def other_client(zk_hosts: str) -> Iterator[KazooClient]:
    """A second session on the test ZooKeeper (``zk_client``'s is the first): another
    contender, since a second acquire by one thread on one client re-enters its lock."""
    client = KazooClient(zk_hosts, timeout=10)
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()
