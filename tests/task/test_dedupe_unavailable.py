"""A deduplicated ``apply_async`` with ZooKeeper unreachable returns within a bound (issue 44,
Deliver 2): a producer connected before the outage, its ZooKeeper stopped or paused (SIGSTOP),
a real Redis broker. The call raises ``ZooKeeperUnavailable`` within ``zklock_dedupe_timeout``
and sends nothing, or sends its message without deduplication with
``lock_dedupe_unavailable="send"`` (the task's option, or the call's ``zklock={...}``)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zklock import ZkLockTask, ZooKeeperUnavailable
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.zookeeper import ZooKeeperServer
from celery_zklock.zk.client import close_clients
from celery_zklock.zk.settings import forget_settings
from tests.lockutil import in_thread

#: The acceptance bound of issue 44: a deduplicated delay() returns or raises within 5 s (the
#: default zklock_dedupe_timeout is 3 s).
BOUND = 5.0


@pytest.fixture
def server(zk_stack_factory: StackFactory) -> ZooKeeperServer:
    """A standalone server of this test's own; the factory stops it, paused or not (a stop
    sends SIGCONT after SIGTERM: ChildProcess.stop)."""
    return zk_stack_factory.server()


@pytest.fixture
def app(server: ZooKeeperServer, redis_url: str) -> Iterator[Celery]:
    app = Celery("dedupe-unavailable", set_as_current=False)
    app.conf.broker_url = redis_url
    app.conf.zklock_hosts = server.hosts
    app.conf.zklock_session_timeout = 10.0
    yield app
    close_clients()  # this test's client, on its own server
    forget_settings(app)


@pytest.fixture
def queue(redis_url: str) -> Iterator[str]:
    name = f"dd-unavailable-{uuid.uuid4().hex[:8]}"
    yield name
    broker = redis.Redis.from_url(redis_url)
    broker.delete(name)
    broker.close()


@pytest.mark.parametrize("outage", ["stopped", "paused"])
def test_a_deduplicated_call_returns_within_the_bound(
    app: Celery,
    server: ZooKeeperServer,
    queue: str,
    redis_url: str,
    outage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the call waited for ZooKeeper for the whole outage (a synchronous ``get`` in
    the marker's claim)."""

    @app.task(base=ZkLockTask, lock_key=["key"], lock_dedupe="queued", shared=False)
    def raises(key: str) -> None: ...

    @app.task(
        base=ZkLockTask, lock_key=["key"], lock_dedupe="queued", lock_dedupe_unavailable="send",
        shared=False,
    )  # fmt: skip
    def sends(key: str) -> None: ...

    broker = redis.Redis.from_url(redis_url)
    first = raises.apply_async(("k",), queue=queue)  # connected: the marker is claimed
    assert raises.apply_async(("k",), queue=queue).id == first.id  # and deduplicates
    assert broker.llen(queue) == 1
    if outage == "stopped":
        server.stop()
    else:
        pid = server.node.pid
        assert pid is not None
        pause_process(pid)
    calls: dict[str, Callable[[], Any]] = {
        "raise": lambda: raises.apply_async(("k",), queue=queue),
        "send (task option)": lambda: sends.apply_async(("k",), queue=queue),
        "send (per call)": lambda: raises.apply_async(
            ("other",), queue=queue, zklock={"dedupe_unavailable": "send"}
        ),
    }
    started = time.monotonic()
    ended: dict[str, float] = {}

    def timed(name: str, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            try:
                return call()
            finally:
                ended[name] = time.monotonic() - started

        return run

    running = {name: in_thread(timed(name, call)) for name, call in calls.items()}
    for thread, _ in running.values():
        thread.join(BOUND + 30)
    print(outage, {name: round(took, 2) for name, took in ended.items()})
    for name, (thread, _) in running.items():
        assert not thread.is_alive(), f"{name}: delay() still waits on ZooKeeper"
        assert ended[name] < BOUND, (name, ended[name])
    raised = running["raise"][1].get("error")
    assert isinstance(raised, ZooKeeperUnavailable), running["raise"][1]
    assert "nothing sent" in str(raised) and "lock_dedupe_unavailable='send'" in str(raised)
    sent = [running[name][1]["value"].id for name in ("send (task option)", "send (per call)")]
    assert first.id not in sent  # not deduplicated onto the earlier message
    assert broker.llen(queue) == 3  # the first message and the two sent without dedupe
    broker.close()
    warned = [r.getMessage() for r in caplog.records if "without deduplication" in r.getMessage()]
    assert len(warned) == 2 and all("lock_dedupe_unavailable='send'" in m for m in warned)


def test_a_producer_that_never_connected_waits_its_connect_timeout(
    redis_url: str, queue: str
) -> None:
    """No ZooKeeper at all (a port nobody listens on): the first connection's timeout bounds
    the call (``zklock_connect_timeout``), with the same outcomes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    app = Celery("dedupe-never-connected", set_as_current=False)
    app.conf.broker_url = redis_url
    app.conf.zklock_hosts = f"127.0.0.1:{port}"
    app.conf.zklock_connect_timeout = 1.0

    @app.task(base=ZkLockTask, lock_key=["key"], lock_dedupe="queued", shared=False)
    def job(key: str) -> None: ...

    try:
        started = time.monotonic()
        with pytest.raises(ZooKeeperUnavailable, match="nothing sent"):
            job.apply_async(("k",), queue=queue)
        sent = job.apply_async(("k",), queue=queue, zklock={"dedupe_unavailable": "send"})
        assert time.monotonic() - started < 2 * 1.0 + 2.0
    finally:
        forget_settings(app)
    broker = redis.Redis.from_url(redis_url)
    assert broker.llen(queue) == 1 and sent.id
    broker.close()
