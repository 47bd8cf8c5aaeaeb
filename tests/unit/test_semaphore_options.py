"""lock_mode="semaphore" and lock_limit: one validation, at definition and per call."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_zklock import ConfigurationError, ZkLockTask
from celery_zklock.task.options import (
    CALL_OVERRIDES,
    LOCK_MODES,
    TASK_ATTRIBUTES,
    LockOptions,
    options_from_task,
    with_call_overrides,
)

TASK = "proj.tasks.export"


def test_semaphore_with_a_limit() -> None:
    options = options_from_task(TASK, {"lock_mode": "semaphore", "lock_limit": 3})
    assert (options.mode, options.limit) == ("semaphore", 3)
    assert "semaphore" in LOCK_MODES and TASK_ATTRIBUTES["lock_limit"] == "limit"
    assert options_from_task(TASK, {}).limit is None  # the other modes have none


def test_semaphore_without_a_limit_is_refused() -> None:
    for attrs in ({"lock_mode": "semaphore"}, {"lock_mode": "semaphore", "lock_limit": None}):
        with pytest.raises(ConfigurationError) as refused:
            options_from_task(TASK, attrs)
        assert str(refused.value) == (
            f"task {TASK!r}: lock_mode='semaphore' needs lock_limit, the most runs at once per "
            "lock key (a whole number >= 1)"
        )


@pytest.mark.parametrize("mode", [None, "exclusive", "shared"])
def test_a_limit_with_another_mode_is_refused(mode: str | None) -> None:
    attrs: dict[str, object] = {"lock_limit": 2}
    if mode is not None:
        attrs["lock_mode"] = mode
    with pytest.raises(ConfigurationError) as refused:
        options_from_task(TASK, attrs)
    message = str(refused.value)
    assert message.startswith(f"task {TASK!r}: lock_limit=2 is only for lock_mode='semaphore'")
    assert f"lock_mode={mode or 'exclusive'!r}" in message
    assert "set lock_mode='semaphore' for at most 2 at once, or drop lock_limit" in message


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0, "0"), (-1, "-1"), (True, "True"), (2.0, "2.0"), (2.5, "2.5"), ("3", "'3'"), ([], "[]")],
)
def test_bad_limit_values_are_refused(value: object, shown: str) -> None:
    for mode in ("semaphore", "exclusive"):  # the value's own rule comes first
        with pytest.raises(ConfigurationError) as refused:
            options_from_task(TASK, {"lock_mode": mode, "lock_limit": value})
        assert str(refused.value) == (
            f"task {TASK!r}: lock_limit must be a whole number >= 1, got {shown}"
        )


def test_lock_options_name_their_fields_when_built_directly() -> None:
    with pytest.raises(ConfigurationError, match=r"^LockOptions\(name='x'\): mode='semaphore' "):
        LockOptions(name="x", key=None, mode="semaphore")
    with pytest.raises(ConfigurationError, match=r"^LockOptions\(name='x'\): limit=4 is only"):
        LockOptions(name="x", key=None, limit=4)
    assert LockOptions(name="x", key=None, mode="semaphore", limit=1).limit == 1


@pytest.mark.parametrize("key", ["limit", "lock_limit", "mode"])
def test_the_limit_is_not_a_call_override(key: str) -> None:
    base = options_from_task(TASK, {"lock_mode": "semaphore", "lock_limit": 2})
    assert "limit" not in CALL_OVERRIDES
    with pytest.raises(ConfigurationError) as refused:
        with_call_overrides(base, TASK, {key: 5})
    assert "(the lock name, key, mode and limit are fixed by the task, not per call)" in str(
        refused.value
    )


def test_call_overrides_keep_the_limit() -> None:
    base = options_from_task(TASK, {"lock_mode": "semaphore", "lock_limit": 2})
    merged = with_call_overrides(base, TASK, {"on_busy": "skip", "timeout": 1})
    assert (merged.mode, merged.limit, merged.on_busy, merged.timeout) == (
        "semaphore",
        2,
        "skip",
        1,
    )


def test_checked_when_the_task_class_is_defined() -> None:
    app = Celery("definitions", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"\.no_limit'.*needs lock_limit"):

        @app.task(base=ZkLockTask, lock_mode="semaphore", lazy=False, shared=False)
        def no_limit(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"\.limit_alone'.*lock_limit=3 is only for"):

        @app.task(base=ZkLockTask, lock_limit=3, lazy=False, shared=False)
        def limit_alone(x: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"lock_limit must be a whole number >= 1"):

        @app.task(base=ZkLockTask, lock_mode="semaphore", lock_limit=0, lazy=False, shared=False)
        def zero(x: int) -> None: ...

    @app.task(bind=True, base=ZkLockTask, lock_mode="semaphore", lock_limit=2, lazy=False)
    def export(self: Any, x: int) -> None: ...

    spec = type(export)._zklock_compile()
    assert (spec.options.mode, spec.options.limit) == ("semaphore", 2)
