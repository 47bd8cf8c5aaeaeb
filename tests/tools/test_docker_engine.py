"""``DockerEngine``: a ``dockerd`` a run starts is shared with a run beside it, and stopped once
neither uses it. Stand-ins for ``docker`` and ``dockerd`` on ``PATH`` (the real engine is
exercised by tests/fleet/test_compose_fleet.py): the daemon marks itself running in a file and
``docker info`` answers while that file exists."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from workers import compose
from workers.compose import DockerEngine

DOCKERD = """#!/bin/bash
trap 'rm -f "$STATE/running"; exit 0' TERM
echo started >> "$STATE/starts"
touch "$STATE/running"
while :; do sleep 0.05; done
"""
DOCKER = """#!/bin/bash
[ "$1" = info ] && [ -e "$STATE/running" ] && { echo 20.10; exit 0; }
echo "Cannot connect to the Docker daemon" >&2
exit 1
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root starts a Docker engine")


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("dockerd", DOCKERD), ("docker", DOCKER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STATE", str(tmp_path))
    monkeypatch.setattr(compose, "ENGINE_START", tmp_path / "start.lock")
    monkeypatch.setattr(compose, "ENGINE_USERS", tmp_path / "users.lock")
    return tmp_path


def test_a_started_engine_is_stopped_at_close(state: Path) -> None:
    engine = DockerEngine.ensure()
    assert engine.started_here and (state / "running").exists()
    engine.close()
    assert not (state / "running").exists()
    assert not DockerEngine.reachable()


def test_an_engine_found_running_is_left_running(state: Path) -> None:
    owner = DockerEngine.ensure()
    user = DockerEngine.ensure()
    assert not user.started_here
    assert (state / "starts").read_text().count("started") == 1  # one daemon, shared
    user.close()
    assert DockerEngine.reachable()
    owner.close()
    assert not DockerEngine.reachable()


def test_the_starter_waits_for_a_run_beside_it_before_stopping(state: Path) -> None:
    owner = DockerEngine.ensure()
    beside = DockerEngine.ensure()  # the second run found the first one's engine
    closing = threading.Thread(target=owner.close)
    closing.start()
    closing.join(0.5)
    # The run beside still uses the engine: the starter's close waits for it.
    assert closing.is_alive() and DockerEngine.reachable()
    beside.close()
    closing.join(10)
    assert not closing.is_alive()
    assert not DockerEngine.reachable()
