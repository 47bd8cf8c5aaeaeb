"""``write_reports``: report.json, summary.txt and a self-contained report.html."""

from __future__ import annotations

import json
import re
from pathlib import Path

from workers.checker import RunReport, TaskOutcome, check_run
from workers.record import FaultRecord, SectionEvent
from workers.report import histogram_svg, series_svg, write_reports


def _report() -> RunReport:
    events: list[SectionEvent] = []
    for i in range(30):
        at = 100.0 + i * 0.25
        common = {"task_id": f"t{i}", "key": f"k{i % 3}", "mode": "exclusive", "token": i + 1}
        events += [
            SectionEvent(kind="enter", time=at, **common),  # type: ignore[arg-type]
            SectionEvent(kind="write", time=at + 0.05, accepted=True, **common),  # type: ignore[arg-type]
            SectionEvent(kind="exit", time=at + 0.1 + i * 0.01, outcome="ok", **common),  # type: ignore[arg-type]
        ]
    # one violation, so the page has something to show in red, and a `<` to escape
    events.append(SectionEvent("enter", "x<y>", "k0", "exclusive", 99, time=110.0))
    events.append(SectionEvent("enter", "z", "k0", "exclusive", 100, time=110.1))
    outcomes = {f"t{i}": TaskOutcome(f"t{i}", "SUCCESS") for i in range(30)}
    outcomes["x<y>"] = TaskOutcome("x<y>", "FAILURE", reason="ValueError: a < b")
    return check_run(
        submitted={task: 99.0 for task in [*outcomes, "z"]},
        outcomes=outcomes,
        events=events,
        faults=[FaultRecord("pause", 104.0, "w1", True, "SIGSTOP")],
        leftover_nodes=0,
    )


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
    data = json.loads(write_reports(report, tmp_path)["json"].read_text())
    assert data == report.to_json()
    assert (data["tasks"], data["violations"], data["ok"]) == (32, 1, False)
    assert data["hold_seconds"] == list(report.hold_seconds)


def test_the_html_page_is_self_contained_with_three_svg_charts(tmp_path: Path) -> None:
    report = _report()
    html = write_reports(report, tmp_path)["html"].read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg ") == 3
    for title in ("Wait time", "Hold time", "Section exits per second"):
        assert title in html
    # bars: 20 histogram bins hold 31 waits and 30 holds; the series has one bar per busy second
    heights = re.findall(r'<rect class="bar"[^>]*height="([\d.]+)"', html)
    assert len(heights) > 10 and all(float(h) > 0 for h in heights)
    for reference in ("<script", "<link", "<img", "src=", "href=", "url(", "@import", "//"):
        assert reference not in html, reference
    assert "x&lt;y&gt;" in html and "x<y>" not in html  # task ids are escaped
    assert 'class="verdict bad"' in html
    assert report.report_line() in html


def test_charts_count_every_value_and_draw_empty_data() -> None:
    svg = histogram_svg([1.0, 1.0, 2.0, 3.0], "h", "s", bins=2)
    counts = re.findall(r"<title>(\d+)</title>", svg)
    assert sorted(map(int, counts)) == [2, 2]  # [1, 2) and [2, 3]
    assert "(n=4)" in svg
    bars = series_svg([3, 0, 1], "s", "seconds")
    assert re.findall(r"<title>(\d+)</title>", bars) == ["3", "1"]  # no bar for an empty second
    assert "no data" in histogram_svg([], "empty", "s") and "no data" in series_svg([], "e", "s")
    # all values equal: one full bin, no division by zero
    assert re.findall(r"<title>(\d+)</title>", histogram_svg([0.5] * 3, "same", "s")) == ["3"]
