"""pytest-celery's Docker set-up on our images (celery_zklock.testing.containers): a worker
container of the fleet image runs the fleet's locked task against a ZooKeeper container, with
Redis containers as broker and backend. Images missing here are built first; skipped, with the
reason, only where no Docker engine can be had; a ``dockerd`` this run starts it stops again."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import docker
import pytest
import redis
from kazoo.client import KazooClient
from pytest_celery import CeleryTestSetup

from workers.compose import DockerEngine, build_images
from workers.record import SectionRecorder
from workers.tasks import EXCLUSIVE_TASK

if TYPE_CHECKING:
    # Imported for real by pytest_plugins below, after pytest set up its assertion rewriting.
    from celery_zklock.testing.containers import ZooKeeperContainer

pytest_plugins = ["celery_zklock.testing.containers"]

# One Docker test of a run at a time: tests/conftest.py puts it in XDIST_GROUPS' "docker".
pytestmark = pytest.mark.slow

HOLD_MS = 1000
RESULT_TIMEOUT = 60.0


@pytest.fixture(scope="session")
def docker_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[docker.DockerClient]:
    """pytest-docker-tools' client, on an engine this run starts if none runs (and stops again),
    with the fleet's images built from this checkout; skipped only where no engine can be had.

    It overrides pytest-docker-tools' session fixture of that name, which every container fixture
    depends on, so the engine is up before pytest-celery's fixtures first ask for it.
    """
    reason = DockerEngine.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Docker engine: {reason}")
    engine = DockerEngine.ensure(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    try:
        client = docker.from_env(timeout=60)
        try:
            # Asked every run, not only when missing: an image left by an earlier checkout would
            # run that checkout's worker code (the worker image is rebuilt when its inputs
            # changed, workers.compose.worker_inputs_digest).
            build_images()
            yield client
        finally:
            client.close()
    finally:
        engine.close()


@pytest.fixture
def zk_client(zklock_zookeeper: ZooKeeperContainer) -> Iterator[KazooClient]:
    """A kazoo client on the test's ZooKeeper container, from this process."""
    client = KazooClient(hosts=zklock_zookeeper.host_hosts)
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def test_two_calls_for_one_key_hold_the_lock_in_turn(
    celery_setup: CeleryTestSetup, zk_client: KazooClient
) -> None:
    run_id = uuid.uuid4().hex
    sent = [
        celery_setup.app.send_task(EXCLUSIVE_TASK, args=(run_id, "key", HOLD_MS)) for _ in range(2)
    ]
    results = [result.get(timeout=RESULT_TIMEOUT) for result in sent]

    worker = celery_setup.worker
    assert worker is not None
    assert {result["hostname"] for result in results} == {worker.hostname()}
    assert all(result["accepted"] for result in results), results
    # The fleet's sections go to the broker's Redis (ZKLOCK_RECORD_URL defaults to the broker).
    records = redis.Redis.from_url(celery_setup.broker.config()["host_url"])
    try:
        events = SectionRecorder(records, run_id).events()
    finally:
        records.close()
    # One list, one total order: each section ends before the next one starts.
    assert [event.kind for event in events] == ["enter", "writing", "write", "exit"] * 2, events
    first, second = events[:4], events[4:]
    assert {event.task_id for event in first} | {event.task_id for event in second} == {
        result.id for result in sent
    }
    assert len({event.task_id for event in first}) == len({event.task_id for event in second}) == 1
    assert first[0].token < second[0].token
    assert all(event.outcome == "ok" for event in (first[3], second[3]))  # the exits
    # The second call waited in the worker's main process (the gate), not in a pool process.
    # Both leases were released in the ZooKeeper container.
    assert [zk_client.exists(event.node) for event in (first[0], second[0])] == [None, None]
