"""pytest plugin: ZooKeeper, Redis and kazoo fixtures backed by the local stack.

Opt-in: installing celery-zklock does not load it (its fixture names are plain words that
other plugins may use too). Load it in your top-level ``conftest.py``::

    pytest_plugins = ["celery_zklock.testing.plugin"]

or with ``pytest -p celery_zklock.testing.plugin``. Importing it starts nothing; each fixture
starts what it needs the first time a test asks for it, and stops it afterwards.

Fixtures:

* ``zk_server`` (session): a started :class:`ZooKeeperServer`; or, when ``ZKLOCK_TEST_ZK_HOSTS``
  is set, an :class:`ExternalZooKeeper` describing that server (nothing is started).
* ``zk_hosts`` (session): its connection string.
* ``redis_server`` (session): a started :class:`RedisServer`; or an :class:`ExternalRedis` when
  ``ZKLOCK_TEST_REDIS_URL`` is set. ``redis_url`` (session): its URL.
* ``rabbitmq_server`` (session): a started private :class:`RabbitMQServer` node;
  ``amqp_url`` (session): its URL.
* ``zk_client`` (function): a connected ``KazooClient`` on ``zk_hosts``, stopped and closed after.
* ``lock_root`` (function): a unique znode path ``/zklock-test/<test-name>-<8 hex>`` that does not
  exist yet (not created); everything under it is deleted after the test.
* ``zk_ensemble`` (function): a started 3-node :class:`ZooKeeperEnsemble`, stopped after. Not
  shared between tests, because tests kill its nodes.
* ``zk_stack_factory`` (function): a :class:`StackFactory` that starts extra servers, ensembles
  and Redis servers with given options and stops them all after the test (a secured one with
  ``zk_stack_factory.server(security=ZooKeeperSecurity(...))``).
* ``zk_secure_server`` (session): a started :class:`ZooKeeperServer` with
  ``security=ZooKeeperSecurity()``: SASL DIGEST-MD5 users ``alice`` and ``bob`` with generated
  passwords (``.sasl_users``), digest auth, a TLS port (``.secure_port``, ``.tls_hosts``,
  ``.ca_file``, ``.wrong_ca_file``) and the plain port (``.hosts``). Always started locally,
  also when ``ZKLOCK_TEST_ZK_HOSTS`` is set.
* ``zk_tls_only_server`` (session): the same with the plain port off (``.hosts`` raises).

Servers are started from the main thread, as fixtures run there; see
:mod:`celery_zklock.testing.processes` for why that matters.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from celery_zklock.testing.processes import StackError
from celery_zklock.testing.rabbitmq import RabbitMQServer
from celery_zklock.testing.redis_server import RedisServer
from celery_zklock.testing.security import ZooKeeperSecurity
from celery_zklock.testing.zookeeper import ZooKeeperEnsemble, ZooKeeperServer

if TYPE_CHECKING:
    from kazoo.client import KazooClient

ZK_HOSTS_ENV = "ZKLOCK_TEST_ZK_HOSTS"
REDIS_URL_ENV = "ZKLOCK_TEST_REDIS_URL"
LOCK_ROOT_PARENT = "/zklock-test"
CLIENT_START_TIMEOUT = 15.0


@dataclass(frozen=True)
class ExternalZooKeeper:
    """A ZooKeeper that this plugin did not start (from ``ZKLOCK_TEST_ZK_HOSTS``)."""

    hosts: str
    pid: None = None

    @property
    def port(self) -> int:
        """The port of the first host in ``hosts``."""
        first = self.hosts.split(",")[0].split("/")[0]
        return int(first.rsplit(":", 1)[1]) if ":" in first else 2181


@dataclass(frozen=True)
class ExternalRedis:
    """A Redis that this plugin did not start (from ``ZKLOCK_TEST_REDIS_URL``)."""

    url: str
    pid: None = None


class StackFactory:
    """Starts extra stack pieces for one test; :meth:`stop_all` stops them (newest first)."""

    def __init__(self) -> None:
        self._started: list[ZooKeeperServer | ZooKeeperEnsemble | RedisServer] = []

    def server(self, *, timeout: float = 30.0, **options: Any) -> ZooKeeperServer:
        """A started standalone server; ``options`` are :class:`ZooKeeperServer`'s keywords
        (``security=ZooKeeperSecurity(plain=False)`` for a TLS-only one)."""
        server = ZooKeeperServer(**options)
        self._started.append(server)
        return server.start(timeout=timeout)

    def ensemble(
        self, size: int = 3, *, timeout: float = 30.0, **options: Any
    ) -> ZooKeeperEnsemble:
        """A started ensemble; ``options`` are :class:`ZooKeeperEnsemble`'s keywords."""
        ensemble = ZooKeeperEnsemble(size, **options)
        self._started.append(ensemble)
        return ensemble.start(timeout=timeout)

    def redis(self, *, timeout: float = 10.0, **options: Any) -> RedisServer:
        """A started Redis server; ``options`` are :class:`RedisServer`'s keywords."""
        redis = RedisServer(**options)
        self._started.append(redis)
        return redis.start(timeout=timeout)

    def stop_all(self) -> None:
        """Stop everything this factory started; returns once every process is gone."""
        while self._started:
            self._started.pop().stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ensemble: needs a 3-node ZooKeeper ensemble")


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer | ExternalZooKeeper]:
    """A started standalone ZooKeeper for the session, or the external one from the env."""
    external = os.environ.get(ZK_HOSTS_ENV, "").strip()
    if external:
        yield ExternalZooKeeper(external)
        return
    with ZooKeeperServer() as server:
        yield server


@pytest.fixture(scope="session")
def zk_secure_server() -> Iterator[ZooKeeperServer]:
    """A started server with SASL users alice and bob, digest auth, TLS and the plain port."""
    with ZooKeeperServer(security=ZooKeeperSecurity()) as server:
        yield server


@pytest.fixture(scope="session")
def zk_tls_only_server() -> Iterator[ZooKeeperServer]:
    """A started server like ``zk_secure_server`` whose only client port is the TLS one."""
    with ZooKeeperServer(security=ZooKeeperSecurity(plain=False)) as server:
        yield server


@pytest.fixture(scope="session")
def zk_hosts(zk_server: ZooKeeperServer | ExternalZooKeeper) -> str:
    """The ZooKeeper connection string for the session."""
    return zk_server.hosts


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | ExternalRedis]:
    """A started Redis for the session, or the external one from the env."""
    external = os.environ.get(REDIS_URL_ENV, "").strip()
    if external:
        yield ExternalRedis(external)
        return
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | ExternalRedis) -> str:
    """The Redis URL for the session."""
    return redis_server.url


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQServer]:
    """A started private RabbitMQ node for the session (Debian's ``rabbitmq-server``)."""
    with RabbitMQServer() as server:
        yield server


@pytest.fixture(scope="session")
def amqp_url(rabbitmq_server: RabbitMQServer) -> str:
    """The AMQP URL of the session's RabbitMQ node (user ``guest``)."""
    return rabbitmq_server.url


def _connected_client(hosts: str) -> KazooClient:
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts)
    try:
        client.start(timeout=CLIENT_START_TIMEOUT)
    except Exception as exc:
        client.close()
        raise StackError(
            f"could not connect a kazoo client to ZooKeeper at {hosts} within "
            f"{CLIENT_START_TIMEOUT:.0f} s: {exc!r}"
        ) from exc
    return client


def _close(client: KazooClient) -> None:
    client.stop()
    client.close()


@pytest.fixture
def zk_client(zk_hosts: str) -> Iterator[KazooClient]:
    """A started ``KazooClient`` on ``zk_hosts``; stopped and closed after the test."""
    client = _connected_client(zk_hosts)
    try:
        yield client
    finally:
        _close(client)


def _znode_safe(name: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")[:limit] or "test"


@pytest.fixture
def lock_root(request: pytest.FixtureRequest, zk_hosts: str) -> Iterator[str]:
    """A unique, not yet existing znode path for this test; deleted recursively after it.

    Cleanup uses its own client (the test may have broken ``zk_client``'s session) and raises
    if the tree cannot be removed within 10 s (something still creates nodes under it).
    """
    path = f"{LOCK_ROOT_PARENT}/{_znode_safe(request.node.name)}-{uuid.uuid4().hex[:8]}"
    yield path
    from kazoo.exceptions import NoNodeError, NotEmptyError

    client = _connected_client(zk_hosts)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                _delete_tree(client, path)
                return
            except NoNodeError:
                return
            except NotEmptyError:
                if time.monotonic() >= deadline:
                    raise StackError(
                        f"lock_root cleanup: {path} kept getting new children for 10 s; "
                        "a process still writes under it after the test ended"
                    ) from None
                time.sleep(0.05)
    finally:
        _close(client)


_TREE_TIMEOUT = 30.0


def _delete_tree(client: KazooClient, path: str) -> None:
    """Delete ``path`` and everything under it, one level at a time, each level's requests
    sent at once (kazoo's ``delete(recursive=True)`` waits for one node at a time: seconds for
    the thousands of nodes some tests leave). A node that got a child meanwhile raises
    NotEmptyError; a node already gone is skipped, and NoNodeError means ``path`` itself was."""
    from kazoo.exceptions import NoNodeError

    levels: list[list[str]] = []
    frontier = [path]
    while frontier:
        levels.append(frontier)
        listings = [(node, client.get_children_async(node)) for node in frontier]
        frontier = []
        for node, listing in listings:
            try:
                children = listing.get(timeout=_TREE_TIMEOUT)
            except NoNodeError:
                if node == path:
                    raise
                continue
            frontier.extend(f"{node.rstrip('/')}/{child}" for child in children)
    for level in reversed(levels):
        deletes = [client.delete_async(node) for node in level]
        for done in deletes:
            try:
                done.get(timeout=_TREE_TIMEOUT)
            except NoNodeError:
                continue


@pytest.fixture
def zk_ensemble() -> Iterator[ZooKeeperEnsemble]:
    """A started 3-node ensemble for this test only; stopped after it."""
    with ZooKeeperEnsemble(3) as ensemble:
        yield ensemble


@pytest.fixture
def zk_stack_factory() -> Iterator[StackFactory]:
    """Starts extra servers/ensembles/Redis for this test; stops them all after it."""
    factory = StackFactory()
    try:
        yield factory
    finally:
        factory.stop_all()
