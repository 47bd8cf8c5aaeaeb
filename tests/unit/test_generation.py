"""A call's generation (celery_zklock.task.generation): stamped when a call is first sent, kept by
its retries and re-sends, taken at the first run of a call sent without one, and compared. Pure,
with Celery's in-memory broker: the headers are those Celery publishes."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task
from celery.signals import before_task_publish

from celery_zklock import ZkLockTask
from celery_zklock.task import generation
from celery_zklock.task.generation import (
    GENERATION_HEADER,
    is_newer,
    next_generation,
    of_request,
)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("gen", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"  # nothing connects: only messages are sent
    yield app


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every message published while the test runs."""
    seen: list[dict[str, Any]] = []

    def on_publish(headers: Any = None, **_: Any) -> None:
        seen.append(dict(headers))

    before_task_publish.connect(on_publish, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(on_publish)


def test_generations_of_one_process_increase_also_when_its_clock_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([5_000, 5_000, 4_000, 9_000])
    monkeypatch.setattr(generation, "_last", 0)
    monkeypatch.setattr(generation.time, "time_ns", lambda: next(clock))
    assert [next_generation() for _ in range(4)] == [5_000, 5_001, 5_002, 9_000]


@pytest.mark.parametrize(
    ("mine", "theirs", "newer"),
    [(2, 1, True), (1, 2, False), (1, 1, False), (1, None, True), (None, 1, False),
     (None, None, False)],
)  # fmt: skip
def test_is_newer_is_strict_and_no_generation_is_older_than_any(
    mine: int | None, theirs: int | None, newer: bool
) -> None:
    assert is_newer(mine, theirs) is newer


def test_a_call_is_stamped_when_sent_and_a_later_call_is_newer(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @app.task(base=ZkLockTask, lock_key=["doc"], shared=False, lazy=False)
    def reindex(doc: int) -> None: ...

    reindex.delay(1)
    reindex.apply_async((1,), zklock={"on_busy": "preempt"})
    reindex.apply_async((1,), headers={GENERATION_HEADER: 7})  # the caller's own is kept
    first, second, own = (h.get(GENERATION_HEADER) for h in published)
    assert isinstance(first, int) and isinstance(second, int) and is_newer(second, first)
    assert published[1]["zklock"] == {"on_busy": "preempt"}
    assert own == 7


def retry_headers(
    task: Task, published: list[dict[str, Any]], at_run: bool = False, **request: Any
) -> tuple[dict[str, Any], int | None]:
    """The headers of the message ``task.retry()`` publishes from a worker's request (made
    as the worker makes it, from the message's headers); ``at_run``: the run took its
    generation first, as a first attempt sent without one does (returned with the headers)."""
    task.push_request(**{"id": "t-1", "retries": 0, "called_directly": False,
                         "delivery_info": {}, **request})  # fmt: skip
    try:
        taken = of_request(task.request, run=True) if at_run else None
        task.retry(countdown=0, throw=False)
    finally:
        task.pop_request()
    return published[-1], taken


def test_a_retry_keeps_the_generation_unchanged(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @app.task(base=ZkLockTask, lock_key=["doc"], shared=False, lazy=False)
    def reindex(doc: int) -> None: ...

    request = {GENERATION_HEADER: 123, "zklock": {"on_busy": "preempt"}, "args": (1,)}
    kept, _ = retry_headers(reindex, published, **request)
    assert (kept[GENERATION_HEADER], kept["zklock"], kept["retries"]) == (123, request["zklock"], 1)


def test_a_generation_taken_at_the_first_run_is_kept_by_its_retries(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """Celery 5.7 keeps the custom headers a message arrived with (``Context.headers``), not
    a field the run set afterwards: ZkLockTask keeps that one too."""

    @app.task(base=ZkLockTask, lock_key=["doc"], shared=False, lazy=False)
    def reindex(doc: int) -> None: ...

    @app.task(shared=False, lazy=False)
    def plain(doc: int) -> None: ...

    headers, taken = retry_headers(plain, published, at_run=True, args=(1,))
    assert taken is not None and GENERATION_HEADER not in headers
    headers, taken = retry_headers(reindex, published, at_run=True, args=(1,))
    assert taken is not None and headers[GENERATION_HEADER] == taken


def test_a_retry_of_a_message_without_one_gets_none(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """An older version's retry carries none; re-sent again it still has none (never a new,
    newer one)."""

    @app.task(base=ZkLockTask, lock_key=["doc"], shared=False, lazy=False)
    def reindex(doc: int) -> None: ...

    headers, _ = retry_headers(reindex, published, args=(1,), retries=1)
    assert GENERATION_HEADER not in headers and headers["retries"] == 2


def test_a_first_run_sent_without_one_takes_one_that_its_retries_keep() -> None:
    first = SimpleNamespace(retries=0, headers=None)
    taken = of_request(first, run=True)
    assert isinstance(taken, int) and of_request(first) == taken == of_request(first, run=True)
    assert of_request(SimpleNamespace(retries=2, headers=None), run=True) is None
    again = SimpleNamespace(retries=0, headers=None, delivery_info={"redelivered": True})
    assert of_request(again, run=True) is None  # handed out again: its first run's is gone
    assert of_request(SimpleNamespace(retries=2, headers={GENERATION_HEADER: 5}), run=True) == 5
    assert of_request(SimpleNamespace(retries=0, headers=None)) is None  # without run: none
    assert of_request(SimpleNamespace(**{GENERATION_HEADER: True})) is None  # not a number
