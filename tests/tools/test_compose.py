"""compose/: the Compose file validates and describes the fleet the README promises, and its
images are made as docs/compose.md says (Debian packages, wheels staged by the host).

No Docker engine is needed: ``docker-compose config`` validates and normalises the file offline;
the ZooKeeper entrypoint runs here with a stand-in ``java``. The fleet itself runs in
tests/fleet/test_compose_fleet.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workers import compose
from workers.compose import IMAGES, WORKER_REQUIREMENTS
from workers.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "worker" / "Dockerfile"
ENTRYPOINT = ROOT / "compose" / "zookeeper" / "entrypoint"
ZOO_SERVICES = ("zoo1", "zoo2", "zoo3")
SERVER_LINE = re.compile(r"^server\.(\d+)=([\w.-]+):2888:3888;2181$")


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.skip("docker-compose is not installed: apt-get install -y docker-compose")
    return path


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    # Defaults in the file must be what is checked, not whatever the caller's shell exports.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    return subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _yaml_to_data(text: str) -> dict[str, Any]:
    """Parse YAML with PyYAML if this environment has it, else with docker-compose's own Python."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        pass
    else:
        loaded: dict[str, Any] = yaml.safe_load(text)
        return loaded
    # docker-compose v1 is a Python program that depends on PyYAML: its interpreter has it.
    with open(_docker_compose(), encoding="utf-8", errors="replace") as f:
        shebang = f.readline()
    if not shebang.startswith("#!"):
        pytest.fail("no PyYAML here and docker-compose is not a Python script: pip install pyyaml")
    interpreter = shlex.split(shebang[2:])
    done = subprocess.run(
        [
            *interpreter,
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)",
        ],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    converted: dict[str, Any] = json.loads(done.stdout)
    return converted


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    done = _compose("config")
    assert done.returncode == 0, done.stderr
    return _yaml_to_data(done.stdout)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def _published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port, short or long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((str(port.get("host_ip", "")), int(port["published"]), int(port["target"])))
        else:
            ip, host, container = str(port).split("/")[0].rsplit(":", 2)
            out.append((ip, int(host), int(container)))
    return out


def test_compose_file_validates() -> None:
    done = _compose("config", "-q")
    assert done.returncode == 0, done.stderr


def test_zookeeper_ensemble_is_consistent(config: dict[str, Any]) -> None:
    services = config["services"]
    zoo = {name: s for name, s in services.items() if s.get("image") == IMAGES["zookeeper"]}
    assert sorted(zoo) == list(ZOO_SERVICES)

    ids = {name: _environment(s)["ZOO_MY_ID"] for name, s in zoo.items()}
    assert sorted(ids.values()) == ["1", "2", "3"]

    server_lists = {_environment(s)["ZOO_SERVERS"] for s in zoo.values()}
    assert len(server_lists) == 1, "every node must be given the same ensemble"
    entries = [SERVER_LINE.match(item) for item in server_lists.pop().split()]
    assert all(entries)
    # server.N names the node whose ZOO_MY_ID is N.
    assert {m.group(1): m.group(2) for m in entries if m} == {v: k for k, v in ids.items()}

    # Healthy once serving: the image's own check (the workers wait for it).
    zoo_image = (ROOT / "compose" / "zookeeper" / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^HEALTHCHECK .*srvr.*Mode: \(leader\|follower", zoo_image, re.M | re.S)


def test_every_image_is_one_the_fleet_builds(config: dict[str, Any]) -> None:
    used = {str(s["image"]) for s in config["services"].values()}
    assert used == set(IMAGES.values())
    assert all("build" not in s for s in config["services"].values()), (
        "images come from `python -m workers fleet` / build_images, never a compose build"
    )
    for name in IMAGES:
        text = (ROOT / "compose" / name / "Dockerfile").read_text(encoding="utf-8")
        # One base argument, Debian's packages: nothing from Docker Hub but the base.
        assert re.search(r"^ARG BASE=debian:bookworm-slim$", text, re.MULTILINE), name
        assert re.search(r"^FROM \$\{BASE\}", text, re.MULTILINE), name
        assert "apt-get install" in text, name


def test_zookeeper_is_reached_on_its_own_network(config: dict[str, Any]) -> None:
    # A partition cuts a worker from `coordination` alone: Redis must not be on it.
    networks = {name: set(s["networks"]) for name, s in config["services"].items()}
    assert all(networks[zoo] == {"coordination"} for zoo in ZOO_SERVICES)
    assert networks["redis"] == networks["records"] == {"data"}
    assert networks["worker"] == {"coordination", "data"}


def test_zookeeper_entrypoint_writes_the_ensemble_config(tmp_path: Path) -> None:
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "java").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ZOO_DATA_DIR/java-args"\n')
    (stand_in / "java").chmod(0o755)
    env = {
        "PATH": f"{stand_in}:/usr/bin:/bin",
        "ZOO_DATA_DIR": str(tmp_path / "data"),
        "ZOO_MY_ID": "2",
        "ZOO_SERVERS": "server.1=zoo1:2888:3888;2181 server.2=zoo2:2888:3888;2181",
        "ZOO_TICK_TIME": "500",
        "ZOO_CONTAINER_CHECK_MS": "250",
    }
    subprocess.run(["bash", str(ENTRYPOINT)], env=env, check=True, timeout=30)
    data = tmp_path / "data"
    config = dict(
        line.split("=", 1) for line in (data / "zoo.cfg").read_text().splitlines() if "=" in line
    )
    assert config["tickTime"] == "500"
    assert config["minSessionTimeout"] == "1000"  # 2 x tick: the lease clock's rule
    assert config["server.1"] == "zoo1:2888:3888;2181"
    assert config["server.2"] == "zoo2:2888:3888;2181"
    assert config["4lw.commands.whitelist"] == "*"
    assert (data / "myid").read_text().strip() == "2"
    args = (data / "java-args").read_text().split()
    assert "-Dznode.container.checkIntervalMs=250" in args
    assert args[-2:] == ["org.apache.zookeeper.server.quorum.QuorumPeerMain", str(data / "zoo.cfg")]


def test_redis_services(config: dict[str, Any]) -> None:
    for name in ("redis", "records"):
        assert config["services"][name]["image"] == IMAGES["redis"], name
    redis_image = (ROOT / "compose" / "redis" / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^HEALTHCHECK .*redis-cli.*ping", redis_image, re.M | re.S)
    # The broker survives a restart without losing a message; the records server is apart.
    broker = _command(config["services"]["redis"])
    assert broker[broker.index("--appendonly") + 1] == "yes"
    assert broker[broker.index("--appendfsync") + 1] == "always"
    assert "/data" in [_volume_target(v) for v in config["services"]["redis"]["volumes"]]


def _volume_target(volume: Any) -> str:
    """The mount point of a volume in short (``source:target[:mode]``) or long syntax."""
    if isinstance(volume, dict):
        return str(volume["target"])
    return str(volume).split(":")[1]


def test_published_ports_are_loopback_only_and_distinct(config: dict[str, Any]) -> None:
    services = config["services"]
    names = (*ZOO_SERVICES, "redis", "records")
    published = {name: _published(services[name]) for name in names}
    for name, ports in published.items():
        assert ports, f"{name} publishes no port for a host-side load test"
        assert all(ip == "127.0.0.1" for ip, _, _ in ports), name
    assert [p[0][2] for p in published.values()] == [2181, 2181, 2181, 6379, 6379]
    host_ports = [host for ports in published.values() for _, host, _ in ports]
    assert len(set(host_ports)) == len(host_ports)


def test_worker_service_scales(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    assert _command(worker) == ["python", "-m", "workers", "worker"]
    assert "container_name" not in worker
    assert not worker.get("ports"), "a fixed host port would stop --scale worker=N"
    assert worker["image"] == IMAGES["worker"]

    env = _environment(worker)
    assert env["ZKLOCK_HOSTS"] == "zoo1:2181,zoo2:2181,zoo3:2181"
    assert env["ZKLOCK_BROKER_URL"] == "redis://redis:6379/0"
    assert env["ZKLOCK_RESULT_BACKEND"] == env["ZKLOCK_RECORD_URL"] == "redis://records:6379/0"
    assert env["ZKLOCK_POOL"] == "prefork"
    assert env["ZKLOCK_CONCURRENCY"] == "4"
    assert "ZKLOCK_SESSION_TIMEOUT" in env
    assert "ZKLOCK_VISIBILITY_TIMEOUT" in env
    # The environment is exactly what workers.settings reads, valid as it stands.
    settings = Settings.from_env(env)
    assert settings.visibility_timeout > 0

    depends = worker["depends_on"]
    assert {name: d["condition"] for name, d in depends.items()} == {
        **{name: "service_healthy" for name in ZOO_SERVICES},
        "redis": "service_healthy",
        "records": "service_healthy",
    }


def test_worker_settings_come_from_the_environment() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    env |= {"ZKLOCK_POOL": "gevent", "ZKLOCK_CONCURRENCY": "50", "ZKLOCK_SESSION_TIMEOUT": "3"}
    done = subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE_FILE), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    worker_env = _environment(_yaml_to_data(done.stdout)["services"]["worker"])
    assert worker_env["ZKLOCK_POOL"] == "gevent"
    assert worker_env["ZKLOCK_CONCURRENCY"] == "50"
    assert worker_env["ZKLOCK_SESSION_TIMEOUT"] == "3"


def test_worker_dockerfile_installs_staged_wheels_offline() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    # No index: only the wheels build_images staged, with the requirements it wrote.
    assert re.search(
        r"pip install -q --no-index --find-links /tmp/wheels -r /tmp/wheels/requirements\.txt",
        text,
    )
    assert "celery-zklock" in WORKER_REQUIREMENTS
    # The staged context holds wheels/ and workers/ only: every COPY source is one of them.
    for line in text.splitlines():
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            assert set(sources) <= {"wheels", "workers"}, line
    # The library's wheel holds no `workers`: the image runs the fleet from a folder on its path.
    assert _fleet_dir(text).startswith("/")
    assert re.search(r'^CMD \["python", "-m", "workers", "worker"\]$', text, re.MULTILINE)


def _fleet_dir(dockerfile: str) -> str:
    """The directory the Dockerfile copies ``workers`` into, checked to be its PYTHONPATH."""
    copied = re.search(r"^COPY workers (\S+)/workers/?$", dockerfile, re.MULTILINE)
    path = re.search(r"^ENV PYTHONPATH=(\S+)$", dockerfile, re.MULTILINE)
    assert copied and path, "the Dockerfile must copy workers/ into a folder on PYTHONPATH"
    assert copied.group(1) == path.group(1)
    return copied.group(1)


def test_the_image_layout_runs_the_fleet_from_its_path(tmp_path: Path) -> None:
    # The image's layout without Docker: workers/ copied into the Dockerfile's fleet folder, run
    # from another directory with only that folder on PYTHONPATH (the library is installed).
    fleet = tmp_path / _fleet_dir(DOCKERFILE.read_text(encoding="utf-8")).lstrip("/")
    shutil.copytree(ROOT / "workers", fleet / "workers")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    env["PYTHONPATH"] = str(fleet)
    found = subprocess.run(
        [sys.executable, "-c", "import workers; print(workers.__file__)"],
        cwd=home, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert Path(found.stdout.strip()).parent == fleet / "workers"
    done = subprocess.run(
        [sys.executable, "-m", "workers", "worker"],
        cwd=home, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr  # it ran, and asks for its settings
    assert "ZKLOCK_HOSTS is not set" in done.stderr


def test_down_runs_again_while_docker_still_holds_a_removed_container_s_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dockerd may answer "has active endpoints" for a network whose containers compose just
    removed (a fresh-clone run beside another failed on it): down runs again until it goes
    through; any other failure is raised at once."""
    from workers import compose as compose_module

    monkeypatch.setattr(compose_module, "DOWN_RETRY_DELAY", 0.0)
    project = compose_module.ComposeProject("zklock-unit")
    busy = compose_module.DockerError(
        "error while removing network: network zklock-unit_coordination id 10fb has active "
        "endpoints"
    )
    answers: list[Exception | None] = [busy, busy, None]
    calls: list[tuple[str, ...]] = []

    def compose(*args: str, timeout: float = 0.0) -> str:
        calls.append(args)
        answer = answers.pop(0)
        if answer is not None:
            raise answer
        return ""

    monkeypatch.setattr(project, "compose", compose)
    project.down()
    assert len(calls) == 3 and all(call[0] == "down" for call in calls)

    other = compose_module.DockerError("no such service")
    answers[:] = [other]
    with pytest.raises(compose_module.DockerError, match="no such service"):
        project.down()


def test_the_worker_image_digest_follows_what_goes_into_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # build_images skips the worker image (about 45 s of wheels) when its label holds this
    # digest: it must change with the library, workers/, the Dockerfile and the base image, and
    # not with byte-code caches.
    tree = tmp_path / "tree"
    for name in ("pyproject.toml", "README.md", "compose/worker/Dockerfile"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    for name in ("celery_zklock/lock.py", "workers/tasks.py"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x = 1\n")
    monkeypatch.setattr(compose, "ROOT", tree)
    monkeypatch.setattr(compose, "COMPOSE_DIR", tree / "compose")
    first = compose.worker_inputs_digest("sha256:base")
    assert compose.worker_inputs_digest("sha256:base") == first
    (tree / "workers" / "__pycache__").mkdir()
    (tree / "workers" / "__pycache__" / "tasks.cpython-311.pyc").write_bytes(b"\0")
    assert compose.worker_inputs_digest("sha256:base") == first
    assert compose.worker_inputs_digest("sha256:other") != first
    for name in ("workers/tasks.py", "celery_zklock/lock.py", "compose/worker/Dockerfile"):
        before = (tree / name).read_text()
        (tree / name).write_text(before + "# changed\n")
        assert compose.worker_inputs_digest("sha256:base") != first, name
        (tree / name).write_text(before)
    (tree / "workers" / "new.py").write_text("")
    assert compose.worker_inputs_digest("sha256:base") != first
