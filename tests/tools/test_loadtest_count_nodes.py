"""The load test's count of the nodes a run left behind (``workers.loadtest.count_nodes``), on
real ZooKeeper beside a real :class:`~celery_zklock.RateLimit`."""

from __future__ import annotations

from kazoo.client import KazooClient

from celery_zklock import RateLimit
from workers.loadtest import count_nodes


def test_the_fault_runs_count_no_admission_as_left_behind(
    zk_client: KazooClient, lock_root: str
) -> None:
    """A rate-limited key keeps its admissions for a period by design: the load test's count of
    nodes locks left behind leaves them (and a lock node kept only by them) out, and still
    counts a contender left beside them."""
    key = f"{lock_root}/name/key"
    assert RateLimit(zk_client, f"{key}/rate", "5/s").acquire(blocking=False)
    assert count_nodes(zk_client, lock_root) == 0
    zk_client.create(f"{key}/_c_left-lock-", sequence=True)  # a contender left behind
    assert count_nodes(zk_client, lock_root) == 3  # it, and the key and name nodes above it
