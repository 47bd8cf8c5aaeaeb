"""What a deduplicated run (``lock_dedupe``) does with its key's marker, through Celery's own
tracer (``celery.app.trace.build_tracer``, what a worker's pool process runs) in this process,
with a memory broker and result backend and a real ZooKeeper: the owner's own retry is always
sent, a duplicate delivery leaves the running original's marker alone, and ZooKeeper failing at
the marker is the ``unavailable`` situation, never a failure of a body that ran."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Ignore
from celery.signals import after_task_publish
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from celery_zklock import Mutex, ZkLockTask, signals
from celery_zklock.task.dedupe import MARKER_SUFFIX


@pytest.fixture
def app(zk_hosts: str, lock_root: str, zk_client: KazooClient) -> Iterator[Celery]:
    app = Celery("dedupe-run", set_as_current=False)
    app.conf.broker_url = "memory://"
    app.conf.result_backend = "cache+memory://"
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    zk_client.ensure_path(lock_root)
    yield app


def _trace(task: Any, task_id: str, *args: Any, redelivered: bool = False) -> Any:
    tracer = build_tracer(task.name, task, eager=False, app=task.app)
    request = {"id": task_id, "delivery_info": {"redelivered": redelivered}, "retries": 0}
    return tracer(task_id, list(args), {}, request)


def test_the_owners_retry_is_sent_although_a_newer_call_holds_the_marker(
    app: Celery, zk_client: KazooClient
) -> None:
    @app.task(
        bind=True, base=ZkLockTask, lock_key=["key"], lock_dedupe="queued",
        lock_on_busy="retry", lock_retry_countdown=0, lazy=False, shared=False,
    )  # fmt: skip
    def job(self: Any, key: str) -> str:
        return "ran"

    published: list[str] = []

    def on_publish(headers: Any = None, **_: Any) -> None:
        published.append(headers["id"])

    newer: list[str] = []

    def on_busy(sender: Any = None, task_id: Any = None, **_: Any) -> None:
        # Sent while the first run looks at the busy lock: its marker went when it started.
        if task_id == first.id and not newer:
            newer.append(job.apply_async(("k",)).id)

    after_task_publish.connect(on_publish, weak=False)
    signals.lock_busy.connect(on_busy, weak=False)
    try:
        first = job.apply_async(("k",))
        holder = Mutex(zk_client, job.lock_path("k")).acquire(timeout=5)
        try:
            _trace(job, first.id, "k")
        finally:
            holder.release()
    finally:
        signals.lock_busy.disconnect(on_busy)
        after_task_publish.disconnect(on_publish)
    assert newer and newer[0] != first.id
    assert job.AsyncResult(first.id).state == "RETRY"
    assert published == [first.id, newer[0], first.id], "the retry of the first call was not sent"


def test_a_duplicate_delivery_leaves_the_running_originals_marker(
    app: Celery, zk_client: KazooClient
) -> None:
    app.conf.zklock_session_timeout = 2.0  # the copy waits 1.5 session timeouts + 1 s for it

    @app.task(
        bind=True, base=ZkLockTask, lock_key=["key"], lock_dedupe="running",
        lazy=False, shared=False,
    )  # fmt: skip
    def job(self: Any, key: str) -> str:
        return "ran"

    first = job.apply_async(("k",))
    # The original's run, holding the lock in another worker: its node names its task.
    original = json.dumps({"task_id": first.id, "task": job.name, "retries": 0}).encode()
    held = Mutex(zk_client, job.lock_path("k")).acquire(timeout=5, data=original)
    try:
        copy = _trace(job, first.id, "k", redelivered=True)
        assert copy.info is not None and copy.info.state == "IGNORED", copy
        again = job.apply_async(("k",))  # the original still runs: deduplicated onto it
    finally:
        held.release()
    assert again.id == first.id, "the ignored copy removed the running original's marker"


@pytest.mark.parametrize(("mode", "ran", "state"), [("queued", False, "RETRY"),
                                                    ("running", True, "SUCCESS")])  # fmt: skip
def test_zookeeper_failing_at_the_marker(
    app: Celery,
    zk_client: KazooClient,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    ran: bool,
    state: str,
) -> None:
    """``queued`` removes the marker before the body: ZooKeeper failing there is ``unavailable``
    (a retry in a worker), the body not run. ``running`` removes it after the body: the body's
    result stands, and the marker stops counting once that result is stored."""
    bodies: list[str] = []

    @app.task(
        bind=True, base=ZkLockTask, lock_key=["key"], lock_dedupe=mode, lazy=False, shared=False,
        lock_on_unavailable="retry",  # not sent back to ride it out (test_outage_rideout.py)
    )  # fmt: skip
    def job(self: Any, key: str) -> str:
        bodies.append(key)
        return "ran"

    first = job.apply_async(("k",))
    real_get = KazooClient.get_async

    def get(client: KazooClient, path: str, *args: Any, **kwargs: Any) -> Any:
        if path.endswith(MARKER_SUFFIX) and client is not zk_client:  # the run's read of it
            failed = client.handler.async_result()
            failed.set_exception(ConnectionLoss())  # what kazoo answers when the connection drops
            return failed
        return real_get(client, path, *args, **kwargs)

    monkeypatch.setattr(KazooClient, "get_async", get)
    _trace(job, first.id, "k")
    assert bool(bodies) is ran
    assert job.AsyncResult(first.id).state == state, job.AsyncResult(first.id).result


@pytest.mark.parametrize("ending", ["failure", "ignore", "skip"])
def test_a_running_marker_goes_when_its_run_ends_without_success(
    app: Celery, zk_client: KazooClient, ending: str
) -> None:
    """docs/dedupe.md: with ``running`` the marker goes when the run ends "in any way but a
    retry (success, failure, ``Ignore``, a skip)": the next call of the key sends a message of
    its own, not the ended one's."""
    bodies: list[str] = []

    @app.task(
        bind=True, base=ZkLockTask, lock_key=["key"], lock_dedupe="running",
        lock_on_busy="skip", lazy=False, shared=False,
    )  # fmt: skip
    def job(self: Any, key: str) -> str:
        bodies.append(key)
        if ending == "ignore":
            raise Ignore()
        raise ValueError("the body failed")

    first = job.apply_async(("k",))
    assert job.apply_async(("k",)).id == first.id  # deduplicated while it waits
    # A skip: another holder of the key's lock (not a task run) when the call runs.
    holder = Mutex(zk_client, job.lock_path("k")).acquire(timeout=5) if ending == "skip" else None
    try:
        _trace(job, first.id, "k")
    finally:
        if holder is not None:
            holder.release()
    assert bodies == ([] if ending == "skip" else ["k"])
    assert zk_client.exists(job.lock_path("k") + MARKER_SUFFIX) is None, "the marker stayed"
    assert job.apply_async(("k",)).id != first.id, "the key stayed deduplicated on the ended run"
