"""The stack fixtures (the library's opt-in pytest plugin), and those of the task tests that run
real `celery worker` subprocesses (tests.taskapp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

pytest_plugins = ["celery_zklock.testing.plugin"]

SESSION_TIMEOUT = 4.0
"""The workers' ZooKeeper session timeout (seconds): short, so expiry-based tests are quick."""


@pytest.fixture
def taskenv(
    zk_hosts: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Celery, dict[str, str], Path]]:
    """The task app configured for this test, the workers' environment, and their directory."""
    env = {
        "TASKAPP_BROKER": redis_url,
        "ZKLOCK_HOSTS": zk_hosts,
        "ZKLOCK_SESSION_TIMEOUT": str(SESSION_TIMEOUT),
        "TASKAPP_DIR": str(tmp_path),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from tests import taskapp

    taskapp.app.conf.broker_url = redis_url
    taskapp.app.conf.result_backend = redis_url
    taskapp.DIR = tmp_path
    yield taskapp.app, env, tmp_path
