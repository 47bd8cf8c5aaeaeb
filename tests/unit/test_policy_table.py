"""The policy table: one test per row (the same rows run through a task in
tests/task/test_policy_task.py)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_zklock import LockBusy, LockLost, LockTimeout, Preempted, ZooKeeperUnavailable
from celery_zklock.errors import RateLimited
from celery_zklock.task.policy import TABLE, Verdict, decide

ROWS = [
    ("busy", "skip", Verdict("skip")),
    ("busy", "wait", Verdict("wait")),
    ("busy", "retry", Verdict("retry", LockBusy)),
    ("busy", "raise", Verdict("raise", LockBusy)),
    ("busy", "preempt", Verdict("wait")),
    ("busy", "replace", Verdict("wait")),  # as the key's one waiting call
    ("rate", "skip", Verdict("skip")),
    ("rate", "wait", Verdict("wait")),
    ("rate", "retry", Verdict("retry", RateLimited)),
    ("rate", "raise", Verdict("raise", RateLimited)),
    ("superseded", "skip", Verdict("skip")),  # preempt met a newer call of its task
    ("debounced", "skip", Verdict("skip")),  # a newer call came within the window
    ("replaced", "skip", Verdict("skip")),  # a newer replace call took the waiting place
    ("timeout", "skip", Verdict("skip")),
    ("timeout", "retry", Verdict("retry", LockTimeout)),
    ("timeout", "raise", Verdict("raise", LockTimeout)),
    ("lost", "retry", Verdict("retry", LockLost)),
    ("lost", "raise", Verdict("raise", LockLost)),
    ("preempted", "retry", Verdict("retry", Preempted)),
    ("preempted", "raise", Verdict("raise", Preempted)),
    ("unavailable", "retry", Verdict("retry", ZooKeeperUnavailable)),
    ("unavailable", "raise", Verdict("raise", ZooKeeperUnavailable)),
]


def test_the_table_has_exactly_these_rows() -> None:
    assert dict(TABLE) == {(s, p): v for s, p, v in ROWS}


@pytest.mark.parametrize(("situation", "policy", "verdict"), ROWS)
def test_row(situation: Any, policy: str, verdict: Verdict) -> None:
    assert decide(situation, policy, in_worker=True) == verdict


def test_unavailable_raises_outside_a_worker() -> None:
    assert decide("unavailable", "retry", in_worker=False) == Verdict("raise", ZooKeeperUnavailable)
    assert decide("busy", "retry", in_worker=False) == Verdict("retry", LockBusy)


def test_policies_a_situation_does_not_have_are_refused() -> None:
    for situation, policy in [("timeout", "wait"), ("lost", "skip"), ("lost", "wait")]:
        with pytest.raises(KeyError):
            decide(situation, policy, in_worker=True)  # type: ignore[arg-type]
