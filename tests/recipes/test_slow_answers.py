"""A held lease outlives ZooKeeper answering late, again and again, as long as each wait stays
within what its lease clock allows (:mod:`celery_zklock.locks.clock`), on a real server paused
with SIGSTOP: the way a server's answers wait behind a slow fsync of its transaction log on a
busy disk (every request waits there, the renewals' ``sync`` too, while it writes anything).

With renewals steady, an answer keeps the lease ``T - R - T/4 - margin`` after its request was
sent, and a renewal goes out every ``R``: a pause shorter than ``T - 2R - T/4 - margin`` costs
nothing. A fresh lease's answers keep it only ``T - T/3 - T/4 - margin``. The pauses here lie
between the two, so the lease survives them only if a pause leaves its renewals steady.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from celery_zklock import Mutex
from celery_zklock.locks.clock import timing_for
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.zookeeper import ZooKeeperServer
from tests.lockutil import wait_for

SESSION_TIMEOUT = 10.0
"""Long enough that each side of the pause's length has 0.4 s to spare on a loaded machine."""


@pytest.fixture
def server(zk_stack_factory: StackFactory) -> ZooKeeperServer:
    """A standalone server of this test's own; the factory stops it, paused or not (a stop
    sends SIGCONT after SIGTERM: ChildProcess.stop)."""
    return zk_stack_factory.server()


@pytest.fixture
def client(server: ZooKeeperServer) -> Iterator[KazooClient]:
    started = KazooClient(server.hosts, timeout=SESSION_TIMEOUT)
    started.start(timeout=15)
    try:
        yield started
    finally:
        started.stop()
        started.close()


def paused(server: ZooKeeperServer, client: KazooClient, seconds: float) -> None:
    """Stop the server for ``seconds`` (its connections stay open, nothing is answered), then
    return once every request the client sent meanwhile is answered (a ``sync`` sent after them
    on the same connection)."""
    pid = server.node.pid
    assert pid is not None
    pause_process(pid)
    try:
        time.sleep(seconds)  # the fault's length, not a wait for something to happen
    finally:
        os.kill(pid, signal.SIGCONT)
    client.sync_async("/").get(timeout=SESSION_TIMEOUT)


def test_a_lease_outlives_late_answers_one_after_the_other(
    server: ZooKeeperServer, client: KazooClient
) -> None:
    """Before: the renewer sent no renewal while one was unanswered, so the one due during the
    pause went out late, at its end; a late renewal restarts the steady count, and the answers
    of the next T/4 + R seconds kept the lease only as long as a fresh one's: the second pause,
    as long as the first, ended it (lease_clock)."""
    timing = timing_for(SESSION_TIMEOUT)
    fresh = timing.valid_until(0.0, renewing_since=None)
    steady = timing.valid_until(0.0, renewing_since=-timing.steady_after)
    pause = (fresh + steady - timing.renew_interval) / 2
    assert fresh + 0.4 < pause < steady - timing.renew_interval - 0.4

    lease = Mutex(client, "/stalls/lock").acquire(timeout=SESSION_TIMEOUT)
    # Renewals steady: an answer now keeps the lease longer than a fresh one's ever does.
    wait_for(lambda: lease.valid_for > fresh, 3 * SESSION_TIMEOUT, "steady renewals")
    for n in (1, 2, 3):
        paused(server, client, pause)
        assert lease.held, f"lost after pause {n} of {pause:.2f}s: {lease.lost_reason}"
    lease.release()
    assert not lease.lost
