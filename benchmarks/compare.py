"""``python -m benchmarks.compare BEFORE.json AFTER.json``: sections 1 to 4 and 7, before/after.

Reads two ``--json`` reports of ``python -m benchmarks`` and prints one Markdown row per figure of
our own locks: the median with its range [min .. max] over repetitions in each report, and a
verdict. A figure is *worse beyond its spread* when every repetition after is worse than every
repetition before (the two ranges do not overlap, in the worse direction); overlapping ranges are
*within spread*. Exits 0 whatever the verdicts: the table is the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from benchmarks.common import spread

Better = Literal["lower", "higher"]
Figures = dict[str, tuple[dict[str, float], Better]]

_RECIPE_FIGURES: dict[str, Better] = {"p50_ms": "lower", "p99_ms": "lower", "ops_per_s": "higher"}
_CELERY_FIGURES: dict[str, Better] = {
    "tasks_per_s": "higher",
    "vs_baseline": "higher",
    "cpu_ms_per_task": "lower",
    "cpu_ms_added": "lower",
    "span_p50_ms": "lower",
    "span_p99_ms": "lower",
}


def _of_repeats(repeats: list[dict[str, float]], key: str) -> dict[str, float]:
    return spread([r[key] for r in repeats])


def figures(report: dict[str, Any]) -> Figures:
    """Every figure of our locks in sections 1 to 4 and 7 that ``report`` holds, with its spread
    and which direction is better."""
    out: Figures = {}
    sections = report["sections"]
    for case, result in sections.get("recipes", {}).get("cases", {}).items():
        if case.startswith(("mutex", "rw-")):
            for key, better in _RECIPE_FIGURES.items():
                out[f"1 `{case}` {key}"] = (_of_repeats(result["per_repeat"], key), better)
    for n, result in sections.get("contention", {}).get("results", {}).items():
        ours = result["ours"]
        out[f"2 {n} processes grants/s"] = (ours["grants_spread"], "higher")
        out[f"2 {n} processes handoff mean ms"] = (ours["handoff_mean_spread"], "lower")
        out[f"2 {n} processes handoff p99 ms"] = (ours["handoff_p99_spread"], "lower")
    for n, result in sections.get("herd", {}).get("results", {}).items():
        value = float(result["ours"]["per_release"])
        out[f"3 {n} waiters notifications/release"] = (spread([value]), "lower")
    for name, result in sections.get("celery", {}).get("results", {}).items():
        if "zklock" in name:
            for key, better in _CELERY_FIGURES.items():
                if isinstance(result.get(key), dict):
                    out[f"4 `{name}` {key}"] = (result[key], better)
    layer = sections.get("tasklayer")
    if layer is not None:
        for name in ("recipe", "zklock", "recipe+plain"):
            out[f"7 `{name}` CPU ms/call"] = (layer["results"][name]["cpu_ms_per_call"], "lower")
        out["7 task layer CPU ms"] = (layer["task_layer_cpu_ms"], "lower")
        out["7 over the recipe CPU ms"] = (layer["over_recipe_cpu_ms"], "lower")
    return out


def verdict(before: dict[str, float], after: dict[str, float], better: Better) -> str:
    """``worse beyond spread``, ``better beyond spread`` or ``within spread``."""
    above, below = after["min"] > before["max"], after["max"] < before["min"]
    if (above, below) == (False, False):
        return "within spread"
    return "worse beyond spread" if above == (better == "lower") else "better beyond spread"


def table(before: Figures, after: Figures) -> tuple[list[str], int]:
    """The Markdown rows and the count of figures worse beyond their spread."""

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.3f} [{s['min']:.3f} .. {s['max']:.3f}]"

    rows = ["| figure | before | after | verdict |", "|---|---|---|---|"]
    worse = 0
    for name, (was, better) in before.items():
        if name not in after:
            continue
        now = after[name][0]
        said = verdict(was, now, better)
        worse += said.startswith("worse")
        shown = f"**{said}**" if said.startswith("worse") else said
        rows.append(f"| {name} ({better} is better) | {cell(was)} | {cell(now)} | {shown} |")
    return rows, worse


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    before, after = (figures(json.loads(Path(p).read_text())) for p in argv)
    rows, worse = table(before, after)
    print("\n".join(rows))
    print(f"\n{worse} of {len(rows) - 2} figures worse beyond their spread")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
