"""Fixtures shared by the recipe tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client of the test Redis, closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()
