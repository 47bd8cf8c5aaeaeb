"""A copy waiting for its dead original's node does not decide on a lagging follower's view.

Another delivery of a task whose original holds a node waits up to the dead-holder bound for that
node to go (``delivery.wait_gone``), then is ignored as a duplicate if it is still there. CI
failed once at double load on the all-faults ensemble run with ``lost=1``: a pool process was
killed holding the lock; its node went 4 s later (a waiter elsewhere got the lock then), but the
redelivered copy's server still showed the node 7 s after the kill, so the copy was ignored and
the task never ran. The copy's server was a follower behind its leader. The verdict now follows a
``sync``: here the copy's follower is cut off from the leader, so it cannot catch up, and the
node's deletion on the leader must not read as "still there".
"""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock.errors import ZooKeeperUnavailable
from celery_zklock.task.delivery import wait_gone
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.zookeeper import partition_unavailable_reason

NODE = "/delivery-follower/original"


@pytest.mark.slow
@pytest.mark.ensemble
def test_a_followers_stale_view_of_a_deleted_node_is_not_the_verdict(
    zk_stack_factory: StackFactory,
) -> None:
    reason = partition_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot cut a ZooKeeper member off here: {reason}")
    ensemble = zk_stack_factory.ensemble(
        3, tick_time_ms=1000, sync_limit_ticks=5, init_limit_ticks=5, isolatable=True
    )
    leader = ensemble.leader()
    follower = next(node.myid for node in ensemble.nodes if node.myid != leader)
    holder = KazooClient(hosts=f"127.0.0.1:{ensemble.node(leader).port}", timeout=10)
    copy = KazooClient(hosts=f"127.0.0.1:{ensemble.node(follower).port}", timeout=10)
    holder.start(timeout=15)
    copy.start(timeout=15)
    try:
        holder.create(NODE, b"", makepath=True)
        copy.sync(NODE)
        assert copy.exists(NODE) is not None
        ensemble.isolate(follower)
        holder.delete(NODE)  # committed by the leader and the other follower
        # The cut-off follower serves its clients until it notices (5 ticks): a stale view.
        assert copy.exists(NODE) is not None, "the follower saw the delete: nothing to test"
        try:
            verdict = wait_gone(copy, NODE, 1.0)
        except (ZooKeeperUnavailable, KazooException):
            verdict = None  # cannot tell: the run retries under its unavailable policy
        assert verdict is not False, "a follower's stale view decided that the node is there"
    finally:
        ensemble.heal(follower)
        for client in (copy, holder):
            client.stop()
            client.close()
