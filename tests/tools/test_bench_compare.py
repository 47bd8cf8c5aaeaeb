"""``python -m benchmarks.compare``: the before/after verdict per figure, without a server."""

from __future__ import annotations

import pytest

from benchmarks.common import spread
from benchmarks.compare import figures, table, verdict


def _range(low: float, high: float) -> dict[str, float]:
    return spread([low, (low + high) / 2, high])


@pytest.mark.parametrize(
    ("before", "after", "better", "expected"),
    [
        ((1, 2), (3, 4), "lower", "worse beyond spread"),
        ((1, 2), (3, 4), "higher", "better beyond spread"),
        ((3, 4), (1, 2), "higher", "worse beyond spread"),
        ((3, 4), (1, 2), "lower", "better beyond spread"),
        ((1, 3), (2, 4), "lower", "within spread"),
        ((1, 3), (2, 4), "higher", "within spread"),
    ],
)
def test_only_ranges_apart_are_a_change(
    before: tuple[float, float], after: tuple[float, float], better: str, expected: str
) -> None:
    assert verdict(_range(*before), _range(*after), better) == expected  # type: ignore[arg-type]


def test_a_task_layer_that_got_dearer_is_counted_worse() -> None:
    def report(cpu: tuple[float, float]) -> dict[str, object]:
        call = {"cpu_ms_per_call": _range(*cpu)}
        return {
            "sections": {
                "tasklayer": {
                    "results": {"recipe": call, "zklock": call, "recipe+plain": call},
                    "task_layer_cpu_ms": _range(*cpu),
                    "over_recipe_cpu_ms": _range(0.1, 0.2),
                }
            }
        }

    rows, worse = table(figures(report((0.2, 0.3))), figures(report((0.4, 0.5))))
    assert worse == 4  # three contenders and the task layer; "over the recipe" is unchanged
    assert any("7 task layer CPU ms" in row and "**worse beyond spread**" in row for row in rows)
