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


def test_a_bare_string_lock_key_is_one_lock_per_value_of_that_parameter() -> None:
    """``lock_key="account_id"`` used to be a format string without fields: every call of the
    task shared one lock. It is the parameter's name: one lock per account."""
    app = Celery("proj", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # lock paths are computed here, nothing connects

    @app.task(base=ZkLockTask, lock_key="account_id", shared=False, lazy=False)
    def sync(account_id: int, full: bool = False) -> None: ...

    @app.task(
        base=ZkLockTask, lock_key=["account_id"], lock_name=sync.name, shared=False, lazy=False
    )
    def listed(account_id: int, full: bool = False) -> None: ...

    assert sync.lock_path(1) != sync.lock_path(2)
    assert sync.lock_path(1) == sync.lock_path(account_id=1, full=True) == listed.lock_path(1)


@pytest.mark.parametrize("where", ["decorator", "class body"])
def test_a_format_string_lock_key_is_refused_when_the_task_is_made(where: str) -> None:
    app = Celery("proj", set_as_current=False)
    with pytest.raises(ConfigurationError) as caught:
        if where == "decorator":

            @app.task(
                name="proj.sync", base=ZkLockTask, lock_key="{account_id}", shared=False, lazy=False
            )
            def sync(account_id: int) -> None: ...

        else:

            class Sync(ZkLockTask):  # type: ignore[misc]
                name = "proj.sync"
                lock_key = "{account_id}"

                def run(self, account_id: int) -> None: ...

    assert str(caught.value).startswith("task 'proj.sync': lock_key='{account_id}' is a format")
    assert str(caught.value).endswith('lock_key=lambda account_id: f"{account_id}"')


def test_lock_path_takes_just_the_key_arguments_and_names_a_missing_one() -> None:
    """An operator asking who holds account x gives x, not the call's other arguments; a call
    being sent (dedupe) still needs them all."""
    app = Celery("proj", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # lock paths are computed here, nothing connects

    @app.task(base=ZkLockTask, lock_key=["k"], shared=False, lazy=False)
    def hold(k: str, seconds: float) -> None: ...

    @app.task(base=ZkLockTask, lock_key=["k", "region"], shared=False, lazy=False)
    def pair(k: str, seconds: float, region: str = "eu") -> None: ...

    @app.task(base=ZkLockTask, lock_key=["k"], lock_dedupe="queued", shared=False, lazy=False)
    def sent(k: str, seconds: float) -> None: ...

    whole = hold.lock_path("x", 5)
    assert hold.lock_path("x") == hold.lock_path(k="x") == whole
    assert pair.lock_path("x") == pair.lock_path("x", 1, "eu") != pair.lock_path("x", region="us")
    assert pair.lock_path(k="x", region="us") == pair.lock_path("x", 9, "us")
    with pytest.raises(
        TypeError, match=r"hold': missing the lock key's argument 'k' \(lock_key=\['k'\]"
    ):
        hold.lock_path(seconds=5)
    with pytest.raises(TypeError, match="too many positional arguments"):
        hold.lock_path("x", 5, 6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sekonds'"):
        hold.lock_path("x", sekonds=5)
    # A call being sent is the whole call: refused before any marker or message.
    with pytest.raises(TypeError, match="missing a required argument: 'seconds'"):
        sent.apply_async(("x",))
