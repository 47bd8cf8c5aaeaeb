"""The dedupe marker's data across versions: the deadline key (issue 44) is an addition that a
reader of the version before it ignores, and a marker written by that version reads as one with
no deadline, never late."""

from __future__ import annotations

import json
from types import SimpleNamespace

from celery_zklock.task.dedupe import Marker


def _decode_as_before(raw: bytes) -> tuple[str, str, float]:
    """How the version before the deadline read a marker (its Marker.decode)."""
    data = json.loads(raw)
    return str(data["task_id"]), str(data["mode"]), float(data["written"])


def test_a_new_marker_reads_as_before_in_an_older_process() -> None:
    raw = Marker("t-1", "queued", 1000.0, deadline=1003.0).encode()
    assert _decode_as_before(raw) == ("t-1", "queued", 1000.0)


def test_an_older_marker_has_no_deadline_and_is_never_late() -> None:
    raw = json.dumps({"task_id": "t-1", "mode": "running", "written": 1000.0}).encode()
    marker = Marker.decode(raw)
    assert marker == Marker("t-1", "running", 1000.0, None)
    assert not marker.late(SimpleNamespace(mtime=9_999_999_000))  # type: ignore[arg-type]
    late = Marker("t-1", "running", 1000.0, deadline=1003.0)
    assert late.late(SimpleNamespace(mtime=1_004_000))  # type: ignore[arg-type]
