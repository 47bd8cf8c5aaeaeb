"""A locked task run through Celery's own tracer (``celery.app.trace.build_tracer``, what a
worker's pool process runs) in this process, on a real ZooKeeper: a subclass that changes the
arguments is locked on the arguments it calls with, and a soft time limit landing while the run
connects or just after its contender's create went fails the task and leaves no node."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import SoftTimeLimitExceeded
from celery.states import FAILURE
from kazoo.client import KazooClient

from celery_zklock import ZkLockTask
from celery_zklock.task import run as run_module
from celery_zklock.zk import adapter
from tests.lockutil import children


@pytest.fixture
def app(zk_hosts: str, lock_root: str, zk_client: KazooClient) -> Iterator[Celery]:
    app = Celery("traced", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    app.conf.task_track_started = True
    zk_client.ensure_path(lock_root)
    yield app


def _trace(task: Any, *args: Any) -> Any:
    """Run ``task(*args)`` as a worker's pool process does; the tracer's (result, info)."""
    tracer = build_tracer(task.name, task, eager=False, app=task.app)
    return tracer(str(uuid.uuid4()), list(args), {}, {"delivery_info": {}})


def _make_parent(zk_client: KazooClient, lock_path: str) -> None:
    """The lock name's node, as a worker has it after its first run of the task: under a
    parent that is not there the create fails (NoNode), nothing is made, and the acquire makes
    the parents and creates again."""
    zk_client.ensure_path(lock_path.rsplit("/", 1)[0])


def _contenders_under(zk_client: KazooClient, path: str) -> list[str]:
    """Every contender node (``_c_<uuid>-...``) below ``path`` (a node reaped meanwhile holds
    none: :func:`tests.lockutil.children`)."""
    found: list[str] = []
    for child in children(zk_client, path):
        if child.startswith("_c_"):
            found.append(f"{path}/{child}")
        found.extend(_contenders_under(zk_client, f"{path}/{child}"))
    return found


def test_a_subclass_that_changes_the_arguments_is_locked_on_the_new_ones(
    app: Celery, zk_client: KazooClient, lock_root: str
) -> None:
    class Doubling(ZkLockTask):  # type: ignore[misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*(2 * a for a in args), **kwargs)

    @app.task(bind=True, base=Doubling, lock_key=["n"], lazy=False, shared=False)
    def doubled(self: Any, n: int) -> str:
        return str(self.lock.path)

    out = _trace(doubled, 4)
    assert out.info is None, out
    assert out.retval == doubled.lock_path(8)
    assert _contenders_under(zk_client, lock_root) == []


def test_a_soft_time_limit_landing_just_after_the_create_went_leaves_no_node(
    app: Celery, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception thrown into the thread (billiard's soft time limit) just after the create
    of the run's contender node was sent, before its answer: the acquire removes the node by
    the attempt's uuid, the task fails at its limit, and the key is free for the next run."""
    ran: list[int] = []
    sent: list[str] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lock_on_busy="skip", lazy=False, shared=False)
    def body(n: int) -> str:
        ran.append(n)
        return "ran"

    def stopped_after(real: Any) -> Any:
        def create(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)  # sent: its answer is left unread
            sent.append(real.__name__)
            raise SoftTimeLimitExceeded()

        return create

    _make_parent(zk_client, body.lock_path(1))
    for name in ("create_node_async", "create_node_and_parent_async"):
        monkeypatch.setattr(adapter, name, stopped_after(getattr(adapter, name)))
    first = _trace(body, 1)
    monkeypatch.undo()
    assert len(sent) == 1  # the create went, once
    assert first.info is not None and first.info.state == FAILURE, first
    assert isinstance(first.retval.exception, SoftTimeLimitExceeded)
    assert ran == []
    assert _contenders_under(zk_client, lock_root) == []
    assert _trace(body, 1).retval == "ran"  # the key is free
    assert ran == [1]


def test_a_soft_time_limit_landing_while_the_run_connects_fails_the_task(
    app: Celery, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first locked task of a pool process connects in its call: its soft time limit
    landing then fails the task (not the ``unavailable`` retry), and the body never runs."""
    ran: list[int] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def body(n: int) -> str:
        ran.append(n)
        return "ran past its soft time limit"

    def connecting(config: Any) -> Any:
        raise SoftTimeLimitExceeded()  # billiard's handler raises while the call connects

    monkeypatch.setattr(run_module, "get_client", connecting)
    out = _trace(body, 2)
    assert ran == []
    assert out.info is not None and out.info.state == FAILURE, out
    assert isinstance(out.retval.exception, SoftTimeLimitExceeded)
    assert _contenders_under(zk_client, lock_root) == []
