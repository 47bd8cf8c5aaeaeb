"""A user's locked task tested with pytest-celery's in-process worker and our stack fixtures.

This is the example of docs/testing.md, run in our own suite: Celery's in-process fixtures
(``celery_app``, ``celery_worker`` from ``celery.contrib.pytest``, loaded by pytest-celery's
plugin; no Docker) compose with the opt-in plugin's ``zk_hosts``, ``redis_url`` and
``lock_root`` (tests/conftest.py loads ``celery_zklock.testing.plugin``).

pytest-celery 1.x's plugin imports ``celery.contrib.pytest``'s fixtures and then its own, so its
Docker-based ``celery_worker`` shadows Celery's in-process one of the same name. Naming
Celery's in the test module (below) makes it the one this module's tests get;
``celery_session_worker`` has no such twin and is always the in-process one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import celery.contrib.pytest
import pytest
from celery.worker import WorkController

from celery_zklock import ZkLockTask, is_skipped

# Celery's in-process worker, not pytest-celery's Docker one of the same name.
celery_worker = celery.contrib.pytest.celery_worker


@pytest.fixture
def celery_config(zk_hosts: str, redis_url: str, lock_root: str) -> Mapping[str, Any]:
    """The app of ``celery_app``: Redis as broker and backend, the test's ZooKeeper and root."""
    return {
        "broker_url": redis_url,
        "result_backend": redis_url,
        "zklock_hosts": zk_hosts,
        "zklock_root": lock_root,
    }


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    """Two runs at once in the in-process worker (Celery's default there is ``solo``)."""
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> Mapping[str, Any]:
    return {"concurrency": 2, "perform_ping_check": False}


def test_a_second_call_is_skipped_while_the_first_holds_the_lock(
    celery_app: Any, celery_worker: WorkController
) -> None:
    assert isinstance(celery_worker, WorkController)  # Celery's in-process worker, no Docker
    inside, leave = threading.Event(), threading.Event()

    @celery_app.task(bind=True, base=ZkLockTask, lock_key=["account_id"], lock_on_busy="skip")
    def sync_account(self: ZkLockTask, account_id: int) -> int:
        inside.set()
        leave.wait(timeout=30)
        return int(self.lock.token)

    celery_worker.reload()  # the worker learns the task defined after it started

    first = sync_account.delay(42)
    assert inside.wait(timeout=30), "the first run never started"
    second = sync_account.delay(42)  # same account while the first holds its lock
    assert is_skipped(second.get(timeout=30))

    other = sync_account.delay(7)  # another account has its own lock
    leave.set()
    token = first.get(timeout=30)
    assert token > 0 and not is_skipped(token)
    assert not is_skipped(other.get(timeout=30))
