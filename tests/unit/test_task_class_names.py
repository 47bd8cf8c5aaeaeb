"""Class-based locked tasks without a name: ``app.register_task(MyTask())`` names the instance,
and the lock takes that name (not ``None``, which every such task would share); their lock
options are checked when the class is defined, as for every other task."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_zklock import ZkLockTask
from celery_zklock.errors import ConfigurationError


def test_registered_class_tasks_lock_under_their_own_names() -> None:
    app = Celery("proj", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # lock paths are computed here, nothing connects

    class SyncAccount(ZkLockTask):  # type: ignore[misc]
        lock_key = ["account_id"]

        def run(self, account_id: int) -> int:
            return account_id

    class DeleteAccount(ZkLockTask):  # type: ignore[misc]
        lock_key = ["account_id"]

        def run(self, account_id: int) -> int:
            return account_id

    sync = app.register_task(SyncAccount())
    delete = app.register_task(DeleteAccount())
    assert sync.lock_path(42).startswith(f"/zklock/{sync.name}/account_id=42~")
    assert delete.lock_path(42).startswith(f"/zklock/{delete.name}/account_id=42~")
    assert sync.lock_path(42) != delete.lock_path(42)


def test_a_class_task_without_a_name_is_checked_when_defined() -> None:
    with pytest.raises(ConfigurationError, match=r"Misspelt'?: lock_mode='exclusiv'"):

        class Misspelt(ZkLockTask):  # type: ignore[misc]
            lock_mode = "exclusiv"

            def run(self, account_id: Any) -> Any:
                return account_id


def test_a_class_task_used_before_it_has_a_name_says_so() -> None:
    class Unregistered(ZkLockTask):  # type: ignore[misc]
        def run(self, n: int) -> int:
            return n

    with pytest.raises(ConfigurationError, match="Unregistered has no task name"):
        Unregistered().lock_path(1)
