"""ZkLockTask called directly and with .apply() (in this process), on a real ZooKeeper:
definition-time validation, bad input at call time, and the lock around the body."""

from __future__ import annotations

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
    ZkLockTask,
    ZooKeeperUnavailable,
    is_skipped,
)
from celery_zklock.testing import free_port


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("direct", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


def test_unknown_key_argument_fails_at_definition(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"task '[\w.]*\.bad'.*'nope'.*parameters are: x"):

        @app.task(base=ZkLockTask, lock_key=["nope"], lazy=False)
        def bad(x: int) -> None: ...


def test_unknown_policy_and_misspelt_option_fail_at_definition(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"lock_on_busy.*'sometimes'"):

        @app.task(base=ZkLockTask, lock_on_busy="sometimes", lazy=False)
        def bad(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match="did you mean 'lock_on_busy'"):

        @app.task(base=ZkLockTask, lock_on_bussy="skip", lazy=False)
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
