"""The stack fixtures (the library's opt-in pytest plugin), a Redis client for any tier, those
of the task tests that run real `celery worker` subprocesses (tests.taskapp), and the order the
suite runs in.

`make test` runs the suite on pytest-xdist worker processes (``-n``, ``--dist loadgroup``).
Each process starts its own ZooKeeper and Redis (the plugin's session fixtures); the tests of
a group in :data:`XDIST_GROUPS` run one after the other on one process. The slowest tests are
collected first (:data:`SLOWEST_FIRST`), so that the run does not end waiting on one long test
that started last.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from celery_zklock.testing.zookeeper import JVM_FLAGS_ENV, QUICK_JVM_FLAGS

pytest_plugins = ["celery_zklock.testing.plugin"]

# The suite starts dozens of ZooKeeper JVMs on two cores: each with less JIT work (QUICK_JVM_FLAGS).
# And no fsync of the transaction log (forceSync=no, what a node's zoo.cfg otherwise leaves at yes):
# every request, the lease clock's renewals too, waits behind the server's fsync of the writes
# before it, and on this machine's one disk, busy with the rest of the suite, such an fsync took
# over a second (renewal round trips up to 1.35 s), past what a T = 4 s lease allows (0.77 s for a
# fresh one): leaderships moved with no fault. Tests need no durability beyond a killed JVM, which
# the page cache gives.
os.environ.setdefault(JVM_FLAGS_ENV, f"{QUICK_JVM_FLAGS} -Dzookeeper.forceSync=no")

XDIST_GROUPS: dict[str, str] = {
    # The Docker tests: their image builds share the images' tags and build this source tree in
    # place (`pip wheel`), and the compose fleet alone loads the machine.
    "tests/fleet/test_compose_fleet.py::": "docker",
    "tests/fleet/test_pytest_celery_containers.py::": "docker",
    # Its module-scoped `stack` (three workers, one in a network namespace) then starts once.
    "tests/fleet/test_faults.py::": "faults",
    # Its own RabbitMQ node, SIGKILLed and restarted (about 15 s of a busy Erlang VM).
    "tests/fleet/test_broker_restart_amqp.py::": "amqp-restart",
}
"""Node id prefix -> group: with ``--dist loadgroup`` a group's tests run on one process, one
after the other. A table here rather than ``xdist_group`` marks: pytest-xdist 3.8 marks a test's
group by rewriting ``item._nodeid``, which pytest 9.2 no longer reads, so the marks do nothing.
"""

AMQP_LANES: dict[str, str] = {
    "tests/task/test_gate.py::": "amqp-1",  # 2 tests, 30 s and the node's start (about 11 s)
    "tests/task/test_task_worker.py::test_skip_wait_and_shared_modes[prefork": "amqp-1",  # 14 s
    "tests/task/test_task_lifecycle.py::": "amqp-2",  # 3 tests, 35 s and the node's start
    "tests/task/test_canvas.py::": "amqp-2",  # 2 tests, 9 s
    "tests/task/test_task_worker.py::": "amqp-2",  # threads, 8 s
}
"""Node id prefix -> group of the tests on RabbitMQ (a ``broker`` of ``amqp``; any other goes to
``amqp-1``). RabbitMQ is a session fixture, so each xdist process that runs such a test starts
a node of its own (about 5 s of CPU): two groups, two nodes, and the RabbitMQ tests run on two
processes side by side, each group balanced to about the same time."""
_AMQP_PARAM = re.compile(r"[\[-]amqp[\]-]")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup``, xdist's group scheduling with :data:`XDIST_GROUPS` as well."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class TableGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or str(super()._split_scope(nodeid))

    return TableGroupScheduling(config, log)


def xdist_group(nodeid: str) -> str | None:
    """The group of :data:`XDIST_GROUPS` or :data:`AMQP_LANES` of a test, or None."""
    for prefix, group in XDIST_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    if _AMQP_PARAM.search(nodeid):
        lanes = (group for prefix, group in AMQP_LANES.items() if nodeid.startswith(prefix))
        return next(lanes, "amqp-1")
    return None


SLOWEST_FIRST: tuple[str, ...] = (
    "tests/fleet/test_loadtest.py::test_every_fault_three_times_over_an_ensemble",
    "tests/fleet/test_compose_fleet.py::",  # with the next, XDIST_GROUPS' "docker"
    "tests/fleet/test_pytest_celery_containers.py::",
    "tests/fleet/test_readme_example.py::",
    "tests/task/test_beat_leader.py::test_three_beats_send_each_due_time_once",
    "tests/task/test_beat_leader.py::test_a_killed_leader_is_replaced",
    "tests/recipes/test_lease_safety.py::test_d_holder_on_follower_cut_off_from_leader",
    "tests/task/test_task_unavailable.py::test_in_a_worker_an_outage_during_a_wait",
    "tests/recipes/test_partition_rig.py::test_isolating_a_member_leaves_a_parallel",
    "tests/fleet/test_faults.py::",  # XDIST_GROUPS' "faults": its module-scoped stack once
    "tests/task/test_task_delivery.py::test_copy_of_a_killed_child_runs_under_a_session",
    "tests/task/test_task_lifecycle.py::test_message_of_a_killed_prefork_child_runs_again_once_its_lock_is_free[amqp]",
    "tests/task/test_gate.py::",
    "tests/task/test_commands.py::test_break_ends_the_holder_lock_lost",
    "tests/task/test_semaphore_tasks.py::test_copy_of_a_semaphore_original",
    "tests/task/test_task_lifecycle.py::test_redelivered_message_of_a_running_task",
    "tests/recipes/test_partition_rig.py::test_isolate_cuts_a_follower_off",
    "tests/task/test_task_delivery.py::test_copy_of_an_exclusive_original_waiting",
    "tests/recipes/test_lease_safety.py::",
    "tests/fleet/test_demo.py::test_demo_end_to_end",
    "tests/task/test_task_worker.py::test_prefork_child_paused_past_session_timeout",
    "tests/task/test_task_lifecycle.py::test_message_of_a_killed_prefork_child",
    "tests/task/test_task_beat.py::test_beat_singleton_never_overlaps",
    "tests/task/test_secured_tasks.py::test_creator_acl_keeps_other_identities",
    "tests/task/test_task_release.py::test_soft_time_limit_while_a_copy_awaits",
    "tests/task/test_task_lifecycle.py::test_kill_9_of_the_holder",
    "tests/task/test_commands.py::test_break_in_threads_and_gevent_pools",
    "tests/task/test_task_worker.py::",
)
"""Node id prefixes of the slowest tests (a full run's ``--durations``), slowest first: they
are collected, and so handed to xdist's processes, before everything else. A prefix that no
longer matches costs nothing; a slow test missing here only lengthens the run's tail."""


def _slowness_rank(item: pytest.Item) -> int:
    for rank, prefix in enumerate(SLOWEST_FIRST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(SLOWEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest tests first (a stable sort: the rest keep their order)."""
    items.sort(key=_slowness_rank)


SESSION_TIMEOUT = 4.0
"""The workers' ZooKeeper session timeout (seconds): short, so expiry-based tests are quick."""


def empty_broker(url: str) -> None:
    """Drop every message the Redis broker at ``url`` holds: those in its queues and those
    delivered but never acknowledged (kombu's unacked index); the queues' bindings stay, as a
    client that declared a queue once does not declare it again.

    The session's Redis serves every test of a pytest process, and most task tests use the same
    queue names (q0, q1). A message an earlier test left, e.g. that of a worker SIGKILLed while
    running it (Celery acknowledges on the worker's next event-loop turn, which a solo worker
    never took), is put back in its queue by any later consumer with a short visibility timeout
    and then run by whichever test's worker consumes that queue next, beside that test's tasks.
    """
    client = redis.Redis.from_url(url)
    try:
        queues = list(client.scan_iter(_type="list"))
        client.delete(*queues, "unacked", "unacked_index")
    finally:
        client.close()


def point_at(app: Celery, url: str) -> None:
    """Send ``app``'s messages to the broker at ``url`` from now on: its connection and producer
    pools (made on first use for the broker of then) are let go when the broker changes. Not
    closed: kombu keeps one pool per broker URL for the process (``kombu.pools``), which the app
    takes up again when it comes back to that broker."""
    if app.conf.broker_url == url:
        return
    app.conf.broker_url = url
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client of the test Redis, closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def taskenv(
    zk_hosts: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Celery, dict[str, str], Path]]:
    """The task app configured for this test, the workers' environment, and their directory,
    on a broker that holds no message of an earlier test (:func:`empty_broker`)."""
    empty_broker(redis_url)
    env = {
        "TASKAPP_BROKER": redis_url,
        "ZKLOCK_HOSTS": zk_hosts,
        "ZKLOCK_SESSION_TIMEOUT": str(SESSION_TIMEOUT),
        "TASKAPP_DIR": str(tmp_path),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from tests import taskapp

    point_at(taskapp.app, redis_url)
    taskapp.app.conf.result_backend = redis_url
    taskapp.DIR = tmp_path
    yield taskapp.app, env, tmp_path


AMQP_QUEUES: tuple[str, ...] = ("celery", "q0", "q1", "q2", "q3", "dupx")
"""The queue names the task tests consume (:func:`tests.workerproc.workers` names worker i's
``q<i>``): emptied on the session's RabbitMQ node before and after each test on it."""


def empty_amqp_broker(app: Celery, url: str, queues: tuple[str, ...] = AMQP_QUEUES) -> None:
    """Empty ``queues`` on the RabbitMQ node at ``url`` of the messages they hold (those a
    killed worker never acknowledged are back in them). Each is declared as ``app`` declares
    it, then purged, not deleted: kombu remembers per connection what it declared, and a
    producer that believes a deleted queue still there publishes into nothing."""
    with Connection(url) as conn:  # type: ignore[no-untyped-call]
        channel = conn.default_channel
        for name in queues:
            queue = app.amqp.queues[name](channel)
            queue.declare()
            queue.purge()


@dataclass
class Broker:
    """The broker a test's tasks go through (the ``broker`` fixture): ``name`` is ``redis`` or
    ``amqp``; ``sender`` (tests.taskapp's app) sends to it; ``env`` points the workers at it;
    ``queues`` are the queues its workers consume by default (emptied before the test)."""

    name: str
    url: str
    sender: Celery
    env: dict[str, str]
    queues: list[str]

    def send(self, task: str, args: tuple[Any, ...], queue: str) -> Any:
        return self.sender.send_task(f"tests.taskapp.{task}", args, queue=queue)


@pytest.fixture(params=["redis", "amqp"])
def broker(
    request: pytest.FixtureRequest, taskenv: tuple[Celery, dict[str, str], Path], redis_url: str
) -> Iterator[Broker]:
    """The test on the session's Redis, then on the session's private RabbitMQ node
    (``amqp_url``; results in Redis either way): tests.taskapp's app sends to it and ``env``
    points the workers at it. Parametrise ``broker`` indirectly to pick one.

    RabbitMQ hands an unacknowledged message out again when its consumer's channel closes (a
    worker killed, a connection lost, ``consumer_timeout`` passed), never after a visibility
    timeout: a test of redelivery after a time runs on Redis only."""
    app, env, _ = taskenv
    if request.param == "redis":
        yield Broker("redis", redis_url, app, env, ["q0", "q1"])
        return
    url = request.getfixturevalue("amqp_url")
    empty_amqp_broker(app, url)
    point_at(app, url)
    try:
        yield Broker("amqp", url, app, {**env, "TASKAPP_BROKER": url, "TASKAPP_BACKEND": redis_url},
                     ["q0", "q1"])  # fmt: skip
    finally:
        point_at(app, redis_url)
        empty_amqp_broker(app, url)
