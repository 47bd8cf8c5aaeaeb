"""``write_reports``: report.json, summary.txt and a self-contained report.html; and the pure
parts of the page: log-spaced bins, quantiles, the timeline's sections, rows and keys."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from workers.checker import RunReport, TaskOutcome, check_run
from workers.record import FaultRecord, SectionEvent
from workers.report import (
    format_seconds,
    histogram_svg,
    log_bins,
    quantile,
    series_svg,
    write_reports,
)
from workers.timeline import (
    PALETTE,
    assign_rows,
    build_timeline,
    natural_key,
    nice_step,
    select_keys,
    stack_labels,
    timeline_svg,
    worker_colours,
)

# A run of 30 exclusive sections over three keys, and a violation with a `<` to escape.


def _events() -> list[SectionEvent]:
    events: list[SectionEvent] = []
    for i in range(30):
        at = 100.0 + i * 0.25
        common = {"task_id": f"t{i}", "key": f"k{i % 3}", "mode": "exclusive", "token": i + 1,
                  "hostname": f"w{i % 2}@h", "pid": 10 + i % 2}  # fmt: skip
        events += [
            SectionEvent(kind="enter", time=at, **common),  # type: ignore[arg-type]
            SectionEvent(kind="write", time=at + 0.05, accepted=True, **common),  # type: ignore[arg-type]
            SectionEvent(kind="exit", time=at + 0.1 + i * 0.01, outcome="ok", **common),  # type: ignore[arg-type]
        ]
    events.append(SectionEvent("enter", "x<y>", "k0", "exclusive", 99, time=110.0))
    events.append(SectionEvent("enter", "z", "k0", "exclusive", 100, time=110.1))
    return events


FAULTS = [FaultRecord("pause", 104.0, "w1 pid 11 holding k1 (exclusive)", True, "SIGSTOP")]


def _report(events: list[SectionEvent] | None = None) -> RunReport:
    outcomes = {f"t{i}": TaskOutcome(f"t{i}", "SUCCESS") for i in range(30)}
    outcomes["x<y>"] = TaskOutcome("x<y>", "FAILURE", reason="ValueError: a < b")
    return check_run(
        submitted={task: 99.0 for task in [*outcomes, "z"]},
        outcomes=outcomes,
        events=_events() if events is None else events,
        faults=FAULTS,
        leftover_nodes=0,
    )


# ------------------------------------------------------------------------------------- files


def test_the_three_files_are_written(tmp_path: Path) -> None:
    report = _report()
    paths = write_reports(report, tmp_path / "out")
    assert set(paths) == {"json", "summary", "html"}
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "report.json",
        "summary.txt",
        "report.html",
    }
    summary = paths["summary"].read_text().splitlines()
    assert summary == report.summary_lines()
    assert summary[-1] == report.report_line()
    assert "violations=1" in summary[-1]


def test_the_json_report_round_trips(tmp_path: Path) -> None:
    report = _report()
    data = json.loads(write_reports(report, tmp_path, events=_events())["json"].read_text())
    assert data == report.to_json()
    assert (data["tasks"], data["violations"], data["ok"]) == (32, 1, False)
    assert data["hold_seconds"] == list(report.hold_seconds)


def test_the_html_page_is_self_contained(tmp_path: Path) -> None:
    report = _report()
    html = write_reports(report, tmp_path, events=_events(), start=99.0)["html"].read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg ") - html.count('aria-hidden="true"') == 4  # timeline + 3 charts
    for title in ("Wait (submit to enter)", "Hold (enter to exit)", "Section exits per second"):
        assert title in html
    heights = re.findall(r'<rect class="bar"[^>]*height="([\d.]+)"', html)
    assert len(heights) > 10 and all(float(h) > 0 for h in heights)
    for reference in ("<script", "<link", "<img", "src=", "href=", "url(", "@import", "//"):
        assert reference not in html, reference
    assert "x&lt;y&gt;" in html and "x<y>" not in html  # task ids are escaped
    assert 'class="verdict bad"' in html
    assert report.report_line() in html
    # the timeline: one bar per section, coloured per worker, the violation marked, the fault
    assert len(re.findall(r'<rect class="s w\d', html)) == 32
    assert {"w0", "w1"} <= set(re.findall(r'<rect class="s (w\d)', html))
    assert 'class="violation"' in html and "inviolation" in html
    assert re.search(r'<g class="fault"><title>pause at 5\.000 s on w1 pid 11', html)
    # the summary wraps: a list, not a preformatted block
    assert "<pre" not in html and 'class="summary"' in html


def test_without_events_the_page_says_it_has_no_timeline(tmp_path: Path) -> None:
    html = write_reports(_report(), tmp_path)["html"].read_text()
    assert "no timeline" in html and 'class="timeline"' not in html
    assert "pause" in html  # the fault table still lists report.fault_impacts' faults


def test_many_keys_show_the_busiest_and_say_how_many_are_left_out(tmp_path: Path) -> None:
    events = []
    for k in range(20):
        for n in range(k + 1):  # key-k has k + 1 sections
            common = {"task_id": f"t{k}-{n}", "key": f"key-{k}", "mode": "exclusive",
                      "token": 1000 * k + n, "hostname": "w@h", "pid": 1}  # fmt: skip
            at = 10.0 + n
            events += [
                SectionEvent(kind="enter", time=at, **common),  # type: ignore[arg-type]
                SectionEvent(kind="exit", time=at + 0.5, outcome="ok", **common),  # type: ignore[arg-type]
            ]
    # inside key-0's only section (list order decides): a violation on the least busy key
    events.insert(1, SectionEvent("enter", "v", "key-0", "exclusive", 5, hostname="w@h", time=10.2))
    report = check_run(submitted={}, outcomes={}, events=events, faults=[], leftover_nodes=0)
    assert report.violations == 1
    html = write_reports(report, tmp_path, events=events, key_limit=5)["html"].read_text()
    labels = re.findall(r'<text class="key"[^>]*><title>([^:]+):', html)
    assert labels == ["key-0", "key-16", "key-17", "key-18", "key-19"]  # violation + busiest
    assert "Showing 5 of 20 keys" in html and "15 left out" in html


# ---------------------------------------------------------------------------------- numbers


def test_quantile_is_nearest_rank_like_the_summary() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert [quantile(values, q) for q in (0.5, 0.95, 0.99, 1.0)] == [50.0, 95.0, 99.0, 100.0]
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
    report = _report()
    p50 = quantile(report.hold_seconds, 0.5)
    assert any(line.startswith(f"hold time: p50 {p50:.3f} s") for line in report.summary_lines())


def test_log_bins_are_log_spaced_and_count_every_value_once() -> None:
    values = [0.002, 0.003, 0.01, 0.05, 0.2, 0.2, 1.0, 4.0]
    bins = log_bins(values, per_decade=5)
    assert len(bins.edges) == len(bins.counts) + 1
    ratios = {round(b / a, 9) for a, b in zip(bins.edges, bins.edges[1:], strict=False)}
    assert ratios == {round(10**0.2, 9)}  # equal width on a log axis
    assert sum(bins.counts) == len(values) and bins.clipped == 0
    assert bins.edges[0] <= min(values) and max(values) < bins.edges[-1]
    # each value in the bin whose edges bracket it; one on an edge in the bin it opens
    last = len(bins.counts) - 1
    where = [next(i for i in range(last + 1) if v < bins.edges[i + 1] * (1 - 1e-9)) for v in values]
    assert bins.counts == tuple(where.count(i) for i in range(last + 1))
    assert math.isclose(bins.edges[where[2]], 0.01) and math.isclose(bins.edges[where[6]], 1.0)


def test_log_bins_edges_values_zero_and_one_value() -> None:
    on_edges = log_bins([0.01, 0.1, 1.0], per_decade=1)
    assert on_edges.edges == pytest.approx((0.01, 0.1, 1.0, 10.0))
    assert on_edges.counts == (1, 1, 1)
    clipped = log_bins([0.0, 1e-5, 0.02, 0.5], per_decade=2, floor=1e-3)
    assert clipped.clipped == 2 and clipped.counts[0] == 3 and sum(clipped.counts) == 4
    assert clipped.edges[0] == pytest.approx(10**-2)  # from the smallest value over the floor
    only_zeros = log_bins([0.0, 0.0], floor=1e-3)
    assert only_zeros.counts == (2,) and only_zeros.edges[0] == pytest.approx(1e-3)
    single = log_bins([0.25] * 4)
    assert single.counts == (4,) and single.edges[0] <= 0.25 < single.edges[1]
    assert single.per_decade == 20  # no spread: the finest bins
    wide = log_bins([1e-4, 100.0])
    assert wide.per_decade == 4 and len(wide.counts) in range(20, 26)
    with pytest.raises(ValueError):
        log_bins([])
    with pytest.raises(ValueError):
        log_bins([1.0], per_decade=0)


def test_format_seconds_and_nice_steps() -> None:
    assert [format_seconds(v) for v in (0.0, 5e-5, 0.0125, 0.5, 1.25, 59.0, 125.0, 120.0)] == [
        "0 s", "50 µs", "12.5 ms", "500 ms", "1.25 s", "59 s", "2 min 5 s", "2 min",
    ]  # fmt: skip
    assert [nice_step(span) for span in (20.0, 60.0, 95.0, 1.0, 600.0)] == [
        2.0, 10.0, 10.0, 0.1, 100.0,
    ]  # fmt: skip


def test_histograms_count_every_value_and_draw_empty_data() -> None:
    svg = histogram_svg([0.01, 0.01, 0.1, 1.0, 0.0], "h")
    counts = [int(c) for c in re.findall(r"<title>(\d+) in ", svg)]
    assert sum(counts) == 5 and max(counts) == 3  # 0 is clipped into the first bar with 0.01
    assert "(n=5)" in svg and "log scale; 1 under 100 µs counted" in svg
    for name in ("p50", "p95", "p99"):
        assert f'class="pct {name}"' in svg
    assert "p50 10 ms" in svg and "p99 1 s" in svg
    bars = series_svg([3, 0, 1], "s", "seconds")
    assert re.findall(r"<title>(\d+)</title>", bars) == ["3", "1"]  # no bar for an empty second
    assert "no data" in histogram_svg([], "empty") and "no data" in series_svg([], "e", "s")


# --------------------------------------------------------------------------------- timeline


def test_rows_stack_only_what_overlaps() -> None:
    # in a row, one after another (touching counts as after); overlaps take the next row
    assert assign_rows([(0, 1), (1, 2), (2.5, 3)]) == [0, 0, 0]
    assert assign_rows([(0, 2), (1, 3), (1.5, 4), (2, 5)]) == [0, 1, 2, 0]
    assert assign_rows([(5, 6), (0, 10), (1, 2)]) == [1, 0, 1]  # by start, answered in input order
    assert assign_rows([(0, None), (1, 2), (3, 4)]) == [0, 1, 1]  # never ends: its row stays busy
    # past max_rows, onto the row that frees first
    assert assign_rows([(0, 10), (0, 5), (0, 7), (1, 2)], max_rows=3) == [0, 1, 2, 1]
    assert assign_rows([]) == []
    with pytest.raises(ValueError):
        assign_rows([(0, 1)], max_rows=0)


def test_labels_stack_when_they_would_collide() -> None:
    assert stack_labels([(0, 50), (60, 100), (70, 120), (90, 130), (125, 160)]) == [0, 0, 1, 2, 0]
    assert stack_labels([(100, 150), (40, 98)]) == [0, 1]  # 4 px of gap needed
    assert stack_labels([]) == []


def test_keys_sort_naturally_and_the_selection_keeps_what_matters() -> None:
    assert sorted(["key-10", "key-2", "key-1", "a"], key=natural_key) == [
        "a", "key-1", "key-2", "key-10",
    ]  # fmt: skip
    counts = {f"key-{i}": i for i in range(10)}
    shown, left_out = select_keys(counts, must={"key-0"}, notable={"key-1"}, limit=4)
    assert shown == ["key-0", "key-1", "key-8", "key-9"]
    assert left_out == [f"key-{i}" for i in range(2, 8)]
    shown, left_out = select_keys(counts, must={"key-0", "key-1", "key-2", "nope"}, limit=2)
    assert shown == ["key-0", "key-1", "key-2"] and len(left_out) == 7  # must beats the limit
    assert select_keys(counts, limit=20) == (sorted(counts, key=natural_key), [])


def test_worker_colours_are_stable_and_distinct() -> None:
    one = worker_colours(["w10@h", "w2@h", "w1@h"])
    assert one == worker_colours(["w1@h", "w10@h", "w2@h", "w2@h"])
    assert list(one) == ["w1@h", "w2@h", "w10@h"] and len(set(one.values())) == 3
    many = worker_colours(f"w{i}" for i in range(12))
    assert set(many.values()) == set(PALETTE)  # past ten, the palette repeats


def test_the_timeline_replays_sections_faults_and_the_checkers_marks() -> None:
    e = SectionEvent
    events = [
        e("enter", "a", "k1", "exclusive", 1, hostname="w1", pid=1, time=100.0),
        e("paused", "", "", "exclusive", 0, hostname="w1", pid=1, time=101.0,
          session_timeout=1.5),
        e("enter", "b", "k1", "exclusive", 2, hostname="w2", pid=2, time=102.0),
        e("write", "b", "k1", "exclusive", 2, hostname="w2", pid=2, time=102.4, accepted=True),
        e("exit", "b", "k1", "exclusive", 2, hostname="w2", pid=2, time=102.5, outcome="ok"),
        e("write", "a", "k1", "exclusive", 1, hostname="w1", pid=1, time=103.0, accepted=False,
          previous_token=2),
        e("exit", "a", "k1", "exclusive", 1, hostname="w1", pid=1, time=103.25, outcome="lost"),
        e("enter", "c", "k2", "shared", 3, hostname="w2", pid=3, time=104.0),
        e("killed", "", "", "exclusive", 0, hostname="w2", pid=3, time=105.0),
        e("exit", "zz", "k2", "shared", 9, hostname="w2", pid=3, time=105.5),  # malformed
        e("enter", "d", "k3", "exclusive", 4, hostname="", pid=4, time=106.0),
    ]  # fmt: skip
    faults = [
        FaultRecord("pause", 101.0, "w1 pid 1 holding k1 (exclusive, token 1)", True, "SIGSTOP"),
        FaultRecord("partition", 105.8, "w9 pid 9 holding k9 (exclusive)", True, "cut"),
        FaultRecord("blackhole", 99.0, "", False, "no iptables"),
    ]
    outcomes = {t: TaskOutcome(t, "SUCCESS") for t in "bcd"}
    report = check_run(
        submitted={}, outcomes=outcomes, events=events, faults=faults, leftover_nodes=0
    )
    assert (report.revoked_overlaps, report.violations) == (1, 0)
    timeline = build_timeline(events, faults, report.overlaps, report.stale_writes)
    # times are binary fractions here: exact after subtracting the start
    assert (timeline.start, timeline.end) == (99.0, 7.0)  # the first and the last record
    by = {s.holder: s for s in timeline.sections}
    assert set(by) == {"a#1", "b#2", "c#3", "d#4"}
    a, b, c, d = by["a#1"], by["b#2"], by["c#3"], by["d#4"]
    assert (a.enter, a.end, a.ending) == (1.0, 4.25, "lost")
    assert a.refused == (4.0,) and a.hits == (("paused", 2.0),)
    assert a.overlap == b.overlap == "revoked" and c.overlap is None
    assert (c.ending, c.end, c.mode) == ("killed", 6.0, "shared")
    assert (d.ending, d.end, d.worker) == ("open", None, "?")
    assert b.refused == () and b.ending == "ok"
    [span] = timeline.overlaps
    assert (span.key, span.start, span.end, span.violation) == ("k1", 3.0, 3.5, False)
    assert timeline.fault_keys == {"k1", "k2", "k9"}  # hit by events, or named by a target
    assert timeline.must_show() == {"k1", "k2", "k9"} and timeline.notable() == {"k1", "k2"}
    assert [f.kind for f in timeline.faults] == ["blackhole", "pause", "partition"]

    svg = timeline_svg(timeline, ["k1", "k2", "k3"])
    assert len(re.findall(r'<rect class="s ', svg)) == 4
    assert svg.count('class="cap-lost"') == 1 and svg.count('class="cap-killed"') == 1
    assert svg.count('class="refused"') == 1 and svg.count('class="hit"') == 1
    assert svg.count('class="revoked"') == 1 and 'class="violation"' not in svg
    assert svg.count('<g class="fault">') == 2 and svg.count('<g class="fault notrun">') == 1
    assert "NOT RUN: no iptables" in svg and "open" in svg
    shown_only = timeline_svg(timeline, ["k2"])
    assert len(re.findall(r'<rect class="s ', shown_only)) == 1


def test_a_given_start_moves_time_zero() -> None:
    events = [
        SectionEvent("enter", "a", "k", "exclusive", 1, time=50.0),
        SectionEvent("exit", "a", "k", "exclusive", 1, time=51.0, outcome="ok"),
    ]
    timeline = build_timeline(events, start=40.0)
    [section] = timeline.sections
    assert (timeline.start, section.enter, section.end, timeline.end) == (40.0, 10.0, 11.0, 11.0)
