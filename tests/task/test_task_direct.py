"""ZkLockTask called directly and with .apply() (in this process), on a real ZooKeeper:
definition-time validation, bad input at call time, and the lock around the body."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import (
    ConfigurationError,
    LockBusy,
    LockKeyError,
    LockLost,
    ZkLockTask,
    ZooKeeperUnavailable,
    is_skipped,
    signals,
)
from celery_zklock.errors import LossCode
from celery_zklock.testing import free_port
from tests.lockutil import expire_session, task_client


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("direct", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


def test_unknown_key_argument_fails_at_definition(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"task '[\w.]*\.bad'.*'nope'.*parameters are: x"):
        # shared=False: a shared task is made again in every app finalized later, where its
        # definition error would break that app (it broke a beat test's app once).
        @app.task(base=ZkLockTask, lock_key=["nope"], lazy=False, shared=False)
        def bad(x: int) -> None: ...


def test_unknown_policy_and_misspelt_option_fail_at_definition(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"lock_on_busy.*'sometimes'"):

        @app.task(base=ZkLockTask, lock_on_busy="sometimes", lazy=False, shared=False)
        def bad(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match="did you mean 'lock_on_busy'"):

        @app.task(base=ZkLockTask, lock_on_bussy="skip", lazy=False, shared=False)
        def bad2(x: int) -> None: ...


def test_body_runs_under_the_lock_with_its_token(
    app: Celery, zk_client: KazooClient, lock_root: str
) -> None:
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=ZkLockTask, lock_key=["account_id"], lazy=False)
    def sync(self: Any, account_id: int, full: bool = False) -> int:
        seen["children"] = zk_client.get_children(self.lock.path)
        seen["node"] = self.lock.node
        return int(self.lock.token)

    token = sync(7)
    assert seen["node"].rsplit("/", 1)[1] in seen["children"]
    assert ".sync/account_id=7~" in seen["node"]
    assert zk_client.exists(seen["node"]) is None  # released
    assert sync.apply(kwargs={"account_id": 7}).get() > token  # same key, new grant


def test_skip_busy_raise_and_call_overrides(app: Celery) -> None:
    inside, leave = threading.Event(), threading.Event()

    @app.task(bind=True, base=ZkLockTask, lock_key=[], lock_on_busy="skip", lazy=False)
    def singleton(self: Any) -> str:
        inside.set()
        leave.wait(10)
        return "ran"

    runner = threading.Thread(target=singleton)
    runner.start()
    assert inside.wait(10)
    try:
        skipped = singleton.apply().get()
        assert is_skipped(skipped) and skipped["reason"] == "busy"
        with pytest.raises(LockBusy, match="is held"):
            singleton.apply(zklock={"on_busy": "raise"}).get()
        with pytest.raises(ConfigurationError, match=r"zklock.*'mode'"):
            singleton.apply(zklock={"mode": "shared"})
    finally:
        leave.set()
        runner.join()
    assert not is_skipped(singleton.apply().get())


def test_unserialisable_argument_is_a_clear_error(app: Celery) -> None:
    @app.task(base=ZkLockTask, lazy=False)
    def job(payload: Any) -> None: ...

    with pytest.raises(LockKeyError, match="payload"):
        job(object())


def test_empty_hosts_and_unreachable_zookeeper(app: Celery) -> None:
    @app.task(base=ZkLockTask, lazy=False)
    def job(x: int) -> int:
        return x

    app.conf.zklock_hosts = "  "
    with pytest.raises(ConfigurationError, match=r"ZooKeeper hosts are empty.*ZKLOCK_HOSTS"):
        job(1)
    app.conf.zklock_hosts = f"127.0.0.1:{free_port()}"
    app.conf.zklock_connect_timeout = 0.5
    with pytest.raises(ZooKeeperUnavailable, match="could not connect"):
        job(1)


def test_signals_and_log_lines_for_each_lock_event(
    app: Celery, zk_hosts: str, caplog: pytest.LogCaptureFixture
) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def receiver(name: str) -> Any:
        def receive(sender: Any, **fields: Any) -> None:
            sent.append((name, fields))

        return receive

    receivers = {
        name: receiver(name)
        for name in ("lock_acquired", "lock_busy", "lock_lost", "lock_released")
    }
    for name, receive in receivers.items():
        getattr(signals, name).connect(receive, weak=False)
    inside, leave = threading.Event(), threading.Event()
    clients: list[KazooClient] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lock_on_busy="skip", lazy=False)
    def held(self: Any, n: int) -> str:
        clients.append(task_client(self))
        inside.set()
        while not leave.is_set():  # interruptible: the revocation lands between these waits
            leave.wait(0.01)
        return "ran"

    outcome: dict[str, BaseException | str] = {}

    def run() -> None:
        try:
            outcome["value"] = held(1)
        except BaseException as exc:
            outcome["value"] = exc

    caplog.set_level(logging.INFO, logger="celery_zklock")
    try:
        runner = threading.Thread(target=run)
        runner.start()
        assert inside.wait(10)
        assert is_skipped(held(1))  # busy
        expire_session(zk_hosts, clients[0])  # lost: the running body is interrupted
        runner.join(10)
        assert isinstance(outcome["value"], LockLost)
        assert outcome["value"].code == LossCode.SESSION_EXPIRED
    finally:
        leave.set()
        for name, receive in receivers.items():
            getattr(signals, name).disconnect(receive)
    names = [name for name, _ in sent]
    assert names == ["lock_acquired", "lock_busy", "lock_lost", "lock_released"]
    acquired, busy, lost, released = (fields for _, fields in sent)
    path = acquired["path"]
    assert "/n=1~" in path and all(f["path"] == path for _, f in sent)
    assert acquired["token"] == lost["token"] == released["token"] > 0
    assert acquired["mode"] == "exclusive" and acquired["waited"] >= 0
    assert busy["policy"] == "skip"
    assert "expired" in lost["reason"] and released["held"] > 0
    events = [r.zklock["event"] for r in caplog.records if hasattr(r, "zklock")]
    assert events == ["acquired", "busy", "lost", "released"]
    lines = [r.getMessage() for r in caplog.records if hasattr(r, "zklock")]
    assert all(f"path={path}" in line for line in lines)
    assert f"token={acquired['token']}" in lines[0] and "waited=" in lines[0]
