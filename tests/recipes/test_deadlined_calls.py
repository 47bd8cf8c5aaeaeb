"""No library call waits on ZooKeeper without a deadline (issue 44, Deliver 2), on a real
ZooKeeper that stops answering: the recipe-level calls that used kazoo's synchronous API
(``participant_nodes``, ``attempt_revoke``, ``on_revoke``, the dedupe marker's ``claim`` and
``release``) raise ``ZooKeeperUnavailable`` within their deadlines, and a dedupe marker that
reached ZooKeeper after its caller gave up never blocks its key."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from celery import states
from kazoo.client import KazooClient

from celery_zklock import Mutex, ZooKeeperUnavailable
from celery_zklock.locks import attempt_revoke, on_revoke
from celery_zklock.locks.queue import PARTICIPANTS_TIMEOUT
from celery_zklock.locks.revoke import REVOKE_TIMEOUT
from celery_zklock.task.dedupe import Marker, claim, marker_path, release
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.zookeeper import ZooKeeperServer
from celery_zklock.zk.settings import DEFAULT_DEDUPE_TIMEOUT
from tests.lockutil import in_thread, wait_for

#: Slack over a call's own deadline: its last wait slice, a thread switch, a loaded machine.
SLACK = 1.5


def pending(_: str) -> str:
    return states.PENDING


@pytest.fixture
def server(zk_stack_factory: StackFactory) -> ZooKeeperServer:
    """A standalone server of this test's own; the factory stops it, paused or not (a stop
    sends SIGCONT after SIGTERM: ChildProcess.stop)."""
    return zk_stack_factory.server()


@pytest.fixture
def client(server: ZooKeeperServer) -> Iterator[KazooClient]:
    started = KazooClient(server.hosts, timeout=10.0)
    started.start(timeout=15)
    try:
        yield started
    finally:
        started.stop()
        started.close()


def pause(server: ZooKeeperServer) -> None:
    """SIGSTOP the server: connections stay open and nothing answers (a GC pause, a stalled
    host), so the client still counts itself connected for up to 2/3 of its session timeout."""
    pid = server.node.pid
    assert pid is not None
    pause_process(pid)


def resume(server: ZooKeeperServer) -> None:
    pid = server.node.pid
    assert pid is not None
    os.kill(pid, signal.SIGCONT)


def test_calls_raise_within_their_deadline_when_zookeeper_stalls(
    server: ZooKeeperServer, client: KazooClient
) -> None:
    """Before: each of these waited for as long as the server stayed paused (the synchronous
    ``get``/``set``/``get_children`` of kazoo, and ``DataWatch``'s first read)."""
    path = f"/deadlined/{uuid.uuid4().hex[:8]}"
    mutex = Mutex(client, path)
    lease = mutex.acquire(timeout=5)
    assert mutex.participant_nodes()  # answered while the server runs
    calls: dict[str, tuple[Callable[[], object], float]] = {
        "participant_nodes": (mutex.participant_nodes, PARTICIPANTS_TIMEOUT),
        "attempt_revoke": (lambda: attempt_revoke(client, lease.node), REVOKE_TIMEOUT),
        "on_revoke": (lambda: on_revoke(client, lease, lambda _: None), REVOKE_TIMEOUT),
        "claim": (
            lambda: claim(client, path, "t1", "queued", 60.0, pending),
            DEFAULT_DEDUPE_TIMEOUT,
        ),
        "release": (lambda: release(client, path, "t1"), DEFAULT_DEDUPE_TIMEOUT),
    }
    pause(server)
    started = time.monotonic()
    ended: dict[str, float] = {}

    def timed(name: str, call: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            try:
                return call()
            finally:
                ended[name] = time.monotonic() - started

        return run

    running = {name: in_thread(timed(name, call)) for name, (call, _) in calls.items()}
    for name, (thread, _) in running.items():
        thread.join(calls[name][1] + SLACK + 10)
    print({name: round(seconds, 2) for name, seconds in ended.items()})
    for name, (thread, outcome) in running.items():
        assert not thread.is_alive(), f"{name} still waits on the paused ZooKeeper"
        assert isinstance(outcome.get("error"), ZooKeeperUnavailable), (name, outcome)
        assert ended[name] < calls[name][1] + SLACK, (name, ended[name])


def test_a_marker_written_after_its_caller_gave_up_does_not_count(
    zk_client: KazooClient, lock_root: str
) -> None:
    """A marker whose write the server applied after its caller's deadline (a create that
    waited in a stalled server; its caller raised or sent without the marker) is absent to the
    next caller, whose claim replaces it. Before: the next call was deduplicated onto a task
    id that was never sent, for the marker's ttl."""
    path = f"{lock_root}/dedupe/late-{uuid.uuid4().hex[:8]}"
    now = time.time()
    gave_up = Marker("never-sent", "queued", now - 4.0, deadline=now - 1.0)
    zk_client.create(marker_path(path), gave_up.encode(), makepath=True)
    assert claim(zk_client, path, "next", "queued", 60.0, pending) is None  # it sends
    raw, _ = zk_client.get(marker_path(path))
    found = Marker.decode(raw)
    assert found is not None and found.task_id == "next" and found.deadline is not None
    # A marker written in time still deduplicates.
    assert claim(zk_client, path, "third", "queued", 60.0, pending) == "next"


def test_a_late_marker_write_is_undone_when_it_lands(
    server: ZooKeeperServer, client: KazooClient
) -> None:
    """A claim whose write reaches a stalled server gives up at its deadline; when the server
    answers, the write lands and the caller's client deletes that marker. The stall is made to
    come between the claim's read and its write: the earlier owner's state is looked up there.
    Before: the claim waited for the stalled server (then failed with ConnectionLoss)."""
    path = f"/dedupe/late-write-{uuid.uuid4().hex[:8]}"
    assert claim(client, path, "dead", "queued", 60.0, pending) is None

    def over_then_stall(task_id: str) -> str:
        assert task_id == "dead"
        pause(server)  # the versioned set that replaces the stale marker waits in the server
        return states.FAILURE

    started = time.monotonic()
    with pytest.raises(ZooKeeperUnavailable):
        claim(client, path, "gave-up", "queued", 60.0, over_then_stall)
    assert time.monotonic() - started < DEFAULT_DEDUPE_TIMEOUT + SLACK
    resume(server)
    # The set lands now (the connection survived the short stall), and its answer removes it.
    wait_for(lambda: client.exists(marker_path(path)) is None, 15, "the late marker's removal")
    assert claim(client, path, "next", "queued", 60.0, pending) is None
