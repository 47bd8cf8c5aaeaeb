"""The fleet on Docker Compose: its images, the Docker engine, and one compose project.

- :func:`build_images` makes the three images from Debian packages: ``compose/base-image``
  provides the base (pulled, or built with debootstrap where no registry is reachable), the
  ZooKeeper and Redis images install Debian's packages, and the worker image installs the
  library from wheels this machine built (``pip wheel``), so an image build needs nothing but
  the Debian mirror.
- :class:`DockerEngine` is a reachable Docker daemon: the one running, or a ``dockerd`` started
  here (as root) and stopped again by :meth:`DockerEngine.close`.
- :class:`ComposeProject` is one ``docker-compose`` project of ``compose/docker-compose.yml``:
  up with N workers, its containers, the host ports it published, down.

``python -m workers fleet`` (:mod:`workers.compose_run`) puts them together; what the fleet
is and how its faults work: ``docs/compose.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Final

__all__ = [
    "BASE_IMAGE",
    "COMPOSE_FILE",
    "IMAGES",
    "ComposeProject",
    "Container",
    "DockerEngine",
    "DockerError",
    "build_images",
    "docker",
]

ROOT: Final = Path(__file__).resolve().parents[1]
COMPOSE_DIR: Final = ROOT / "compose"
COMPOSE_FILE: Final = COMPOSE_DIR / "docker-compose.yml"
BASE_IMAGE: Final = "debian:bookworm-slim"
IMAGES: Final[Mapping[str, str]] = {
    "zookeeper": "celery-zklock/zookeeper:latest",
    "redis": "celery-zklock/redis:latest",
    "worker": "celery-zklock/worker:latest",
}
"""Image of each ``compose/<name>/Dockerfile``, as the compose file names them."""
WORKER_REQUIREMENTS: Final = ("celery-zklock", "celery[redis]", "gevent")
"""What the worker image installs: the library, Redis as broker (kombu's transport needs more
than redis-py) and gevent for ``ZKLOCK_POOL=gevent``."""
INPUTS_LABEL: Final = "org.celery-zklock.inputs"
"""The worker image's label holding :func:`worker_inputs_digest` of what it was built from."""
_NOT_INPUTS: Final = ("__pycache__", "*.pyc")
"""Names (at any depth) of what is left out of the worker image and of its digest."""
ZOO_SERVICES: Final = ("zoo1", "zoo2", "zoo3")
WORKER_SERVICE: Final = "worker"
DOCKER_TIMEOUT: Final = 120.0
BUILD_TIMEOUT: Final = 1800.0
ENGINE_START_TIMEOUT: Final = 60.0
#: ``down`` attempts while a network still has endpoints of removed containers, a second apart.
DOWN_ATTEMPTS: Final = 30
DOWN_RETRY_DELAY: Final = 1.0
_LOCK_DIR: Final = Path("/run/lock") if os.path.isdir("/run/lock") else Path(tempfile.gettempdir())
ENGINE_START: Final = _LOCK_DIR / "celery-zklock-dockerd.start"
ENGINE_USERS: Final = _LOCK_DIR / "celery-zklock-dockerd.users"
MISSING_WHEEL_ROUNDS: Final = 5
PORT_VARIABLES: Final = (
    "ZKLOCK_ZOO1_PORT", "ZKLOCK_ZOO2_PORT", "ZKLOCK_ZOO3_PORT", "ZKLOCK_REDIS_PORT",
    "ZKLOCK_RECORDS_PORT",
)  # fmt: skip
"""The compose file's host-port variables (127.0.0.1 only)."""
# pip's "No matching distribution found for async-timeout>=4.0.3; python_full_version < ..."
_MISSING: Final = re.compile(r"No matching distribution found for ([^;\s]+)")


class DockerError(RuntimeError):
    """A ``docker`` or ``docker-compose`` command failed, or no engine is usable; the message
    says which command and what it printed, or what to run."""


def docker(*args: str, timeout: float = DOCKER_TIMEOUT, check: bool = True) -> str:
    """Run ``docker ARGS``; its standard output. DockerError when it fails (and ``check``)."""
    return _run(["docker", *args], timeout=timeout, check=check)


def _run(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
    except FileNotFoundError:
        raise DockerError(f"{argv[0]} is not installed (make fleet installs it)") from None
    except subprocess.TimeoutExpired:
        raise DockerError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if check and done.returncode != 0:
        output = (done.stderr or done.stdout).strip()[-2000:]
        raise DockerError(f"`{' '.join(argv)}` failed (status {done.returncode}): {output}")
    return done.stdout


# ------------------------------------------------------------------------------- the engine


class DockerEngine:
    """A Docker daemon this process can use, until :meth:`close`.

    :meth:`ensure` finds the running one or starts ``dockerd`` (root only). :meth:`close` stops
    a daemon that :meth:`ensure` started, and nothing else, once no other process that found it
    running still uses it: two test runs side by side on a machine without an engine share the
    one the first started, and it stops when both are done. Users hold a shared ``flock`` on
    :data:`ENGINE_USERS`; starting and stopping happen under an exclusive one on
    :data:`ENGINE_START`.
    """

    def __init__(self, process: subprocess.Popen[bytes] | None, users: int | None) -> None:
        self._process = process
        self._users = users

    @property
    def started_here(self) -> bool:
        return self._process is not None

    @staticmethod
    def reachable() -> bool:
        """True if ``docker info`` answers."""
        try:
            docker("info", "--format", "{{.ServerVersion}}", timeout=20)
        except DockerError:
            return False
        return True

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why no engine can be had here (none runs and none can be started), or None."""
        if shutil.which("docker") is None:
            return "the docker client is missing: apt-get install -y docker.io"
        if DockerEngine.reachable():
            return None
        if shutil.which("dockerd") is None:
            return "no Docker engine runs and dockerd is missing: apt-get install -y docker.io"
        if os.geteuid() != 0:
            return (
                "no Docker engine runs, and only root can start one here: run `sudo dockerd &` "
                "(or start the docker service) and add yourself to the docker group"
            )
        return None

    @classmethod
    def ensure(cls, log_path: Path | None = None) -> DockerEngine:
        """The running engine, or a ``dockerd`` started now (logging to ``log_path``)."""
        reason = cls.unavailable_reason()
        if reason is not None:
            raise DockerError(reason)
        with _flocked(ENGINE_START, fcntl.LOCK_EX):
            users = _open_lock(ENGINE_USERS)
            fcntl.flock(users, fcntl.LOCK_SH)
            if cls.reachable():
                return cls(None, users)
            engine = cls(_start_dockerd(log_path), users)
            deadline = time.monotonic() + ENGINE_START_TIMEOUT
            while not cls.reachable():
                if engine._process_ended() or time.monotonic() >= deadline:
                    engine._stop_daemon()
                    engine._release()
                    raise DockerError(
                        f"dockerd did not come up within {ENGINE_START_TIMEOUT:.0f} s"
                        + (f" (see {log_path})" if log_path else "")
                    )
                time.sleep(0.2)
            return engine

    def close(self) -> None:
        """Stop being a user; stop the daemon this object started once no user is left."""
        if self._process is None:
            self._release()
            return
        with _flocked(ENGINE_START, fcntl.LOCK_EX):
            self._release()
            with _flocked(ENGINE_USERS, fcntl.LOCK_EX):  # waits for the other users
                self._stop_daemon()

    def _release(self) -> None:
        users, self._users = self._users, None
        if users is not None:
            os.close(users)  # drops the shared lock

    def _process_ended(self) -> bool:
        return self._process is None or self._process.poll() is not None

    def _stop_daemon(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _start_dockerd(log_path: Path | None) -> subprocess.Popen[bytes]:
    log = open(log_path or os.devnull, "ab")  # noqa: SIM115 - the daemon's output, closed here
    try:
        return subprocess.Popen(
            ["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


@contextlib.contextmanager
def _flocked(path: Path, operation: int) -> Iterator[None]:
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------- the images


def build_images(
    base: str = BASE_IMAGE,
    *,
    python: str | None = None,
    say: Callable[[str], None] = print,
    timeout: float = BUILD_TIMEOUT,
) -> None:
    """Build the fleet's three images on ``base`` (see the module docstring).

    ``python`` (default: this interpreter) runs ``pip wheel`` for the worker image's wheels;
    its Python minor version must be the base image's (3.11 on bookworm). Docker's layer cache
    makes a rebuild of the ZooKeeper and Redis images with nothing changed take seconds; the
    worker image, whose wheels are built afresh (about 45 s), is rebuilt only when what goes
    into it changed (:func:`worker_inputs_digest`, kept as the image's label), and then takes
    the newest dependencies its requirements allow.
    """
    started = time.monotonic()
    _run([str(COMPOSE_DIR / "base-image"), base], timeout=timeout)
    # The three builds share only the base, and mostly wait on the Debian mirror: side by side,
    # a first build takes about as long as the longest (the worker's) instead of the sum.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="image-build") as builds:
        waits = [
            builds.submit(_docker_build, name, COMPOSE_DIR / name, base, timeout)
            for name in ("zookeeper", "redis")
        ]
        waits.append(builds.submit(_build_worker_image, base, python or sys.executable, timeout))
        for done in waits:
            done.result()
    took = time.monotonic() - started
    say(f"images {', '.join(IMAGES.values())} on {base}: built in {took:.0f} s")


def _build_worker_image(base: str, python: str, timeout: float) -> None:
    """Build the worker image unless its label says it was built from what is here now."""
    digest = worker_inputs_digest(docker("image", "inspect", "-f", "{{.Id}}", base).strip())
    if _image_label(IMAGES["worker"], INPUTS_LABEL) == digest:
        return
    with tempfile.TemporaryDirectory(prefix="zklock-worker-image-") as staging:
        context = Path(staging)
        _stage_wheels(context / "wheels", base, python, timeout)
        ignore = shutil.ignore_patterns(*_NOT_INPUTS)
        shutil.copytree(ROOT / "workers", context / "workers", ignore=ignore)
        _docker_build("worker", context, base, timeout, label=f"{INPUTS_LABEL}={digest}")


def worker_inputs_digest(base_id: str) -> str:
    """A digest of what the worker image is made of: the base image's id, the requirements, the
    worker Dockerfile, and the files of this checkout that go into it (the library's wheel:
    ``pyproject.toml``, ``README.md``, ``celery_zklock/``; and ``workers/``)."""
    digest = hashlib.sha256(base_id.encode())
    digest.update("\n".join(WORKER_REQUIREMENTS).encode())
    files = [ROOT / "pyproject.toml", ROOT / "README.md", COMPOSE_DIR / "worker" / "Dockerfile"]
    for folder in (ROOT / "celery_zklock", ROOT / "workers"):
        files += sorted(
            path for path in folder.rglob("*") if path.is_file() and _is_input(path, folder)
        )
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _is_input(path: Path, folder: Path) -> bool:
    """False for a file :data:`_NOT_INPUTS` leaves out (by any name on its way from ``folder``)."""
    parts = path.relative_to(folder).parts
    return not any(fnmatch(part, name) for part in parts for name in _NOT_INPUTS)


def _image_label(image: str, label: str) -> str | None:
    """Label ``label`` of local image ``image``; None if the image or the label is missing."""
    found = docker(
        "image", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', image, check=False
    ).strip()
    return found if found and found != "<no value>" else None


def _stage_wheels(wheels: Path, base: str, python: str, timeout: float) -> None:
    """Every wheel of :data:`WORKER_REQUIREMENTS` (and ``requirements.txt`` naming them) in
    ``wheels``, for the worker image's Python.

    This machine's pip evaluates environment markers for its own interpreter, not the image's
    (redis wants ``async-timeout`` below Python 3.11.3, and bookworm has 3.11.2), so the image's
    Python stage is built first and asked, offline, what is still missing: each round downloads
    what it names, until it resolves.
    """
    python_stage = f"{IMAGES['worker']}-python"
    _docker_build(
        "worker", COMPOSE_DIR / "worker", base, timeout, tag=python_stage, target="python"
    )
    version = docker(
        "run",
        "--rm",
        python_stage,
        "python3",
        "-c",
        "import platform; print(platform.python_version())",
    ).strip()
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    download = [*pip, "download", "-q", "--only-binary=:all:", "--python-version", version,
                "--dest", str(wheels)]  # fmt: skip
    _run([*pip, "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)], timeout=timeout)
    (project,) = wheels.glob("celery_zklock-*.whl")
    (wheels / "requirements.txt").write_text("\n".join(WORKER_REQUIREMENTS) + "\n")
    _run([*download, str(project), *WORKER_REQUIREMENTS[1:]], timeout=timeout)
    resolve = (
        "python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --dry-run --no-index "
        "--disable-pip-version-check --find-links /wheels -r /wheels/requirements.txt"
    )
    for _ in range(MISSING_WHEEL_ROUNDS):
        mount = f"{wheels}:/wheels:ro"
        done = subprocess.run(
            ["docker", "run", "--rm", "-v", mount, python_stage, "sh", "-c", resolve],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if done.returncode == 0:
            return
        missing = _MISSING.findall(done.stderr)
        if not missing:
            raise DockerError(f"the worker image's wheels do not resolve: {done.stderr[-2000:]}")
        _run([*download, *missing], timeout=timeout)
    raise DockerError(
        f"the worker image's wheels still miss some after {MISSING_WHEEL_ROUNDS} rounds"
    )


def _docker_build(
    name: str,
    context: Path,
    base: str,
    timeout: float,
    *,
    tag: str = "",
    target: str = "",
    label: str = "",
) -> None:
    docker(
        "build", "-q", "--build-arg", f"BASE={base}", "-t", tag or IMAGES[name],
        *(["--target", target] if target else []),
        *(["--label", label] if label else []),
        "-f", str(COMPOSE_DIR / name / "Dockerfile"), str(context),
        timeout=timeout,
    )  # fmt: skip


# ------------------------------------------------------------------------------ a project


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class Container:
    """One container of a project: ``hostname`` is what its processes see (a worker's Celery
    node name is ``celery@<hostname>``)."""

    id: str
    name: str
    service: str
    hostname: str
    running: bool
    paused: bool


class ComposeProject:
    """``docker-compose -p NAME -f compose/docker-compose.yml`` with ``env`` on top of ours.

    Host ports not given in ``env`` are free ports picked now, so that projects never clash
    with each other or with what the machine runs, and fixed, so that a container a fault
    restarts keeps its port (Docker would pick a new one for port 0); :meth:`port` reads them
    back. ``env`` also configures the workers (``ZKLOCK_POOL``, ``ZKLOCK_SESSION_TIMEOUT``...).
    """

    def __init__(self, name: str, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.env: dict[str, str] = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")},
            **{variable: str(_free_port()) for variable in PORT_VARIABLES},
            **(env or {}),
        }

    def compose(self, *args: str, timeout: float = DOCKER_TIMEOUT) -> str:
        """Run ``docker-compose ARGS`` on this project; its standard output."""
        argv = ["docker-compose", "-p", self.name, "-f", str(COMPOSE_FILE), *args]
        return _run(argv, timeout=timeout, env=self.env, cwd=COMPOSE_DIR)

    def up(self, workers: int, timeout: float = 300.0) -> None:
        """Start everything with ``workers`` worker containers; returns once ZooKeeper and Redis
        are healthy (the workers wait for that) and every worker container runs."""
        self.compose("up", "-d", "--no-build", "--scale", f"{WORKER_SERVICE}={workers}",
                     timeout=timeout)  # fmt: skip
        running = [c for c in self.containers(WORKER_SERVICE) if c.running]
        if len(running) != workers:
            raise DockerError(f"{len(running)} of {workers} worker containers run after up")

    def down(self) -> None:
        """Stop and remove the project's containers, networks and volumes.

        dockerd releases a removed container's network endpoints a little later, so a network
        can still have "active endpoints" when compose removes it (seen with two runs sharing
        one dockerd): ``down`` is run again, a second apart, until it goes through.
        """
        for attempt in range(1, DOWN_ATTEMPTS + 1):
            try:
                self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=180)
                return
            except DockerError as exc:
                if "has active endpoints" not in str(exc) or attempt == DOWN_ATTEMPTS:
                    raise
            time.sleep(DOWN_RETRY_DELAY)

    def logs(self, *services: str, tail: int = 50) -> str:
        """The last ``tail`` log lines of ``services`` (all when none), for a failure report."""
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services)
        except DockerError as exc:
            return str(exc)

    def port(self, service: str, private_port: int) -> int:
        """The host port published for ``service``'s ``private_port``."""
        out = self.compose("port", service, str(private_port)).strip()
        _, _, port = out.rpartition(":")
        if not port.isdigit():
            raise DockerError(f"{service} publishes no port {private_port} (got {out!r})")
        return int(port)

    def network(self, name: str) -> str:
        """Docker's name of the project's network ``name`` (``coordination``, ``data``)."""
        return f"{self.name}_{name}"

    def containers(self, service: str | None = None) -> list[Container]:
        """The project's containers (of ``service``), running or not, by creation order."""
        filters = ["--filter", f"label=com.docker.compose.project={self.name}"]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = docker("ps", "-a", "-q", "--no-trunc", *filters).split()
        if not ids:
            return []
        inspected = json.loads(docker("inspect", *ids))
        found = [
            Container(
                id=item["Id"],
                name=item["Name"].lstrip("/"),
                service=item["Config"]["Labels"].get("com.docker.compose.service", ""),
                hostname=item["Config"]["Hostname"],
                running=bool(item["State"]["Running"]),
                paused=bool(item["State"]["Paused"]),
            )
            for item in sorted(inspected, key=lambda i: str(i["Created"]))
        ]
        return found

    def container(self, service: str) -> Container:
        """The one container of ``service`` (a ZooKeeper node, a Redis server)."""
        found = self.containers(service)
        if len(found) != 1:
            raise DockerError(f"expected one {service} container, found {len(found)}")
        return found[0]

    def worker_of(self, nodename: str) -> Container | None:
        """The worker container whose Celery node name is ``nodename`` (``name@hostname``)."""
        hostname = nodename.rpartition("@")[2]
        for container in self.containers(WORKER_SERVICE):
            if container.hostname == hostname:
                return container
        return None

    # -- what a client on this machine uses ----------------------------------------------
    def zk_hosts(self) -> str:
        return ",".join(f"127.0.0.1:{self.port(s, 2181)}" for s in ZOO_SERVICES)

    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.port('redis', 6379)}/0"

    def records_url(self) -> str:
        return f"redis://127.0.0.1:{self.port('records', 6379)}/0"
