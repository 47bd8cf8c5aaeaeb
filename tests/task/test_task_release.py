"""Every path from a grant to the end of a run releases the lease: a lease lost before the body
started, and a soft time limit while a copy of a message decides whether to run."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import Lease, ZkLockTask, signals
from celery_zklock.task import run as run_module
from tests.lockutil import children, expire_session, wait_for
from tests.taskapp import read_records
from tests.workerproc import contenders, workers

TaskEnv = tuple[Celery, dict[str, str], Path]


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("release", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


class _LosesTheFirstGrant:
    """A lock side whose first grant is lost before acquire hands it to the task: the session
    expires (for real, on the server) between the grant and the task's first look."""

    def __init__(self, side: Any, client: KazooClient, hosts: str, lost: list[int]) -> None:
        self._side, self._client, self._hosts, self._lost = side, client, hosts, lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side, name)

    def acquire(self, **kwargs: Any) -> Lease | None:
        lease: Lease | None = self._side.acquire(**kwargs)
        if lease is not None and not self._lost:
            self._lost.append(lease.token)
            gone = threading.Event()
            lease.on_lost(lambda reason: gone.set())
            expire_session(self._hosts, self._client)
            assert gone.wait(30), "the lease was not declared lost"
        return lease


def test_lease_lost_before_the_body_started_is_released_and_retried(
    app: Celery, zk_hosts: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost: list[int] = []
    real = run_module.Mutex

    def losing_side(client: KazooClient, path: str, **kwargs: Any) -> _LosesTheFirstGrant:
        return _LosesTheFirstGrant(real(client, path, **kwargs), client, zk_hosts, lost)

    monkeypatch.setattr(run_module, "Mutex", losing_side)
    runs: list[tuple[int, int]] = []
    released: list[int] = []

    @app.task(
        bind=True, base=ZkLockTask, lock_key=["n"], lock_on_lost="retry", max_retries=1,
        lazy=False,
    )  # fmt: skip
    def job(self: Any, n: int) -> str:
        runs.append((self.request.retries, self.lock.token))
        return "ran"

    def on_released(sender: Any, token: int = 0, **_: Any) -> None:
        if sender is job:
            released.append(token)

    signals.lock_released.connect(on_released, weak=False)
    before = signal.getsignal(signal.SIGUSR2)
    try:
        result = job.apply((1,))
        value = result.get()
    finally:
        signals.lock_released.disconnect(on_released)
    assert value == "ran"  # lock_on_lost="retry" applied: eager mode re-ran the task
    assert [retries for retries, _ in runs] == [1]  # the body never ran on the lost lease
    assert released == [lost[0], runs[0][1]]  # both grants released
    assert signal.getsignal(signal.SIGUSR2) is before  # the interruption was disarmed
    with pytest.raises(RuntimeError, match="only set inside the task body"):
        job.lock  # noqa: B018 - no lease of an ended run is left on the stack
    root = f"{app.conf.zklock_root}/{job._zklock_compile().options.name}"
    # children(): a key's empty container may be reaped by the server between the two reads.
    assert all(not children(zk_client, f"{root}/{key}") for key in children(zk_client, root))


def test_soft_time_limit_while_a_copy_awaits_its_original_leaves_no_lock_behind(
    taskenv: TaskEnv, zk_client: KazooClient, zk_hosts: str
) -> None:
    """A killed prefork child's message comes back at once; the copy waits for the dead node
    and then up to 2 s for the original's result. Its soft time limit lands there: the copy
    fails, and the lock is not held (the worker child lives on, so a leaked node would stay)."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late_stubborn

    with workers(app, "prefork", 1, env, tmp, prefix="soft") as (worker,):
        # the first delivery outlives its own soft limit: only the copy's lands
        result = acked_late_stubborn.apply_async(
            ("sc", 60.0), queue=worker.queue, soft_time_limit=1.5
        )
        wait_for(lambda: read_records(tmp / "starts-sc"), 30, "the first run to start")
        (first,) = read_records(tmp / "starts-sc")
        os.kill(first["pid"], signal.SIGKILL)
        # Hold the dead child's session (and its node) until the copy waits on it: under load the
        # copy came back after the session timeout, found no node, and never waited.
        twin = KazooClient(
            zk_hosts, client_id=(first["session_id"], bytes.fromhex(first["password"]))
        )
        twin.start(timeout=15)
        try:
            wait_for(lambda: "event=same-delivery-waits" in worker.log_text(), 60, "the copy")
        finally:
            # end the dead child's session now: its node goes, the copy goes on to the result check
            twin.stop()
            twin.close()
        with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
            result.get(timeout=30)
        wait_for(lambda: not contenders(zk_client, "late"), 2, "no lock node left")
    assert [s["task_id"] for s in read_records(tmp / "starts-sc")] == [result.id]
