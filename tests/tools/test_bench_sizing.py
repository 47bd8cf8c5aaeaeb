"""Benchmark section 9 (sizing): the pure helpers behind its figures, and its Markdown table,
without a server."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from kazoo.protocol.serialization import Create, Delete, Sync

from benchmarks.__main__ import SECTIONS, parse_args
from benchmarks.common import spread
from benchmarks.report import render_markdown
from benchmarks.sizing import (
    RequestTally,
    cpu_ms_per_session_second,
    packets_delta,
    per_unit,
    published_cycles_per_s,
    share_of_core,
)


class FakeClient:
    """Only what RequestTally wraps: ``_call`` on the class, recording what it was given."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def _call(self, request: Any, async_object: Any) -> bool:
        self.sent.append((request, async_object))
        return True


def test_tally_counts_by_request_type_and_passes_every_call_through() -> None:
    client = FakeClient()
    tally = RequestTally()
    tally.install(client)
    create = Create("/a", b"", [], 0)
    assert client._call(create, "result") is True
    client._call(Delete("/a", -1), None)
    client._call(Delete("/b", -1), None)
    assert tally.snapshot() == Counter({"Create": 1, "Delete": 2})
    assert client.sent[0] == (create, "result")
    tally.remove()
    client._call(Sync("/"), None)  # the class's method again: no longer counted
    assert tally.snapshot() == Counter({"Create": 1, "Delete": 2})
    assert "_call" not in vars(client) and len(client.sent) == 4


def test_per_unit_gives_the_moved_types_and_their_total() -> None:
    before = Counter({"Create": 10, "Delete": 10, "Sync": 4})
    after = Counter({"Create": 30, "Delete": 30, "Sync": 4, "GetChildren": 10})
    assert per_unit(before, after, 20) == {
        "Create": 1.0,
        "Delete": 1.0,
        "GetChildren": 0.5,
        "total": 2.5,
    }
    assert per_unit(before, before, 5) == {"total": 0}
    with pytest.raises(ValueError):
        per_unit(before, after, 0)


def test_packets_delta_takes_off_the_second_rounds_probes() -> None:
    # three members; each mntr probe of the second round is one packet on its member
    assert packets_delta([100, 50, 7], [121, 51, 8]) == 20
    assert packets_delta([100, 50, 7], [101, 51, 8]) == 0
    with pytest.raises(ValueError):
        packets_delta([1, 2], [1, 2, 3])


def test_cpu_per_session_and_its_share_of_a_core() -> None:
    # 300 sessions, 20 s window: 1.2 CPU s with them, 0.6 s without -> 0.1 ms per session-s
    per_session = cpu_ms_per_session_second(1.2, 0.6, 300, 20.0)
    assert per_session == pytest.approx(0.1)
    assert share_of_core(per_session) == pytest.approx(0.1)  # 1,000 sessions: a tenth of a core
    assert share_of_core(per_session, 10_000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        cpu_ms_per_session_second(1.0, 0.0, 0, 20.0)


def test_published_ceiling_is_half_the_writes() -> None:
    assert published_cycles_per_s() == 10_500
    assert published_cycles_per_s(18_000) == 9_000


def test_sizing_is_a_section_of_its_own() -> None:
    assert "sizing" in SECTIONS
    assert parse_args(["--sections", "sizing"]).sections == ["sizing"]


def _sizing_section() -> dict[str, Any]:
    one = spread([1.0] * 5)
    two = spread([2.0] * 5)
    return {
        "config": {
            "repeats": 5,
            "loadavg_at_start": [1.0, 2.0, 3.0],
            "loadavg_at_end": [1.5, 2.0, 3.0],
            "published_cycles_per_s": 10_500,
        },
        "requests_per_task": {
            "calls": 200,
            "how": "counted",
            "results": {
                "exclusive": {
                    "client": {"CreateWithParent": one, "Delete": one, "total": two},
                    "server_packets": two,
                },
                "exclusive+gate": {
                    "client": {"GetChildren": one, "total": spread([3.0] * 5)},
                    "server_packets": spread([3.0] * 5),
                    "gate": {"GetChildren": one, "total": one},
                },
            },
        },
        "lease_clock": {
            "session_timeout_s": 10.0,
            "renew_interval_s": 1.25,
            "window_s": 10.0,
            "results": {
                "0": {"client": {"total": spread([0.0] * 5)}, "server_packets_per_s": one},
                "1": {"client": {"Sync": one, "total": one}, "server_packets_per_s": one},
            },
        },
        "lock_cycles": {
            "how": "back to back",
            "duration_s": 5.0,
            "results": {
                "8": {
                    "cycles_per_s": {"mutex": spread([500.0] * 5), "floor": spread([800.0] * 5)},
                    "mutex_vs_floor": spread([0.625] * 5),
                }
            },
        },
        "session_cpu": {
            "sessions": 300,
            "processes": 4,
            "window_s": 20.0,
            "results": {
                "no_sessions_zk_ms_per_s": spread([20.0] * 5),
                **{
                    state: {
                        "zk_cpu_ms_per_session_s": one,
                        "zk_core_share_per_1000": one,
                        "client_cpu_ms_per_session_s": one,
                        "packets_per_session_s": one,
                    }
                    for state in ("idle", "holding")
                },
            },
        },
    }


def test_the_report_renders_the_sizing_tables() -> None:
    report = {
        "command": "python -m benchmarks --sections sizing",
        "mode": "full",
        "started_at": "2026-11-27 01:47 UTC",
        "wall_s": 600.0,
        "machine": {
            "nproc": 2,
            "cpu_model": "test CPU",
            "ram_gib": 8,
            "loadavg_at_start": [1.0, 2.0, 3.0],
            "python": "3.11",
            "zookeeper": "3.8.0",
            "redis_server": "7.0",
            "kazoo_version": "2.11.0",
            "celery_version": "5.7.0",
            "redis_version": "8.1.0",
        },
        "targets": [],
        "sections": {"sizing": _sizing_section()},
    }
    text = render_markdown(report)
    assert "## 9. Sizing" in text
    assert "| exclusive+gate | 3.00 [3.00 .. 3.00; IQR 3.00 .. 3.00]" in text
    row = "| 8 | 500 [500 .. 500; IQR 500 .. 500] | 800 [800 .. 800; IQR 800 .. 800] | 0.62"
    assert row in text
    assert "published ceiling 10,500/s" in text
    failed = {**report, "sections": {"sizing": {"error": "Traceback\nRuntimeError: boom\n"}}}
    assert "Failed: `RuntimeError: boom`" in render_markdown(failed)
