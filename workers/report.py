"""A run's report as files: ``report.json``, ``summary.txt`` and a self-contained ``report.html``.

The HTML page needs nothing but a browser: it references no script, stylesheet, font or image,
and everything on it is inline SVG and CSS drawn here. From the top: the verdict and its counts;
the timeline of the critical sections per lock key with the faults (:mod:`workers.timeline`,
drawn only when the run's section events are given); wait and hold times as histograms over
log-spaced bins with p50, p95 and p99 marked; section exits per second; the faults and the
overlaps as tables; the summary. Its text wraps to the window: nothing but a table scrolls
sideways, inside its own box. How to read it: ``docs/fleet.md``, "Reading the report".
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Final

from workers.checker import FaultImpact, RunReport
from workers.record import FaultRecord, SectionEvent
from workers.timeline import (
    CHAR_W,
    PALETTE,
    Timeline,
    build_timeline,
    nice_step,
    section_counts,
    select_keys,
    stack_labels,
    timeline_svg,
    worker_colours,
)

__all__ = [
    "KEY_LIMIT",
    "PERCENTILES",
    "LogBins",
    "format_seconds",
    "histogram_svg",
    "log_bins",
    "quantile",
    "render_html",
    "series_svg",
    "write_reports",
]

WIDTH: Final = 560
HEIGHT: Final = 270
MARGIN: Final = (34, 18, 40, 44)  # top, right, bottom, left
LABEL_TOP: Final = 36  # baseline of the first row of percentile labels
LABEL_ROW: Final = 13
SERIES_WIDTH: Final = 1160
FLOOR: Final = 1e-4
"""Seconds: a log histogram's bins start at the shortest time of at least this; shorter ones
(zeros) count in its first bin."""
PERCENTILES: Final = ((0.50, "p50"), (0.95, "p95"), (0.99, "p99"))
KEY_LIMIT: Final = 12
"""Keys drawn on the timeline besides those with a violation or a fault (see
:func:`workers.timeline.select_keys`)."""
TABLE_ROWS: Final = 60

_STYLE: Final = """
*, *::before, *::after { box-sizing: border-box; }
body { font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: #1d2330; margin: 0 auto;
  max-width: 1280px; padding: 16px 24px 40px; overflow-wrap: anywhere; }
h1 { font-size: 22px; margin: 0 0 10px; } h2 { font-size: 17px; margin: 28px 0 8px; }
code, .mono { font-family: "DejaVu Sans Mono", ui-monospace, monospace; font-size: 12.5px; }
.verdict { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: baseline;
  padding: 8px 12px; border-radius: 6px; border-left: 6px solid; }
.verdict strong { font-size: 18px; letter-spacing: .04em; }
.ok { background: #e6f4e4; border-color: #3c8d3a; }
.bad { background: #fbe4e2; border-color: #c62828; }
.tiles { display: flex; flex-wrap: wrap; gap: 8px; margin: 12px 0 4px; }
.tile { flex: 0 1 auto; min-width: 92px; padding: 6px 10px; border: 1px solid #dde1e7;
  border-radius: 6px; background: #fafbfc; }
.tile b { display: block; font-size: 20px; line-height: 1.2; }
.tile span { font-size: 12px; color: #596273; }
.tile.alarm { border-color: #c62828; background: #fdecea; } .tile.alarm b { color: #b71c1c; }
.tile.warn { border-color: #e0a100; background: #fff7e0; }
.note { color: #4a5262; margin: 4px 0 8px; max-width: 100ch; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 16px; margin: 6px 0 10px; font-size: 13px; }
.legend span { display: inline-flex; align-items: center; gap: 5px; }
.legend svg { display: inline; flex: none; }
.sw { display: inline-block; width: 14px; height: 10px; border-radius: 2px; }
.figure { border: 1px solid #e1e4e8; border-radius: 6px; padding: 6px; background: #fff; }
svg { max-width: 100%; height: auto; display: block; }
svg text { font-size: 11px; fill: #333; font-family: "DejaVu Sans", sans-serif; }
svg .title { font-size: 13px; font-weight: bold; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 460px), 1fr));
  gap: 12px; }
.charts .wide { grid-column: 1 / -1; }
.caption { font-size: 13px; color: #4a5262; margin: 2px 4px 0; }
.bar { fill: #4a7ab5; } .grid { stroke: #e6e8ec; } .axis { stroke: #888; }
.pct line { stroke-width: 1.5; } .p50 line { stroke: #1d2330; }
.p95 line { stroke: #d9730d; stroke-dasharray: 5 3; }
.p99 line { stroke: #c62828; stroke-dasharray: 2 2; }
.pct text { paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.p50 text { fill: #1d2330; } .p95 text { fill: #b25e00; } .p99 text { fill: #b71c1c; }
.band0 { fill: #f6f7f9; } .band1 { fill: #fff; }
.key { font-weight: bold; } .count { font-weight: normal; fill: #7a8291; }
.violation { fill: #e53935; fill-opacity: .28; stroke: #c62828; stroke-width: 1.5; }
.revoked { fill: #f5b000; fill-opacity: .3; }
.s.open { opacity: .45; } .s.inviolation { stroke: #b71c1c; stroke-width: 2; }
.cap-lost { fill: #d50000; } .cap-killed { fill: #111; } .cap-error { fill: #777; }
.hit { fill: #111; }
.refused { fill: #d50000; stroke: #fff; stroke-width: 1; }
.stale { fill: #c2185b; stroke: #fff; stroke-width: 1; }
.fault line { stroke: #37474f; stroke-width: 1.5; stroke-dasharray: 6 3; }
.fault text { font-weight: bold; fill: #263238; }
.fault.notrun line { stroke: #9aa3ad; stroke-dasharray: 1 3; }
.fault.notrun text { fill: #8a939d; font-weight: normal; }
.scroll { overflow-x: auto; max-width: 100%; border: 1px solid #e1e4e8; border-radius: 6px; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { padding: 4px 8px; border-bottom: 1px solid #eceef1; text-align: left; vertical-align: top;
  overflow-wrap: break-word; }
th { background: #f3f5f7; white-space: nowrap; } td.num { text-align: right; white-space: nowrap; }
td.long { min-width: 22em; }
tr.violation-row td { background: #fdecea; }
.summary { margin: 0; padding-left: 1.2em; } .summary li { margin: 2px 0; }
.summary li.sub { list-style: circle; margin-left: 1.5em; color: #3b4252; }
.summary li.last { list-style: none; font-family: "DejaVu Sans Mono", monospace;
  font-size: 12.5px; }
""" + "".join(f".w{i} {{ fill: {colour}; }}\n" for i, colour in enumerate(PALETTE))


# ------------------------------------------------------------------------------------- files


def write_reports(
    report: RunReport,
    out_dir: Path,
    *,
    events: Sequence[SectionEvent] = (),
    faults: Sequence[FaultRecord] | None = None,
    start: float | None = None,
    key_limit: int = KEY_LIMIT,
) -> dict[str, Path]:
    """Write ``report.json``, ``summary.txt`` and ``report.html`` into ``out_dir`` (created if
    missing, files overwritten); return their paths under the keys ``json``, ``summary`` and
    ``html``.

    ``events`` (the run's section events, in list order) and ``faults`` (its fault records) are
    what the page's timeline draws; without events it has no timeline, and without ``faults``
    it uses those of ``report.fault_impacts`` (the ones that ran). ``start`` is the wall-clock
    time of the timeline's 0 (the first submission, say; by default the first record).
    ``key_limit`` caps the keys drawn besides those with a violation or a fault. The JSON and
    the summary come from ``report`` alone.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "summary": out_dir / "summary.txt",
        "html": out_dir / "report.html",
    }
    lines = report.summary_lines()
    paths["json"].write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    paths["summary"].write_text("\n".join(lines) + "\n")
    if faults is None:
        faults = [impact.fault for impact in report.fault_impacts]
    timeline = (
        build_timeline(events, faults, report.overlaps, report.stale_writes, start)
        if events
        else None
    )
    paths["html"].write_text(render_html(report, lines, timeline, faults, key_limit))
    return paths


# ------------------------------------------------------------------------------- statistics


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of non-empty ``values``: the smallest value
    with at least ``q`` of them at or below it (the summary's rule too)."""
    if not values:
        raise ValueError("the quantile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class LogBins:
    """A histogram over log-spaced bins: bin ``i`` is ``[edges[i], edges[i + 1])`` (the last
    one closed), ``counts[i]`` the values in it; ``clipped`` of them were below ``edges[0]``
    (zero, or under the floor) and are counted in the first bin."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    per_decade: int
    clipped: int = 0


def log_bins(
    values: Sequence[float], per_decade: int | None = None, floor: float = FLOOR
) -> LogBins:
    """Bin non-empty ``values`` (seconds, >= 0) on edges ``10 ** (k / per_decade)``, from the
    edge at or below the smallest value of at least ``floor`` to the first edge above the
    largest, so every value lands in exactly one bin; values under ``floor`` (zeros) count in
    the first bin, and in ``clipped``.

    Without ``per_decade``, it is chosen for about 24 bins over the values' span (between 4
    and 20 a decade): a narrow spread still gets several bins, a wide one not hundreds.
    """
    if not values:
        raise ValueError("log bins of no values")
    if floor <= 0:
        raise ValueError(f"the floor must be positive, got {floor}")
    # Values under the floor join the smallest one above it, so that a few zeros do not
    # stretch the axis over decades that hold nothing else.
    lowest = min((v for v in values if v >= floor), default=floor)
    logs = [math.log10(max(v, lowest)) for v in values]
    low, high = min(logs), max(logs)
    if per_decade is None:
        per_decade = min(20, max(4, math.ceil(24 / max(high - low, 1e-9))))
    if per_decade < 1:
        raise ValueError(f"per_decade must be at least 1, got {per_decade}")
    # A value on an edge belongs to the bin it opens; the epsilon absorbs log10's rounding.
    first = math.floor(low * per_decade + 1e-9)
    last = math.floor(high * per_decade + 1e-9) + 1
    counts = [0] * (last - first)
    for log in logs:
        index = math.floor(log * per_decade + 1e-9) - first
        counts[min(max(index, 0), len(counts) - 1)] += 1
    return LogBins(
        edges=tuple(10 ** (k / per_decade) for k in range(first, last + 1)),
        counts=tuple(counts),
        per_decade=per_decade,
        clipped=sum(1 for v in values if v < floor),
    )


def format_seconds(value: float) -> str:
    """A duration for people: ``850 µs``, ``12.5 ms``, ``1.25 s``, ``2 min 5 s``; three
    significant digits below a minute."""
    if value < 0:
        return "-" + format_seconds(-value)
    if value == 0:
        return "0 s"
    if value < 1e-3:
        return f"{value * 1e6:.3g} µs"
    if value < 1:
        return f"{value * 1e3:.3g} ms"
    if value < 60:
        return f"{value:.3g} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"


# ------------------------------------------------------------------------------------ charts


def histogram_svg(values: Sequence[float], title: str, floor: float = FLOOR) -> str:
    """An inline ``<svg>`` histogram of ``values`` (seconds) over :func:`log_bins`, with a
    line at each of :data:`PERCENTILES`; each bar's ``<title>`` starts with its count."""
    if not values:
        return _empty(title)
    bins = log_bins(values, floor=floor)
    _, right, bottom, left = MARGIN
    plot_w = WIDTH - left - right
    lo, hi = math.log10(bins.edges[0]), math.log10(bins.edges[-1])

    def x(value: float) -> float:
        return left + plot_w * (math.log10(max(value, bins.edges[0])) - lo) / (hi - lo)

    marks = [(quantile(values, q), name) for q, name in PERCENTILES]
    spans = []
    for value, name in marks:  # a label right of its line, or left of it at the right edge
        width = len(f"{name} {format_seconds(value)}") * CHAR_W
        at = x(value) + 3
        spans.append((at, at + width) if at + width <= WIDTH - 2 else (at - 6 - width, at - 6))
    rows = stack_labels(spans)
    top = LABEL_TOP + LABEL_ROW * max(rows) + 8
    plot_h = HEIGHT - top - bottom
    peak = max(bins.counts)
    base = top + plot_h
    parts = [f'<text class="title" x="{left}" y="16">{escape(title)} (n={len(values)})</text>']
    parts += _grid(left, plot_w, base, plot_h, peak)
    for index, count in enumerate(bins.counts):
        if count:
            x0, x1 = x(bins.edges[index]), x(bins.edges[index + 1])
            h = plot_h * count / peak
            parts.append(
                f'<rect class="bar" x="{x0 + 0.5:.2f}" y="{base - h:.2f}" '
                f'width="{max(x1 - x0 - 1, 0.5):.2f}" height="{h:.2f}"><title>{count} in '
                f"{format_seconds(bins.edges[index])} to {format_seconds(bins.edges[index + 1])}"
                "</title></rect>"
            )
    ticks = [(x(tick), format_seconds(tick)) for tick in _log_ticks(bins.edges[0], bins.edges[-1])]
    clipped = f"; {bins.clipped} under {format_seconds(floor)} counted in the first bar"
    parts += _x_axis(left, plot_w, base, ticks, "log scale" + (clipped if bins.clipped else ""))
    for (value, name), row, (x0, _) in zip(marks, rows, spans, strict=True):
        ty = LABEL_TOP + LABEL_ROW * row
        parts.append(
            f'<g class="pct {name}"><title>{name} {format_seconds(value)}</title>'
            f'<line x1="{x(value):.1f}" y1="{ty + 3}" x2="{x(value):.1f}" y2="{base}"/>'
            f'<text x="{x0:.1f}" y="{ty}">{name} {format_seconds(value)}</text></g>'
        )
    return _svg("".join(parts), f"{title}, log scale", WIDTH, HEIGHT)


def series_svg(counts: Sequence[int], title: str, x_label: str) -> str:
    """An inline ``<svg>`` bar chart of ``counts``, one bar per step (e.g. per second), each
    bar's ``<title>`` its count; no bar for a zero."""
    if not counts:
        return _empty(title)
    top, right, bottom, left = MARGIN
    plot_w, plot_h = SERIES_WIDTH - left - right, 170 - top - bottom + 20
    height = top + plot_h + bottom
    peak = max(max(counts), 1)
    step = plot_w / len(counts)
    base = top + plot_h
    parts = [f'<text class="title" x="{left}" y="16">{escape(title)}</text>']
    parts += _grid(left, plot_w, base, plot_h, peak)
    for index, count in enumerate(counts):
        if count:
            h = plot_h * count / peak
            parts.append(
                f'<rect class="bar" x="{left + index * step:.2f}" y="{base - h:.2f}" '
                f'width="{max(step - 1, 0.5):.2f}" height="{h:.2f}"><title>{count}</title></rect>'
            )
    tick = nice_step(len(counts))
    ticks = [(left + i * tick * step, f"{i * tick:g}") for i in range(int(len(counts) / tick) + 1)]
    parts += _x_axis(left, plot_w, base, ticks, escape(x_label))
    return _svg("".join(parts), title, SERIES_WIDTH, height)


def _grid(left: int, plot_w: int, base: int, plot_h: int, peak: float) -> list[str]:
    """The horizontal grid of a bar chart: a line at half and at full height of a plot ``plot_w``
    wide from ``left``, whose bars stand on ``base`` and reach ``plot_h`` up at count ``peak``,
    each labelled with its count left of the plot."""
    # ints: some coordinates are written as they are, and "44.0" would change the markup
    lines = []
    for fraction in (0.5, 1.0):
        gy = base - plot_h * fraction
        lines.append(
            f'<line class="grid" x1="{left}" y1="{gy:.1f}" x2="{left + plot_w}" y2="{gy:.1f}"/>'
            f'<text x="{left - 4}" y="{gy + 4:.1f}" text-anchor="end">'
            f"{_count_label(peak * fraction)}</text>"
        )
    return lines


def _x_axis(
    left: int, plot_w: int, base: int, ticks: Sequence[tuple[float, str]], caption: str
) -> list[str]:
    """The x axis of a chart along ``base``: a tick mark with its label under it at each
    ``(x, label)`` of ``ticks``, then the axis line from ``left`` across ``plot_w`` with
    ``caption`` under its right end. Labels and caption are markup, inserted as given (escape
    any text first)."""
    marks = [
        f'<line class="axis" x1="{tx:.1f}" y1="{base}" x2="{tx:.1f}" y2="{base + 4}"/>'
        f'<text x="{tx:.1f}" y="{base + 16}" text-anchor="middle">{label}</text>'
        for tx, label in ticks
    ]
    marks.append(
        f'<line class="axis" x1="{left}" y1="{base}" x2="{left + plot_w}" y2="{base}"/>'
        f'<text x="{left + plot_w}" y="{base + 32}" text-anchor="end">{caption}</text>'
    )
    return marks


def _log_ticks(low: float, high: float) -> list[float]:
    """Decades within ``[low, high]``, with 2 and 5 times them when fewer than three decades
    fall inside (a narrow axis would otherwise have one tick or none)."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    decades = [
        10.0**e for e in range(first, last + 1) if low <= 10.0**e * (1 + 1e-9) <= high * (1 + 2e-9)
    ]
    if len(decades) >= 3:
        return decades
    return [
        m * 10.0**e
        for e in range(first, last + 1)
        for m in (1, 2, 5)
        if low * (1 - 1e-9) <= m * 10.0**e <= high * (1 + 1e-9)
    ]


def _count_label(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _empty(title: str) -> str:
    return _svg(
        f'<text class="title" x="{MARGIN[3]}" y="16">{escape(title)}</text>'
        f'<text x="{WIDTH / 2}" y="{HEIGHT // 2}" text-anchor="middle">no data</text>',
        title,
        WIDTH,
        HEIGHT,
    )


def _svg(body: str, label: str, width: int, height: int) -> str:
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{escape(label)}">{body}</svg>\n'
    )


# -------------------------------------------------------------------------------------- page


def render_html(
    report: RunReport,
    lines: Sequence[str],
    timeline: Timeline | None,
    faults: Sequence[FaultRecord],
    key_limit: int = KEY_LIMIT,
) -> str:
    """The page :func:`write_reports` writes: ``lines`` are the summary's, ``timeline`` None
    for a page without one."""
    verdict = "ok" if report.ok else "bad"
    waits = _caption(report.wait_seconds)
    holds = _caption(report.hold_seconds)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<title>celery-zklock run report</title>\n"
        f"<style>{_STYLE}</style>\n</head>\n<body>\n"
        "<h1>celery-zklock run report</h1>\n"
        f'<p class="verdict {verdict}"><strong>{"PASS" if report.ok else "FAIL"}</strong> '
        f"<code>{escape(report.report_line())}</code></p>\n"
        f"{_tiles(report)}"
        "<h2>Timeline of the critical sections</h2>\n"
        f"{_timeline_block(timeline, key_limit)}"
        "<h2>Wait and hold times</h2>\n"
        '<div class="charts">\n'
        f'<div class="figure">{histogram_svg(report.wait_seconds, "Wait (submit to enter)")}'
        f'<p class="caption">{waits}</p></div>\n'
        f'<div class="figure">{histogram_svg(report.hold_seconds, "Hold (enter to exit)")}'
        f'<p class="caption">{holds}</p></div>\n'
        '<div class="figure wide">'
        f"{series_svg(report.throughput, 'Section exits per second', 'seconds since start')}"
        "</div>\n</div>\n"
        f"{_fault_table(faults, report.fault_impacts, timeline)}"
        f"{_overlap_table(report)}"
        f"<h2>Summary</h2>\n{_summary_list(lines)}"
        "</body>\n</html>\n"
    )


def _tiles(report: RunReport) -> str:
    r = report
    tiles = [
        ("tasks", r.tasks, ""),
        ("ran", r.ran, ""),
        ("skipped", r.skipped, ""),
        ("failed", r.failed, "warn" if r.failed else ""),
        ("lost", r.lost, "alarm" if r.lost else ""),
        ("dropped by the broker", r.broker_dropped, "warn" if r.broker_dropped else ""),
        ("violations", r.violations, "alarm" if r.violations else ""),
        ("of them rate", r.rate_violations, "alarm" if r.rate_violations else ""),
        (
            "completed twice",
            r.duplicate_completions,
            "alarm" if r.duplicate_completions else "",
        ),
        ("revoked overlaps", r.revoked_overlaps, "warn" if r.revoked_overlaps else ""),
        (
            "stale writes accepted",
            r.stale_writes_accepted,
            "alarm" if r.stale_writes_accepted else "",
        ),
        ("writes refused", r.writes_refused, ""),
        ("sections lost lock", r.revocations, "warn" if r.revocations else ""),
        ("sections preempted", r.preempted, ""),
        ("sections killed", r.killed_sections, ""),
        ("faults injected", sum(c.injected for c in r.faults_by_kind.values()), ""),
        ("leftover znodes", r.leftover_nodes, "alarm" if r.leftover_nodes else ""),
    ]
    cells = "".join(
        f'<div class="tile {level}"><b>{value}</b><span>{escape(label)}</span></div>'
        for label, value, level in tiles
    )
    return f'<div class="tiles">{cells}</div>\n'


def _caption(values: Sequence[float]) -> str:
    if not values:
        return "no values"
    marks = [f"{name} {format_seconds(quantile(values, q))}" for q, name in PERCENTILES]
    low, high = format_seconds(min(values)), format_seconds(max(values))
    return " · ".join([f"n={len(values)}", f"min {low}", *marks, f"max {high}"])


def _timeline_block(timeline: Timeline | None, key_limit: int) -> str:
    if timeline is None or not timeline.sections:
        return '<p class="note">No section records were given to the report: no timeline.</p>\n'
    counts = section_counts(timeline)
    shown, left_out = select_keys(counts, timeline.must_show(), timeline.notable(), key_limit)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timeline.start))
    note = (
        f"One band per lock key, one bar per critical section from its enter to its exit, "
        f"coloured by worker; holders of one key at the same time stack in rows. "
        f"t = 0 is {when}; hover over a bar, band or fault for its details."
    )
    if left_out:
        hidden = sum(counts[k] for k in left_out)
        note += (
            f" Showing {len(shown)} of {len(counts)} keys (the busiest, and every key with a "
            f"violation or a fault); {len(left_out)} left out with {hidden} sections: "
            + ", ".join(escape(k) for k in left_out[:20])
            + (" …" if len(left_out) > 20 else "")
            + "."
        )
    return (
        f'<p class="note">{note}</p>\n'
        f"{_legend(timeline)}"
        f'<div class="figure">{timeline_svg(timeline, shown)}</div>\n'
    )


def _legend(timeline: Timeline) -> str:
    colours = worker_colours(timeline.workers())
    per_worker = Counter(s.worker for s in timeline.sections)
    items = [
        f'<span><i class="sw" style="background:{colour}"></i>{escape(worker)} '
        f"<small>({per_worker[worker]})</small></span>"
        for worker, colour in colours.items()
    ]
    marks = [
        ('<rect x="1" y="3" width="12" height="7" fill="#888"/>', "shared (read) section"),
        ('<rect x="1" y="1" width="10" height="11" fill="#888"/>'
         '<rect x="10" y="0" width="3" height="13" fill="#d50000"/>', "ended: lock lost"),
        ('<rect x="1" y="1" width="10" height="11" fill="#888"/>'
         '<rect x="10" y="0" width="3" height="13" fill="#111"/>', "ended: process killed"),
        ('<rect x="1" y="1" width="10" height="11" fill="#888"/>'
         '<rect x="10" y="0" width="3" height="13" fill="#777"/>', "ended: error"),
        ('<rect x="1" y="1" width="12" height="11" fill="#888" opacity=".45"/>',
         "still inside at the end"),
        ('<rect x="1" y="1" width="12" height="11" fill="#888"/>'
         '<rect x="6" y="-1" width="2" height="15" fill="#111"/>',
         "its process paused or expired by a fault"),
        ('<rect x="0" y="0" width="14" height="13" fill="#e53935" fill-opacity=".28" '
         'stroke="#c62828"/>', "violation (overlap)"),
        ('<rect x="0" y="0" width="14" height="13" fill="#f5b000" fill-opacity=".3"/>',
         "revoked overlap"),
        ('<path d="M2 1h10l-5 8z" fill="#d50000"/>', "fenced write refused"),
        ('<path d="M7 0l5 6-5 6-5-6z" fill="#c2185b"/>', "stale write accepted"),
        ('<line x1="7" y1="0" x2="7" y2="13" stroke="#37474f" stroke-width="1.5" '
         'stroke-dasharray="4 2"/>', "fault (grey dotted: not run)"),
    ]  # fmt: skip
    items += [
        f'<span><svg width="14" height="13" viewBox="0 -1 14 15" aria-hidden="true">{icon}</svg>'
        f"{escape(text)}</span>"
        for icon, text in marks
    ]
    return f'<div class="legend">{"".join(items)}</div>\n'


def _fault_table(
    faults: Sequence[FaultRecord], impacts: Sequence[FaultImpact], timeline: Timeline | None
) -> str:
    if not faults:
        return '<h2>Faults</h2>\n<p class="note">No fault was injected.</p>\n'
    by_fault: Mapping[FaultRecord, FaultImpact] = {i.fault: i for i in impacts}
    origin = timeline.start if timeline is not None else min(f.time for f in faults)
    rows = []
    for fault in sorted(faults, key=lambda f: f.time):
        impact = by_fault.get(fault)
        effect = (
            f"{impact.lost_sections} lost lock, {impact.killed_sections} killed, "
            f"{impact.revoked_overlaps} revoked overlaps, {impact.refused_writes} writes refused"
            + impact.failures_text()
            if impact is not None
            else ""
        )
        rows.append(
            f'<tr><td class="num">{fault.time - origin:.1f}</td><td>{escape(fault.kind)}</td>'
            f"<td>{'ran' if fault.ran else '<b>not run</b>'}</td>"
            f'<td class="long">{escape(fault.target)}</td><td class="long">{escape(fault.detail)}'
            f"</td><td>{effect}</td></tr>"
        )
    return (
        "<h2>Faults</h2>\n"
        '<p class="note">Until the next fault: what followed each one.</p>\n'
        '<div class="scroll"><table><thead><tr><th>t (s)</th><th>kind</th><th>result</th>'
        "<th>target</th><th>detail</th><th>until the next fault</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>\n"
    )


def _overlap_table(report: RunReport) -> str:
    if not report.overlaps:
        return ""
    ordered = sorted(report.overlaps, key=lambda o: (o.revoked, o.position))
    rows = [
        f'<tr class="{"" if o.revoked else "violation-row"}">'
        f"<td>{'revoked' if o.revoked else '<b>violation</b>'}</td>"
        f'<td class="num">#{o.position}</td><td>{escape(o.key)}</td>'
        f"<td>{escape(o.entering)} ({o.entering_mode})</td>"
        f"<td>{escape(', '.join(o.inside))}</td></tr>"
        for o in ordered[:TABLE_ROWS]
    ]
    more = (
        f'<p class="note">{len(ordered) - TABLE_ROWS} more not listed (report.json has all).</p>\n'
        if len(ordered) > TABLE_ROWS
        else ""
    )
    return (
        "<h2>Overlaps</h2>\n"
        '<p class="note">A section entered while a conflicting one was inside. Revoked: every '
        "holder inside had its lease taken by a fault and knew it (the fence covers that "
        "window); anything else is a violation.</p>\n"
        '<div class="scroll"><table><thead><tr><th>verdict</th><th>event</th><th>key</th>'
        "<th>entering</th><th>inside</th></tr></thead><tbody>"
        + "".join(rows)
        + f"</tbody></table></div>\n{more}"
    )


def _summary_list(lines: Sequence[str]) -> str:
    items = []
    for index, line in enumerate(lines):
        kind = "last" if index == len(lines) - 1 else "sub" if line.startswith(" ") else ""
        items.append(f'<li class="{kind}">{escape(line.strip())}</li>')
    return f'<ul class="summary">{"".join(items)}</ul>\n'
