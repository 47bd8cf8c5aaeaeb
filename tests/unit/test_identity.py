"""A contender node's data: what a run stores (the JSON json.dumps gives, built once per part),
how it is parsed back, and break requests merged into it. Pure, no server."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from celery_zklock.locks.identity import (
    Identity,
    break_reason,
    break_request,
    identity,
    parse_identity,
    with_break_request,
)

IDENTITY = {"task_id": "t-1", "task": "app.sync", "retries": 2, "worker": "w1@h", "pid": 4242}


def expected(task: Any, request: Any, pid: int) -> bytes:
    return json.dumps(
        {
            "task_id": request.id,
            "task": task.name,
            "retries": int(request.retries or 0),
            "worker": request.hostname or socket.gethostname(),
            "pid": pid,
        },
        separators=(",", ":"),
    ).encode()


def test_identity_is_the_json_of_its_fields_for_every_task_worker_and_run() -> None:
    tasks = [SimpleNamespace(name=name) for name in ("a.b", 'q"uote\\d', "ünï\u2028", "")]
    for task in tasks:
        for hostname in ("w1@host", "w2@host", 'h"\\é', None):
            for task_id, retries in (("id-1", 0), ("id-2", 3), ("é\n", None), (None, 1)):
                request = SimpleNamespace(id=task_id, hostname=hostname, retries=retries)
                assert identity(task, request) == expected(task, request, os.getpid())


def _identity_in_child(queue: Any) -> None:
    request = SimpleNamespace(id="child", hostname="w@host", retries=0)
    queue.put((identity(SimpleNamespace(name="t"), request), os.getpid()))


def test_a_forked_child_names_its_own_pid() -> None:
    """A prefork child inherits the parent's cached parts: its identity still has its own pid."""
    task = SimpleNamespace(name="t")
    request = SimpleNamespace(id="child", hostname="w@host", retries=0)
    assert identity(task, request) == expected(task, request, os.getpid())  # cached here
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_identity_in_child, args=(queue,))
    child.start()
    data, child_pid = queue.get(timeout=30)
    child.join(30)
    assert child_pid != os.getpid()
    assert data == expected(task, request, child_pid)


# -- identities and break requests ------------------------------------------------------------


def test_identity_of_a_task_run_node() -> None:
    identity = parse_identity(json.dumps(IDENTITY).encode())
    assert (identity.task_id, identity.task, identity.worker, identity.pid) == (
        "t-1", "app.sync", "w1@h", 4242,
    )  # fmt: skip
    assert identity.retries == 2 and identity.ours and identity.broken is None


@pytest.mark.parametrize(
    ("data", "ours"),
    [(b"", True), (b"{}", True), (b"10.0.0.7", False), (b"[1, 2]", False), (b"\xff\xfe", False)],
)
def test_identity_of_nodes_that_are_not_a_run(data: bytes, ours: bool) -> None:
    identity = parse_identity(data)
    assert identity.ours is ours
    assert (identity.task_id, identity.worker, identity.pid) == (None, None, None)


def test_identity_fields_of_the_wrong_type_are_none() -> None:
    identity = parse_identity(json.dumps({"task_id": 7, "pid": "12", "retries": True}).encode())
    assert identity.task_id is None and identity.pid is None and identity.retries == 0


def test_a_break_request_keeps_the_identity_and_names_the_operator() -> None:
    marked = with_break_request(json.dumps(IDENTITY).encode(), "alice@ops", 1.5, "stuck on IO")
    parsed = json.loads(marked)
    assert {k: parsed[k] for k in IDENTITY} == IDENTITY
    assert parsed["broken"] == {"by": "alice@ops", "at": 1.5, "reason": "stuck on IO"}
    assert break_reason(marked) == "broken by operator alice@ops: stuck on IO"
    identity = parse_identity(marked)
    assert identity.task_id == "t-1" and identity.broken is not None
    assert identity.broken["by"] == "alice@ops"


def test_a_break_request_without_reason_and_into_empty_data() -> None:
    marked = with_break_request(b"", "bob@h", 2.0, None)
    assert json.loads(marked) == {"broken": {"by": "bob@h", "at": 2.0}}
    assert break_reason(marked) == "broken by operator bob@h"


@pytest.mark.parametrize(
    "data", [b"", json.dumps(IDENTITY).encode(), b"10.0.0.7", b'{"broken": "yes"}', b"null"]
)
def test_data_without_a_break_request_gives_no_reason(data: bytes) -> None:
    assert break_reason(data) is None and break_request(data) is None


def test_a_curator_node_cannot_take_a_break_request() -> None:
    with pytest.raises(ValueError, match="not a celery-zklock holder"):
        with_break_request(b"10.0.0.7", "alice@ops", 1.0, None)


# -- built and parsed by the one module ---------------------------------------------------------


def test_what_a_run_writes_parses_back_to_its_fields() -> None:
    task = SimpleNamespace(name="app.sync")
    for retries in (None, 0, 5):
        request = SimpleNamespace(id="t-9", hostname="w1@h", retries=retries)
        assert parse_identity(identity(task, request)) == Identity(
            task_id="t-9", task="app.sync", worker="w1@h", pid=os.getpid(), retries=retries or 0
        )


def test_the_bytes_a_run_writes_are_fixed() -> None:
    """Workers of several versions share a lock during a rolling deploy: the layout stays."""
    request = SimpleNamespace(id="t-1", hostname="w1@h", retries=2)
    assert identity(SimpleNamespace(name="app.sync"), request) == (
        b'{"task_id":"t-1","task":"app.sync","retries":2,"worker":"w1@h","pid":%d}' % os.getpid()
    )


def test_a_break_request_into_a_run_node_keeps_its_identity() -> None:
    request = SimpleNamespace(id="t-2", hostname="w2@h", retries=1)
    written = identity(SimpleNamespace(name="app.x"), request)
    marked = parse_identity(with_break_request(written, "ops@h", 3.0, "stuck"))
    assert marked == Identity(
        task_id="t-2",
        task="app.x",
        worker="w2@h",
        pid=os.getpid(),
        retries=1,
        broken={"by": "ops@h", "at": 3.0, "reason": "stuck"},
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b'{"broken": {}}', "broken by operator unknown"),
        (b'{"broken": {"by": "", "reason": ""}}', "broken by operator unknown"),
        (b'{"broken": {"by": "a@h", "reason": "why"}}', "broken by operator a@h: why"),
        (b'{"broken": ["a@h"]}', None),
        (b'{"broken": null}', None),
    ],
)
def test_the_reason_of_a_break_request(data: bytes, reason: str | None) -> None:
    assert break_reason(data) == reason
    assert (break_request(data) is None) is (reason is None)


# -- the call's generation (celery_zklock.task.generation) ----------------------------------------


def test_a_run_with_a_generation_writes_it_after_its_retries() -> None:
    request = SimpleNamespace(id="t-1", hostname="w1@h", retries=2)
    written = identity(SimpleNamespace(name="app.sync"), request, 1_700_000_000_123_456_789)
    assert written == (
        b'{"task_id":"t-1","task":"app.sync","retries":2,"generation":1700000000123456789,'
        b'"worker":"w1@h","pid":%d}' % os.getpid()
    )
    assert json.loads(written) == {
        **json.loads(identity(SimpleNamespace(name="app.sync"), request)),
        "generation": 1_700_000_000_123_456_789,
    }
    parsed = parse_identity(written)
    assert parsed.generation == 1_700_000_000_123_456_789 and parsed.retries == 2


def test_the_node_of_an_older_version_has_no_generation() -> None:
    """A holder of a version that wrote no generation (mixed fleet during a deploy), or that
    wrote something else there: None, which counts as older than any call."""
    assert parse_identity(json.dumps(IDENTITY).encode()).generation is None
    for odd in ("12", True, 1.5, None):
        data = json.dumps({**IDENTITY, "generation": odd}).encode()
        assert parse_identity(data).generation is None
    assert parse_identity(b"10.0.0.7").generation is None


def test_a_break_request_keeps_the_generation() -> None:
    request = SimpleNamespace(id="t-3", hostname="w@h", retries=0)
    written = identity(SimpleNamespace(name="app.x"), request, 42)
    assert parse_identity(with_break_request(written, "task x[t-4]", 1.0, "newer")).generation == 42
