"""A locked run's first request sent at ``task_prerun`` (:mod:`celery_zklock.ahead`), through
Celery's own tracer (``celery.app.trace.build_tracer``, what a worker's pool process runs) in
this process, on a real ZooKeeper: the node made at prerun is the one the body holds, a run
that fails between prerun and the call leaves no node, and a subclass that changes the
arguments is locked on the arguments it calls with."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_prerun
from celery.states import FAILURE, STARTED
from kazoo.client import KazooClient

from celery_zklock import ZkLockTask
from celery_zklock import ahead as ahead_module
from celery_zklock import run as run_module
from celery_zklock.locks.queue import ContenderQueue
from tests.lockutil import wait_for


@pytest.fixture
def app(zk_hosts: str, lock_root: str, zk_client: KazooClient) -> Iterator[Celery]:
    app = Celery("ahead", set_as_current=False)
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
    parent that is not there the create sent ahead fails (NoNode) and the acquire makes it."""
    zk_client.ensure_path(lock_path.rsplit("/", 1)[0])


def _contenders_under(zk_client: KazooClient, path: str) -> list[str]:
    """Every contender node (``_c_<uuid>-...``) below ``path``."""
    if zk_client.exists(path) is None:
        return []
    found: list[str] = []
    for child in zk_client.get_children(path):
        if child.startswith("_c_"):
            found.append(f"{path}/{child}")
        found.extend(_contenders_under(zk_client, f"{path}/{child}"))
    return found


def test_the_node_made_at_prerun_is_the_one_the_body_holds(
    app: Celery, zk_client: KazooClient, lock_root: str
) -> None:
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def locked(self: Any, n: int) -> str:
        seen["node"] = self.lock.node
        return str(self.lock.path)

    def after_ours(sender: Any = None, **_: Any) -> None:  # connected after the library's
        if sender is locked:
            path = locked.lock_path(5)
            wait_for(lambda: zk_client.exists(path) and zk_client.get_children(path), what="node")
            seen["at_prerun"] = zk_client.get_children(path)

    _make_parent(zk_client, locked.lock_path(5))
    task_prerun.connect(after_ours, weak=False)
    try:
        out = _trace(locked, 5)
    finally:
        task_prerun.disconnect(after_ours)
    assert out.info is None, out  # no failure
    assert out.retval == locked.lock_path(5)
    assert seen["at_prerun"] == [seen["node"].rsplit("/", 1)[1]]
    assert zk_client.exists(seen["node"]) is None  # released


@pytest.mark.filterwarnings("ignore:Exception raised outside body")  # Celery's, for the failure
def test_a_run_that_fails_between_prerun_and_the_call_leaves_no_node(
    app: Celery, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def never(n: int) -> None:
        calls.append(n)

    stored = never.backend.store_result

    def failing_started(task_id: str, result: Any, state: str, *args: Any, **kwargs: Any) -> Any:
        if state == STARTED:  # the tracer's track-started write, after prerun
            path = never.lock_path(3)
            wait_for(lambda: zk_client.exists(path) and zk_client.get_children(path), what="node")
            raise ConnectionError("result backend down")
        return stored(task_id, result, state, *args, **kwargs)

    _make_parent(zk_client, never.lock_path(3))
    monkeypatch.setattr(never.backend, "store_result", failing_started)
    out = _trace(never, 3)
    assert calls == []
    assert out.info is not None and out.info.state == FAILURE, out
    assert _contenders_under(zk_client, lock_root) == []


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


def test_a_run_that_ends_before_its_acquire_removes_the_node_sent_ahead(
    app: Celery, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def unreachable(n: int) -> None:
        calls.append(n)

    real_get_client = run_module.get_client
    asked: list[int] = []

    def get_client_once(config: Any) -> Any:  # send_ahead's call works, __call__'s fails
        asked.append(1)
        if len(asked) > 1:
            raise ConnectionError("ZooKeeper went away")
        return real_get_client(config)

    _make_parent(zk_client, unreachable.lock_path(6))
    monkeypatch.setattr(ahead_module, "get_client", get_client_once)
    monkeypatch.setattr(run_module, "get_client", get_client_once)
    out = _trace(unreachable, 6)
    assert calls == []
    assert len(asked) == 2
    assert out.info is not None  # the unavailable verdict: a retry (or its failure here)
    assert _contenders_under(zk_client, lock_root) == []


@pytest.mark.parametrize(
    ("where", "runs"), [("after the send ahead", True), ("inside the send, once it went", False)]
)
def test_a_stop_landing_while_the_create_goes_ahead_leaves_no_node(
    app: Celery,
    zk_client: KazooClient,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    runs: bool,
) -> None:
    """An exception thrown into the thread (billiard's soft time limit) just after the create
    went, before the run recorded it. Landing after the send ahead, it is swallowed by Celery's
    signal dispatch, which then calls the task: the run finds its node by the attempt's uuid
    instead of taking it for another delivery of the same task still alive (which ignored the
    task and left the node for as long as the process lived). Landing inside the send, the run
    raises it when the call starts: the task fails at its limit. Either way no node is left."""
    ran: list[int] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lock_on_busy="skip", lazy=False, shared=False)
    def body(n: int) -> str:
        ran.append(n)
        return "ran"

    if where == "after the send ahead":
        real_send = ahead_module.SentAhead.send

        def send(sent: Any) -> bool:
            real_send(sent)
            raise SoftTimeLimitExceeded()

        monkeypatch.setattr(ahead_module.SentAhead, "send", send)
    else:
        real_send_create = ContenderQueue.send_create

        def send_create(queue: Any, *args: Any, **kwargs: Any) -> Any:
            real_send_create(queue, *args, **kwargs)
            raise SoftTimeLimitExceeded()

        monkeypatch.setattr(ContenderQueue, "send_create", send_create)
    _make_parent(zk_client, body.lock_path(1))
    first = _trace(body, 1)
    monkeypatch.undo()
    assert _contenders_under(zk_client, lock_root) == []
    if runs:
        assert first.retval == "ran", first
    else:
        assert first.info is not None and first.info.state == FAILURE, first
        assert isinstance(first.retval.exception, SoftTimeLimitExceeded)
    assert _trace(body, 1).retval == "ran"  # the key is free
    assert ran == [1, 1] if runs else ran == [1]


def test_a_soft_time_limit_landing_while_prerun_connects_fails_the_task(
    app: Celery, zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first locked task of a pool process connects at task_prerun: its soft time limit
    landing then is raised when the call starts (Celery's signal dispatch swallows it), as when
    it lands while the call connects."""
    ran: list[int] = []

    @app.task(base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def body(n: int) -> str:
        ran.append(n)
        return "ran past its soft time limit"

    real_get_client = run_module.get_client
    asked: list[int] = []

    def connecting(config: Any) -> Any:
        asked.append(1)
        if len(asked) == 1:  # billiard's handler raises while prerun connects
            raise SoftTimeLimitExceeded()
        return real_get_client(config)

    monkeypatch.setattr(ahead_module, "get_client", connecting)
    monkeypatch.setattr(run_module, "get_client", connecting)
    out = _trace(body, 2)
    assert ran == []
    assert out.info is not None and out.info.state == FAILURE, out
    assert isinstance(out.retval.exception, SoftTimeLimitExceeded)
    assert _contenders_under(zk_client, lock_root) == []
