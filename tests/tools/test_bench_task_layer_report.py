"""Benchmark section 7 (task layer): its target is judged on the median of the per-repetition
differences between a locked call and the recipe followed by a plain call, and a failed or
missing section is never reported as met."""

from __future__ import annotations

from typing import Any

from benchmarks.common import paired, spread
from benchmarks.report import MET, MISSED, NOT_APPLICABLE, render_markdown, targets
from benchmarks.task_layer import TARGET_TASK_LAYER_MS


def section(zklock: list[float], unlocked: list[float]) -> dict[str, Any]:
    """A section whose ``recipe+plain`` contender took ``unlocked``; ``recipe`` alone took
    0.01 ms less, and ``plain`` 0.01 ms."""
    recipe = [u - 0.01 for u in unlocked]

    def entry(cpu: list[float]) -> dict[str, Any]:
        return {
            "cpu_ms_per_call": spread(cpu),
            "wall_ms_per_call": spread([c * 3 for c in cpu]),
            "zk_requests_per_call": spread([2.0] * len(cpu)),
        }

    return {
        "config": {
            "calls": 2000,
            "warmup": 300,
            "repeats": len(zklock),
            "layout": {"pinned": True, "zk_cpu": 0, "caller_cpu": 1},
        },
        "results": {
            "recipe": entry(recipe),
            "zklock": entry(zklock),
            "plain": entry([0.01] * len(zklock)),
            "recipe+plain": entry(unlocked),
        },
        "task_layer_cpu_ms": paired(zklock, unlocked, lambda a, b: a - b),
        "task_layer_wall_ms": paired(zklock, unlocked, lambda a, b: 3 * (a - b)),
        "over_recipe_cpu_ms": paired(zklock, recipe, lambda a, b: a - b),
    }


def verdict(sections: dict[str, Any]) -> bool | None:
    (row,) = [row for row in targets(sections, quick=False) if row["section"] in ("7", "tasklayer")]
    met: bool | None = row["met"]
    return met


def markdown(sections: dict[str, Any]) -> str:
    return render_markdown(
        {
            "command": "python -m benchmarks --sections tasklayer",
            "mode": "full",
            "started_at": "now",
            "wall_s": 60.0,
            "machine": {
                "nproc": 2,
                "cpu_model": "cpu",
                "ram_gib": 1,
                "loadavg_at_start": [0.0, 0.0, 0.0],
                "python": "3.11",
                "zookeeper": "3.8",
                "redis_server": "7",
                "kazoo_version": "2",
                "celery_version": "5",
                "redis_version": "5",
            },
            "sections": sections,
            "targets": targets(sections, quick=False),
        }
    )


def test_the_target_is_the_median_of_the_per_repetition_differences() -> None:
    recipe = [0.40, 0.50, 0.40, 0.50, 0.45]
    # The medians (0.50 and 0.45) differ by 0.05, within the target; the differences of the
    # repetitions (0.10, -0.06, 0.10, -0.06, 0.11) have the median 0.10, which misses it.
    zklock = [0.50, 0.44, 0.50, 0.44, 0.56]
    assert verdict({"tasklayer": section(zklock, recipe)}) is False
    under = [r + TARGET_TASK_LAYER_MS - 0.01 for r in recipe]
    assert verdict({"tasklayer": section(under, recipe)}) is True


def test_a_failed_section_is_not_applicable_and_the_report_says_why() -> None:
    sections = {"tasklayer": {"error": "Traceback ...\nRuntimeError: boom"}}
    assert verdict(sections) is None
    text = markdown(sections)
    assert "## 7. Task layer" in text and "RuntimeError: boom" in text
    assert f"| {NOT_APPLICABLE} |" in text


def test_the_report_shows_each_contender_and_the_difference() -> None:
    sections = {"tasklayer": section([0.50] * 5, [0.40] * 5)}
    rows = targets(sections, quick=False)
    assert [row["met"] for row in rows] == [False]
    assert "+0.100" in rows[0]["measured"]
    text = markdown(sections)
    for name in ("`recipe`", "`zklock`", "`plain`", "`recipe+plain`", MISSED):
        assert name in text
    # Celery's part of the call counted too: zklock - recipe, 0.01 ms more.
    assert "(zklock - recipe): CPU +0.110" in text
    assert f"| {MET} |" not in text
