"""``lock_debounce`` / ``lock_debounce_max`` and ``lock_on_busy="replace"``: what they combine
with, refused when the task is defined (or the call made) with a message naming both options;
the window's arithmetic; a preempted run's error in every locked task's ``throws``. The
behaviour on real workers: tests/task/test_debounce.py, tests/task/test_replace.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_zklock import ConfigurationError, LockLost, Preempted, ZkLockTask
from celery_zklock.task.debounce import due_in
from celery_zklock.task.latest import Record
from celery_zklock.task.options import options_from_task, with_call_overrides
from celery_zklock.task.policy import expect_preempted


def options(**attrs: Any) -> Any:
    return options_from_task("proj.refresh", {f"lock_{k}": v for k, v in attrs.items()})


@pytest.mark.parametrize(
    ("attrs", "fragments"),
    [
        ({"debounce": 2.0, "mode": "shared"}, ["lock_debounce=2.0 with lock_mode='shared'",
                                               "use lock_mode='exclusive'"]),
        ({"debounce": 2.0, "mode": "semaphore", "limit": 2}, ["lock_mode='semaphore'"]),
        ({"on_busy": "replace", "mode": "shared"}, ["lock_on_busy='replace' with lock_mode="]),
        ({"on_busy": "replace", "dedupe": "queued"}, ["lock_dedupe='queued'",
                                                      "drop lock_dedupe"]),
        ({"on_busy": "replace", "dedupe": "running"}, ["lock_dedupe='running'"]),
        ({"debounce": 1.0, "dedupe": "queued"}, ["lock_debounce=1.0 with lock_dedupe="]),
        ({"debounce": 1.0, "key": {"k": ["a", "b"]}}, ["with several keys"]),
        ({"on_busy": "replace", "key": {"k": ["a", "b"]}}, ["lock_on_busy='replace'"]),
        ({"on_busy": "replace", "rate": "2/s"}, ["lock_rate='2/s' is not defined"]),
        ({"debounce": 1.0, "on_busy": "skip"}, ["lock_on_busy='skip'", "last call's arguments"]),
        ({"debounce": 1.0, "on_busy": "raise"}, ["lock_on_busy='raise'"]),
        ({"debounce_max": 30.0}, ["lock_debounce_max=30.0 is the cap", "set lock_debounce"]),
        ({"debounce": 5.0, "debounce_max": 2.0}, ["lock_debounce_max=2.0 is shorter than "
                                                  "lock_debounce=5.0"]),
        ({"debounce": 0}, ["lock_debounce must be a number of seconds > 0, got 0"]),
        ({"debounce": "soon"}, ["lock_debounce must be a number of seconds > 0"]),
        ({"debounce": 1.0, "debounce_max": -1}, ["lock_debounce_max must be a number"]),
    ],
)  # fmt: skip
def test_refused_at_definition(attrs: dict[str, Any], fragments: list[str]) -> None:
    attrs.setdefault("key", None)
    with pytest.raises(ConfigurationError) as refused:
        options(**attrs)
    message = str(refused.value)
    assert message.startswith("task 'proj.refresh': "), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "attrs",
    [
        {"debounce": 2.0},
        {"debounce": 2.0, "debounce_max": 30.0, "on_busy": "replace"},
        {"debounce": 2.0, "on_busy": "preempt"},
        {"debounce": 2.0, "on_busy": "retry", "rate": "1/s"},
        {"on_busy": "replace", "timeout": 5, "on_timeout": "skip", "on_lost": "retry"},
    ],
)
def test_defined_combinations(attrs: dict[str, Any]) -> None:
    options(key=None, **attrs)


def test_the_cap_defaults_to_30_s_or_the_quiet_period() -> None:
    assert options(key=None, debounce=2.0).debounce_cap == 30.0
    assert options(key=None, debounce=45.0).debounce_cap == 45.0
    assert options(key=None, debounce=2.0, debounce_max=5.0).debounce_cap == 5.0


def test_a_call_cannot_change_the_window_nor_replace_beside_dedupe() -> None:
    task = options(key=None, dedupe="queued")
    with pytest.raises(ConfigurationError, match=r"zklock\['on_busy'\]='replace' with"):
        with_call_overrides(task, "proj.refresh", {"on_busy": "replace"})
    debounced = options(key=None, debounce=2.0)
    with pytest.raises(ConfigurationError, match="override key 'debounce' is not allowed"):
        with_call_overrides(debounced, "proj.refresh", {"debounce": 0.5})
    with pytest.raises(ConfigurationError, match=r"zklock\['on_busy'\]='skip'"):
        with_call_overrides(debounced, "proj.refresh", {"on_busy": "skip"})
    assert with_call_overrides(debounced, "proj.refresh", {"on_busy": "replace"}).debounce == 2.0


def record(at: int, first: int) -> Record:
    return Record("t", 1, at=at, first=first, mtime=at, version=0)


@pytest.mark.parametrize(
    ("at", "first", "now", "left"),
    [
        (10_000, 10_000, 10_000, 2.0),  # a window begins: the quiet period
        (10_000, 10_000, 11_500, 0.5),
        (10_000, 10_000, 12_000, 0.0),  # quiet for the period: over
        (10_000, 10_000, 13_000, 0.0),
        (38_000, 10_000, 38_000, 2.0),  # the cap (40 s) is further than the quiet period
        (39_000, 10_000, 39_000, 1.0),  # the cap comes first
        (41_000, 10_000, 41_000, 0.0),  # past the cap: over whatever the last call
    ],
)
def test_the_window_ends_at_quiet_or_cap_on_zookeepers_clock(
    at: int, first: int, now: int, left: float
) -> None:
    assert due_in(record(at, first), now, quiet=2.0, cap=30.0) == pytest.approx(left)


def test_every_locked_task_expects_preempted_once() -> None:
    cls: Any = SimpleNamespace(throws=())
    expect_preempted(cls)
    expect_preempted(cls)
    assert cls.throws == (Preempted,)
    mine: Any = SimpleNamespace(throws=(KeyError, LockLost))
    expect_preempted(mine)
    assert mine.throws == (KeyError, LockLost)  # LockLost covers it already

    class Refresh(ZkLockTask):  # type: ignore[misc]
        name = "proj.refresh_expects"
        throws = (KeyError,)

        def run(self, view: str) -> None: ...

    assert Refresh.throws == (KeyError, Preempted)
