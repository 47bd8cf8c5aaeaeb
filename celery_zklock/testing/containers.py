"""pytest plugin: pytest-celery's Docker set-up (``celery_setup``) on celery-zklock's images.

Opt-in, and it needs pytest-celery (``pip install pytest-celery``). In your top-level
``conftest.py`` or a test module::

    pytest_plugins = ["celery_zklock.testing.containers"]

(pytest gives a plugin's fixtures to every test collected after it is loaded, even when a test
module loads it.) It replaces pytest-celery's defaults, which pull ``redis:latest`` and build
a worker on a python image, with local images only; an image that is not there fails the test
with a message instead of being pulled. Each ``VOLUME`` of an image is mounted as a tmpfs, so
no test leaves an anonymous volume behind (pytest-docker-tools removes containers without their
volumes). Each test gets, on pytest-celery's network for that test:

* ``celery_broker`` and ``celery_backend``: one Redis each, from ``$ZKLOCK_REDIS_IMAGE``
  (default :data:`REDIS_IMAGE`); no parametrisation over other brokers or backends.
* ``zklock_zookeeper``: a standalone ZooKeeper (:class:`ZooKeeperContainer`) from
  ``$ZKLOCK_ZOOKEEPER_IMAGE`` (default :data:`ZOOKEEPER_IMAGE`), ready once its health check
  passes; ``.hosts`` is its connection string on the network, ``.host_hosts`` from the tests.
* ``celery_worker``: one worker (:class:`ZkLockWorkerContainer`) from ``$ZKLOCK_WORKER_IMAGE``
  (default :data:`WORKER_IMAGE`), running ``celery -A $ZKLOCK_WORKER_APP worker`` (the image's
  variable; default :data:`DEFAULT_WORKER_APP`, the fleet app in our image) with
  ``ZKLOCK_HOSTS`` (the library's setting), ``CELERY_BROKER_URL``/``CELERY_RESULT_BACKEND``
  (which Celery reads when the app sets no URLs) and the same URLs as
  ``ZKLOCK_BROKER_URL``/``ZKLOCK_RESULT_BACKEND`` (the fleet app's settings). Add variables by
  overriding ``default_worker_env``; pool and concurrency through a subclass
  (``pool()``, ``concurrency()``) returned by ``default_worker_container_cls``.

``celery_setup.app`` sends to that worker by task name (``app.send_task``). The worker has your
tasks, not pytest-celery's helpers: ``celery_setup.ready(ping=True)`` and
``worker.get_running_processes_info()`` do not work against it.

Your own worker image, built on ours (it has Celery with Redis, celery-zklock and gevent in
``/opt/venv``, and runs as user ``worker``)::

    FROM celery-zklock/worker:latest
    COPY --chown=worker myproject /opt/app/myproject
    ENV PYTHONPATH=/opt/app ZKLOCK_WORKER_APP=myproject.celery:app

then ``docker build -t myproject-worker:test .`` and run pytest with
``ZKLOCK_WORKER_IMAGE=myproject-worker:test``.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from typing import Any, Final

import pytest
from celery.result import AsyncResult

try:
    from pytest_celery import (  # type: ignore[import-untyped]
        CeleryTestBackend,
        CeleryTestContainer,
        CeleryTestWorker,
        CeleryWorkerContainer,
        RedisContainer,
        RedisTestBackend,
        RedisTestBroker,
    )
    from pytest_docker_tools import container, fxtr  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"celery_zklock.testing.containers is a pytest-celery plugin and needs pytest-celery "
        f"(pip install pytest-celery): {exc}"
    ) from exc

__all__ = [
    "DEFAULT_WORKER_APP",
    "REDIS_IMAGE",
    "WORKER_IMAGE",
    "ZOOKEEPER_IMAGE",
    "ImageMissing",
    "ZkLockRedisContainer",
    "ZkLockWorkerContainer",
    "ZooKeeperContainer",
    "image_name",
]

ZOOKEEPER_IMAGE: Final = "celery-zklock/zookeeper:latest"
REDIS_IMAGE: Final = "celery-zklock/redis:latest"
WORKER_IMAGE: Final = "celery-zklock/worker:latest"
IMAGE_VARIABLES: Final[Mapping[str, tuple[str, str]]] = {
    "zookeeper": ("ZKLOCK_ZOOKEEPER_IMAGE", ZOOKEEPER_IMAGE),
    "redis": ("ZKLOCK_REDIS_IMAGE", REDIS_IMAGE),
    "worker": ("ZKLOCK_WORKER_IMAGE", WORKER_IMAGE),
}
"""Image role -> (the variable naming the image, its default)."""
WORKER_APP_VARIABLE: Final = "ZKLOCK_WORKER_APP"
DEFAULT_WORKER_APP: Final = "workers.app:app"
ZOOKEEPER_PORT: Final = 2181
REDIS_PORT: Final = "6379/tcp"
CONTAINER_TIMEOUT: Final = 60
"""Seconds a container may take to become ready (ZooKeeper's JVM is the slowest)."""


class ImageMissing(LookupError):
    """A configured image is not in the local Docker engine (this plugin never pulls)."""


def image_name(role: str, environ: Mapping[str, str] | None = None) -> str:
    """The image to use for ``role`` (``zookeeper``, ``redis`` or ``worker``): its variable in
    ``environ`` (default ``os.environ``) if set and not blank, else the default."""
    variable, default = IMAGE_VARIABLES[role]
    env = os.environ if environ is None else environ
    return env.get(variable, "").strip() or default


def _local_image(docker_client: Any, role: str) -> Any:
    """The ``docker`` SDK image object for ``role``; ImageMissing if the engine lacks it."""
    import docker.errors  # type: ignore[import-untyped]

    name = image_name(role)
    try:
        return docker_client.images.get(name)
    except docker.errors.ImageNotFound:
        variable = IMAGE_VARIABLES[role][0]
        raise ImageMissing(
            f"image {name} is not in the local Docker engine and is never pulled: build it "
            "(in celery-zklock's repository: python -m workers fleet --build-only) or set "
            f"{variable} to an image that is there"
        ) from None


def _volumes_as_tmpfs(image: Any) -> dict[str, str]:
    """A tmpfs mount (``containers.run(tmpfs=...)``) for each ``VOLUME`` of ``image``."""
    return dict.fromkeys(image.attrs["Config"].get("Volumes") or {}, "")


def _address(container: Any, port: str) -> tuple[str, int]:
    """Where the tests reach ``port`` of ``container``: its published port on 127.0.0.1, or,
    when the tests run in a container themselves, the container's address on its network."""
    container._wait_port(port)
    host, host_port = container.get_addr(port)
    return str(host), int(host_port)


class ZkLockRedisContainer(RedisContainer):  # type: ignore[misc]
    """pytest-celery's Redis container, reachable from tests that run inside a container too.

    pytest-celery's ``host_url`` always names ``localhost``; inside a container,
    pytest-docker-tools gives the container's address and unpublished port instead, so that URL
    would point at nothing. Here ``host_url`` uses the address that goes with the port.
    """

    @property
    def host_url(self) -> str:
        host, port = _address(self, REDIS_PORT)
        return f"{self.prefix()}{host}:{port}/{self.vhost}"


class ZooKeeperContainer(CeleryTestContainer):  # type: ignore[misc]
    """A ZooKeeper node of the celery-zklock ZooKeeper image (standalone unless its environment
    sets ``ZOO_SERVERS``). Ready once Docker reports it healthy (an image without a health
    check: once port 2181 listens)."""

    @property
    def hostname(self) -> str:
        """Its host name on the network: other containers there reach it by this name."""
        return str(self.attrs["Config"]["Hostname"])

    @property
    def hosts(self) -> str:
        """Its connection string for containers on the network (``ZKLOCK_HOSTS``)."""
        return f"{self.hostname}:{ZOOKEEPER_PORT}"

    @property
    def host_hosts(self) -> str:
        """Its connection string for the tests' process."""
        host, port = _address(self, f"{ZOOKEEPER_PORT}/tcp")
        return f"{host}:{port}"

    @property
    def celeryconfig(self) -> dict[str, Any]:
        """The app setting that points celery-zklock at this node from the network."""
        return {"zklock_hosts": self.hosts}

    def ready(self) -> bool:
        if not super().ready():
            return False
        health = self.attrs["State"].get("Health")
        return health is None or health.get("Status") == "healthy"


class ZkLockWorkerContainer(CeleryWorkerContainer):  # type: ignore[misc]
    """A Celery worker of the celery-zklock worker image (or one built on it).

    It runs ``celery -A $ZKLOCK_WORKER_APP worker`` (the variable of the image, default
    :data:`DEFAULT_WORKER_APP`) with pytest-celery's node name and queue, :meth:`pool` and
    :meth:`concurrency`, and without mingle, gossip and heartbeats, so it is ready in about a
    second. Its environment is pytest-celery's without ``PYTHONPATH`` (the image's stays),
    plus the fleet's names for the broker and backend URLs (see the module doc).
    """

    @classmethod
    def pool(cls) -> str:
        """The worker pool (``--pool``)."""
        return "prefork"

    @classmethod
    def concurrency(cls) -> int:
        """Pool processes, threads or greenlets (``--concurrency``)."""
        return 2

    @classmethod
    def command(
        cls,
        *args: str,
        debugpy: bool = False,
        wait_for_client: bool = True,
        **kwargs: dict[str, Any],
    ) -> list[str]:
        """The worker's command line; ``args`` are appended to ``celery worker``'s options.

        Raises ValueError with ``debugpy``: the image has no debugpy.
        """
        if debugpy:
            raise ValueError("the celery-zklock worker image has no debugpy")
        launcher = f'exec celery -A "${{{WORKER_APP_VARIABLE}:-{DEFAULT_WORKER_APP}}}" worker "$@"'
        return [
            "sh",
            "-c",
            launcher,
            "celery",
            f"--loglevel={cls.log_level()}",
            "-n",
            f"{cls.worker_name()}@%h",
            "-Q",
            cls.worker_queue(),
            "--pool",
            cls.pool(),
            "--concurrency",
            str(cls.concurrency()),
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            *args,
        ]

    @classmethod
    def initial_env(
        cls, celery_worker_cluster_config: dict[str, Any], initial: dict[str, str] | None = None
    ) -> dict[str, str]:
        """pytest-celery's worker environment for the clusters, plus ``initial``, without its
        ``PYTHONPATH`` (unless ``initial`` sets one), and with ``ZKLOCK_BROKER_URL`` and
        ``ZKLOCK_RESULT_BACKEND`` set to the Celery URLs unless ``initial`` sets them."""
        given = dict(initial or {})
        env: dict[str, str] = dict(super().initial_env(celery_worker_cluster_config, given))
        if "PYTHONPATH" not in given:
            env.pop("PYTHONPATH", None)
        for celery_name, zklock_name in (
            ("CELERY_BROKER_URL", "ZKLOCK_BROKER_URL"),
            ("CELERY_RESULT_BACKEND", "ZKLOCK_RESULT_BACKEND"),
        ):
            if celery_name in env:
                env.setdefault(zklock_name, env[celery_name])
        return env


# ------------------------------------------------------------------------- broker and backend


@pytest.fixture
def celery_broker(celery_redis_broker: RedisTestBroker) -> RedisTestBroker:
    """The Redis broker only (pytest-celery's would also parametrise over RabbitMQ)."""
    return celery_redis_broker


class ZkLockRedisTestBackend(RedisTestBackend):  # type: ignore[misc]
    """pytest-celery's Redis backend whose teardown does not evaluate lazy tasks.

    pytest-celery 1.3 finds live ``AsyncResult`` objects with ``isinstance`` over every object
    in memory; ``isinstance`` asks a Celery ``PromiseProxy`` (a task not yet bound to its app)
    for its ``__class__``, which finalizes that app: an app of another test module that reads
    its settings from the environment then fails the teardown. ``type()`` asks nothing.
    """

    def teardown(self) -> None:
        gc.collect()
        for found in gc.get_objects():
            if issubclass(type(found), AsyncResult):
                with contextlib.suppress(Exception):
                    found.backend = None
        CeleryTestBackend.teardown(self)


@pytest.fixture
def celery_redis_backend(default_redis_backend: RedisContainer) -> Iterator[RedisTestBackend]:
    """pytest-celery's fixture of that name, with :class:`ZkLockRedisTestBackend`."""
    backend = ZkLockRedisTestBackend(default_redis_backend)
    yield backend
    backend.teardown()


@pytest.fixture
def celery_backend(celery_redis_backend: RedisTestBackend) -> RedisTestBackend:
    """The Redis result backend only."""
    return celery_redis_backend


@pytest.fixture
def default_redis_broker_cls() -> type[ZkLockRedisContainer]:
    """The broker's container class."""
    return ZkLockRedisContainer


@pytest.fixture
def default_redis_backend_cls() -> type[ZkLockRedisContainer]:
    """The backend's container class."""
    return ZkLockRedisContainer


@pytest.fixture
def default_redis_broker_image(docker_client: Any) -> str:
    """The id of the broker's image, ``$ZKLOCK_REDIS_IMAGE`` or :data:`REDIS_IMAGE` (the id:
    a rebuild that moves the tag during the test changes nothing); ImageMissing if absent."""
    return str(_local_image(docker_client, "redis").id)


@pytest.fixture
def default_redis_backend_image(docker_client: Any) -> str:
    """The id of the backend's image: the broker's."""
    return str(_local_image(docker_client, "redis").id)


@pytest.fixture
def default_redis_broker_tmpfs(
    docker_client: Any, default_redis_broker_image: str
) -> dict[str, str]:
    """The broker's tmpfs mounts: one for each volume of its image."""
    return _volumes_as_tmpfs(docker_client.images.get(default_redis_broker_image))


@pytest.fixture
def default_redis_backend_tmpfs(
    docker_client: Any, default_redis_backend_image: str
) -> dict[str, str]:
    """The backend's tmpfs mounts: one for each volume of its image."""
    return _volumes_as_tmpfs(docker_client.images.get(default_redis_backend_image))


default_redis_broker = container(
    image="{default_redis_broker_image}",
    ports=fxtr("default_redis_broker_ports"),
    environment=fxtr("default_redis_broker_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=ZkLockRedisContainer,
    timeout=CONTAINER_TIMEOUT,
    command=fxtr("default_redis_broker_command"),
    tmpfs=fxtr("default_redis_broker_tmpfs"),
)

default_redis_backend = container(
    image="{default_redis_backend_image}",
    ports=fxtr("default_redis_backend_ports"),
    environment=fxtr("default_redis_backend_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=ZkLockRedisContainer,
    timeout=CONTAINER_TIMEOUT,
    command=fxtr("default_redis_backend_command"),
    tmpfs=fxtr("default_redis_backend_tmpfs"),
)


# --------------------------------------------------------------------------------- ZooKeeper


@pytest.fixture
def zklock_zookeeper_image(docker_client: Any) -> str:
    """The id of ZooKeeper's image, ``$ZKLOCK_ZOOKEEPER_IMAGE`` or :data:`ZOOKEEPER_IMAGE`;
    ImageMissing if absent."""
    return str(_local_image(docker_client, "zookeeper").id)


@pytest.fixture
def zklock_zookeeper_tmpfs(docker_client: Any, zklock_zookeeper_image: str) -> dict[str, str]:
    """ZooKeeper's tmpfs mounts: one for each volume of its image (its data directory)."""
    return _volumes_as_tmpfs(docker_client.images.get(zklock_zookeeper_image))


@pytest.fixture
def zklock_zookeeper_env() -> dict[str, str]:
    """ZooKeeper's environment (see the image's entrypoint: ``ZOO_TICK_TIME``, ...); none."""
    return {}


zklock_zookeeper = container(
    image="{zklock_zookeeper_image}",
    ports={f"{ZOOKEEPER_PORT}/tcp": None},
    environment=fxtr("zklock_zookeeper_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=ZooKeeperContainer,
    timeout=CONTAINER_TIMEOUT,
    tmpfs=fxtr("zklock_zookeeper_tmpfs"),
)
"""A standalone ZooKeeper on the test's network (a :class:`ZooKeeperContainer`)."""


# ------------------------------------------------------------------------------------ worker


@pytest.fixture
def celery_worker(celery_setup_worker: CeleryTestWorker) -> CeleryTestWorker:
    """The one worker (no parametrisation)."""
    return celery_setup_worker


@pytest.fixture(scope="session")
def celery_base_worker_image(docker_client: Any) -> Any:
    """The worker's image (a ``docker`` SDK image), ``$ZKLOCK_WORKER_IMAGE`` or
    :data:`WORKER_IMAGE`; ImageMissing if absent. pytest-celery's builds one instead."""
    return _local_image(docker_client, "worker")


@pytest.fixture
def default_worker_tmpfs(celery_base_worker_image: Any) -> dict[str, str]:
    """The worker's tmpfs mounts: one for each volume of its image (ours has none)."""
    return _volumes_as_tmpfs(celery_base_worker_image)


@pytest.fixture
def default_worker_container_cls() -> type[ZkLockWorkerContainer]:
    """The worker's container class; return a subclass to change its command or pool."""
    return ZkLockWorkerContainer


@pytest.fixture
def default_worker_env(
    default_worker_container_cls: type[ZkLockWorkerContainer],
    celery_worker_cluster_config: dict[str, Any],
    zklock_zookeeper: ZooKeeperContainer,
) -> dict[str, str]:
    """The worker's environment (see :meth:`ZkLockWorkerContainer.initial_env`), with
    ``ZKLOCK_HOSTS`` naming :func:`zklock_zookeeper`, which is started first."""
    return default_worker_container_cls.initial_env(
        celery_worker_cluster_config, {"ZKLOCK_HOSTS": zklock_zookeeper.hosts}
    )


default_worker_container = container(
    image="{celery_base_worker_image.id}",
    ports=fxtr("default_worker_ports"),
    environment=fxtr("default_worker_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=ZkLockWorkerContainer,
    timeout=CONTAINER_TIMEOUT,
    command=fxtr("default_worker_command"),
    tmpfs=fxtr("default_worker_tmpfs"),
)
