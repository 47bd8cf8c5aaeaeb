"""A run's report as files: ``report.json``, ``summary.txt`` and a self-contained ``report.html``.

The HTML page needs nothing but a browser: its charts (wait-time and hold-time histograms,
section exits per second) are inline SVG drawn here, its style is inline, and it references no
script, stylesheet, font or image.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Final

from workers.checker import RunReport

__all__ = ["histogram_svg", "series_svg", "write_reports"]

WIDTH: Final = 520
HEIGHT: Final = 220
MARGIN: Final = (30, 16, 40, 48)  # top, right, bottom, left
BINS: Final = 20

_STYLE: Final = """
body { font-family: sans-serif; margin: 2em; color: #222; }
.verdict { font-family: monospace; padding: .5em; }
.ok { background: #e3f5e1; } .bad { background: #fbe3e3; }
.charts svg { margin: 0 1em 1em 0; border: 1px solid #ddd; }
svg text { font-size: 11px; fill: #333; } svg .title { font-size: 13px; font-weight: bold; }
pre { background: #f6f6f6; padding: 1em; }
"""


def write_reports(report: RunReport, out_dir: Path) -> dict[str, Path]:
    """Write ``report.json``, ``summary.txt`` and ``report.html`` into ``out_dir`` (created if
    missing, files overwritten); return their paths under the keys ``json``, ``summary`` and
    ``html``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "summary": out_dir / "summary.txt",
        "html": out_dir / "report.html",
    }
    lines = report.summary_lines()
    paths["json"].write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    paths["summary"].write_text("\n".join(lines) + "\n")
    paths["html"].write_text(_html(report, lines))
    return paths


def _html(report: RunReport, lines: Sequence[str]) -> str:
    charts = [
        histogram_svg(report.wait_seconds, "Wait time (submit to enter)", "s"),
        histogram_svg(report.hold_seconds, "Hold time (enter to exit)", "s"),
        series_svg(report.throughput, "Section exits per second", "seconds since start"),
    ]
    verdict = "ok" if report.ok else "bad"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        "<title>celery-zklock run report</title>\n"
        f"<style>{_STYLE}</style>\n</head>\n<body>\n"
        "<h1>celery-zklock run report</h1>\n"
        f'<p class="verdict {verdict}">{escape(report.report_line())}</p>\n'
        f'<div class="charts">\n{"".join(charts)}</div>\n'
        f"<h2>Summary</h2>\n<pre>{escape(chr(10).join(lines))}</pre>\n"
        "</body>\n</html>\n"
    )


def histogram_svg(values: Sequence[float], title: str, unit: str, bins: int = BINS) -> str:
    """An inline ``<svg>`` histogram of ``values`` in ``bins`` equal-width bins."""
    if not values:
        return _empty(title)
    low, high = min(values), max(values)
    width = (high - low) / bins or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / width))] += 1
    return _bar_chart(
        counts,
        title=f"{title} (n={len(values)})",
        x_labels=(f"{low:.3g} {unit}", f"{low + width * bins:.3g} {unit}"),
    )


def series_svg(counts: Sequence[int], title: str, x_label: str) -> str:
    """An inline ``<svg>`` bar chart of ``counts``, one bar per step (e.g. per second)."""
    if not counts:
        return _empty(title)
    return _bar_chart(counts, title=title, x_labels=("0", f"{len(counts)} {x_label}"))


def _bar_chart(counts: Sequence[int], *, title: str, x_labels: tuple[str, str]) -> str:
    top, right, bottom, left = MARGIN
    plot_w, plot_h = WIDTH - left - right, HEIGHT - top - bottom
    peak = max(max(counts), 1)
    step = plot_w / len(counts)
    bars = []
    for index, count in enumerate(counts):
        if count:
            h = plot_h * count / peak
            bars.append(
                f'<rect class="bar" x="{left + index * step:.2f}" y="{top + plot_h - h:.2f}" '
                f'width="{max(step - 1, 0.5):.2f}" height="{h:.2f}" fill="#4a7ab5">'
                f"<title>{count}</title></rect>"
            )
    base = top + plot_h
    parts = [
        f'<text class="title" x="{left}" y="18">{escape(title)}</text>',
        f'<line x1="{left}" y1="{base}" x2="{left + plot_w}" y2="{base}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="#888"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{peak}</text>',
        f'<text x="{left - 4}" y="{base}" text-anchor="end">0</text>',
        f'<text x="{left}" y="{base + 16}">{escape(x_labels[0])}</text>',
        f'<text x="{left + plot_w}" y="{base + 16}" text-anchor="end">{escape(x_labels[1])}</text>',
        *bars,
    ]
    return _svg("".join(parts), title)


def _empty(title: str) -> str:
    return _svg(
        f'<text class="title" x="{MARGIN[3]}" y="18">{escape(title)}</text>'
        f'<text x="{WIDTH / 2}" y="{HEIGHT // 2}" text-anchor="middle">no data</text>',
        title,
    )


def _svg(body: str, label: str) -> str:
    return (
        f'<svg width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{escape(label)}">{body}</svg>\n'
    )
