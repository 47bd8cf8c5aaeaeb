"""``check_run`` on hand-built histories, and on histories recorded for real in Redis (and by
``run_section`` under a real ZooKeeper lock whose session is expired on the server)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from kazoo.client import KazooClient

from celery_zklock import LockLost, Mutex, RedisFence, ZkLockTask
from celery_zklock.locks.rate import ADMISSION_PREFIX, RATE_NODE, TTL_ADMISSION_PREFIX
from tests.lockutil import expire_session, wait_for
from workers.admissions import find_admission
from workers.checker import FaultCount, RunReport, TaskOutcome, check_run
from workers.record import (
    FAULT_KINDS,
    MAIN_PROCESS_KILL,
    FaultLog,
    FaultRecord,
    Mode,
    SectionEvent,
    SectionRecorder,
)
from workers.tasks import RECORD_URL_SETTING, fence_namespace, run_section

HOST = "w1@test"


def ev(
    kind: str, task: str, mode: Mode = "exclusive", token: int = 0, **extra: Any
) -> SectionEvent:
    """An event of key ``k``; the token defaults to a number derived from the task name."""
    extra.setdefault("key", "k")
    return SectionEvent(kind=kind, task_id=task, mode=mode, token=token, **extra)  # type: ignore[arg-type]


def section(
    task: str, token: int, mode: Mode = "exclusive", *, at: float = 0.0
) -> list[SectionEvent]:
    """A whole clean section: enter, accepted write, exit ok."""
    return [
        ev("enter", task, mode, token, time=at),
        ev("write", task, mode, token, accepted=True, time=at + 0.1),
        ev("exit", task, mode, token, time=at + 0.2, outcome="ok"),
    ]


def killed(pid: int, at: float = 0.0, *, late: bool = False) -> SectionEvent:
    return SectionEvent(
        "killed", "", "", "exclusive", 0, hostname=HOST, pid=pid, time=at, late=late
    )


def forced(
    kind: str,
    pid: int = 0,
    hostname: str = "",
    *,
    at: float = 0.0,
    timeout: float | None = 4.0,
    valid_until: float | None = None,
) -> SectionEvent:
    """A ``paused``, ``expired`` or ``survived`` event (defaults: the process of ``ev``'s
    events; a pause at ``at`` of a worker whose session timeout is 4 s)."""
    return SectionEvent(
        kind,  # type: ignore[arg-type]
        "",
        "",
        "exclusive",
        0,
        hostname=hostname,
        pid=pid,
        time=at,
        session_timeout=timeout if kind == "paused" else None,
        valid_until=valid_until,
    )


def check(
    events: Sequence[SectionEvent],
    *,
    outcomes: dict[str, TaskOutcome] | None = None,
    faults: Sequence[FaultRecord] = (),
    leftover_nodes: int = 0,
) -> RunReport:
    """Every task seen in ``events`` submitted at t=0 and ended SUCCESS unless told otherwise."""
    tasks = {e.task_id for e in events if e.task_id}
    given = outcomes or {}
    return check_run(
        submitted={t: 0.0 for t in sorted(tasks | set(given))},
        outcomes={t: given.get(t, TaskOutcome(t, "SUCCESS")) for t in tasks} | given,
        events=events,
        faults=faults,
        leftover_nodes=leftover_nodes,
    )


# ----------------------------------------------------------------------------- exclusion


def test_a_clean_history_is_ok() -> None:
    report = check([*section("a", 1), *section("b", 2, at=1.0), *section("c", 3, "shared", at=2)])
    assert report.ok and report.violations == report.revoked_overlaps == 0
    assert (report.tasks, report.ran, report.writes_accepted) == (3, 3, 3)
    assert report.hold_seconds == pytest.approx((0.2, 0.2, 0.2))


def test_two_valid_exclusive_holders_at_once_are_a_violation() -> None:
    report = check(
        [
            ev("enter", "a", token=1),
            ev("enter", "b", token=2),
            ev("exit", "b", token=2, outcome="ok"),
            ev("exit", "a", token=1, outcome="ok"),
        ]
    )
    assert report.violations == 1 and report.revoked_overlaps == 0 and not report.ok
    (overlap,) = report.overlaps
    assert (overlap.position, overlap.entering, overlap.inside) == (1, "b#2", ("a#1",))
    assert "violations=1" in report.report_line()
    assert any("b#2 (exclusive) entered k while a#1 held it" in x for x in report.summary_lines())


def test_shared_readers_may_overlap_each_other() -> None:
    events = [
        ev("enter", "r1", "shared", 1),
        ev("enter", "r2", "shared", 2),
        ev("enter", "r3", "shared", 3),
        ev("exit", "r1", "shared", 1, outcome="ok"),
        ev("exit", "r3", "shared", 3, outcome="ok"),
        ev("exit", "r2", "shared", 2, outcome="ok"),
        *section("w", 4, at=1.0),  # a writer after all readers left
    ]
    report = check(events)
    assert report.ok and report.overlaps == ()


def test_a_writer_entering_while_readers_are_inside_is_a_violation() -> None:
    events = [
        ev("enter", "r1", "shared", 1),
        ev("enter", "r2", "shared", 2),
        ev("exit", "r1", "shared", 1, outcome="ok"),
        ev("enter", "w", "exclusive", 3),  # r2 is still inside
        ev("exit", "r2", "shared", 2, outcome="ok"),
        ev("exit", "w", "exclusive", 3, outcome="ok"),
    ]
    report = check(events)
    assert report.violations == 1
    (overlap,) = report.overlaps
    assert (overlap.entering, overlap.entering_mode, overlap.inside) == (
        "w#3",
        "exclusive",
        ("r2#2",),
    )


def test_a_reader_entering_while_a_writer_is_inside_is_a_violation() -> None:
    events = [ev("enter", "w", "exclusive", 1), ev("enter", "r", "shared", 2)]
    report = check(events)
    assert report.violations == 1 and report.overlaps[0].entering_mode == "shared"
    assert report.open_sections == 2


def test_sections_of_different_keys_do_not_conflict() -> None:
    report = check([ev("enter", "a", token=1), ev("enter", "b", token=2, key="other")])
    assert report.violations == 0 and report.open_sections == 2


# ------------------------------------------------------------------------- revoked holders


def test_a_holder_found_dead_late_overlapped_by_its_successor_is_a_revoked_overlap() -> None:
    # a's worker died on its own; its session expired, b was granted, and only then did the
    # injector find the worker dead: the death came at an unknown point before its record.
    events = [
        ev("enter", "a", token=1, hostname=HOST, pid=41),
        ev("enter", "b", token=2, hostname=HOST, pid=42),
        killed(pid=41, late=True),
        ev("exit", "b", token=2, outcome="ok", hostname=HOST, pid=42),
    ]
    report = check(
        events, outcomes={"a": TaskOutcome("a", "PENDING"), "b": TaskOutcome("b", "SUCCESS")}
    )
    assert (report.violations, report.revoked_overlaps) == (0, 1)
    assert report.killed_sections == 1 and report.open_sections == 0
    assert report.lost == 1 and report.lost_task_ids == ("a",)  # its message was never finished


def test_an_overlap_recorded_before_an_injected_kill_is_a_violation() -> None:
    # An injected kill is recorded within milliseconds of the SIGKILL: b entered while a was
    # alive and its lease valid. The kill that came later does not excuse it.
    events = [
        ev("enter", "a", token=1, hostname=HOST, pid=41),
        ev("enter", "b", token=2, hostname=HOST, pid=42),
        ev("exit", "b", token=2, outcome="ok", hostname=HOST, pid=42),
        killed(pid=41),
    ]
    report = check(events, outcomes={"a": TaskOutcome("a", "PENDING")})
    assert (report.violations, report.revoked_overlaps) == (1, 0) and not report.ok
    assert report.overlaps[0].inside == ("a#1",) and report.killed_sections == 1
    # The legitimate hand-over: the kill, then the successor (no overlap at all).
    after = [events[0], events[3], *events[1:3]]
    assert check(after, outcomes={"a": TaskOutcome("a", "PENDING")}).overlaps == ()


def test_a_kill_closes_only_its_own_process_sections() -> None:
    events = [
        ev("enter", "a", token=1, hostname=HOST, pid=41),
        ev("enter", "x", token=5, key="other", hostname=HOST, pid=43),
        killed(pid=41),
        ev("enter", "b", token=2, hostname=HOST, pid=42),  # after the kill: no overlap at all
        ev("enter", "y", token=6, key="other", hostname=HOST, pid=44),  # x still inside
    ]
    report = check(events)
    assert report.revoked_overlaps == 0 and report.violations == 1
    assert report.overlaps[0].entering == "y#6"
    assert report.killed_sections == 1


def test_an_overlap_with_a_holder_that_lost_its_lease_is_revoked() -> None:
    events = [
        ev("enter", "a", token=1),
        forced("paused"),  # a's process stopped past its session timeout
        ev("enter", "b", token=2, time=4.5),
        ev("write", "b", token=2, accepted=True),
        ev("write", "a", token=1, accepted=False, previous_token=2),  # the fence refuses a
        ev("exit", "a", token=1, outcome="lost"),
        ev("exit", "b", token=2, outcome="ok"),
    ]
    lost = TaskOutcome("a", "FAILURE", reason="LockLost: lock /zklock/k lost (token 1)")
    report = check(events, outcomes={"a": lost})
    assert (report.violations, report.revoked_overlaps, report.revocations) == (0, 1, 1)
    assert report.failure_reasons == {"LockLost": 1}
    assert (report.writes_accepted, report.writes_refused, report.stale_writes_accepted) == (
        1,
        1,
        0,
    )
    assert report.ok


def test_a_loss_noticed_only_at_release_makes_the_overlap_revoked() -> None:
    # a's body finished before its client saw the expiry; its task still ended LockLost.
    events = [
        ev("enter", "a", token=1),
        forced("expired"),
        ev("enter", "b", token=2),
        ev("exit", "a", token=1, outcome="ok"),
        ev("exit", "b", token=2, outcome="ok"),
    ]
    lost = TaskOutcome("a", "FAILURE", reason="LockLost: the session expired before release")
    assert check(events, outcomes={"a": lost}).revoked_overlaps == 1
    # the same history whose task a failed for another reason is a violation
    other = TaskOutcome("a", "FAILURE", reason="ValueError: boom")
    assert check(events, outcomes={"a": other}).violations == 1


def test_a_holder_that_learned_of_its_loss_only_after_its_successor_entered_is_a_violation() -> (
    None
):
    # A silent partition: a's process ran on, its session expired on the server, b was granted,
    # and a's body saw LockLost only later. No fault took a's lease away behind its back.
    events = [
        ev("enter", "a", token=1),
        ev("enter", "b", token=2),
        ev("exit", "a", token=1, outcome="lost"),
        ev("exit", "b", token=2, outcome="ok"),
    ]
    lost = TaskOutcome("a", "FAILURE", reason="LockLost: lock lost")
    report = check(events, outcomes={"a": lost})
    assert (report.violations, report.revoked_overlaps) == (1, 0) and not report.ok
    # A pause or an expiry recorded only after b entered does not excuse it either.
    late = [*events[:2], forced("paused"), *events[2:]]
    assert check(late, outcomes={"a": lost}).violations == 1
    # Nor one of another process.
    other = [events[0], forced("expired", pid=99), *events[1:]]
    assert check(other, outcomes={"a": lost}).violations == 1


def test_a_pause_excuses_only_a_successor_entering_once_the_session_can_have_expired() -> None:
    # The paused event is stamped before the SIGSTOP; ZooKeeper cannot expire the session
    # before about 2/3 of the timeout (4 s) has passed: a successor 0.1 s in is a lock fault.
    def history(enter_at: float, *extra: SectionEvent) -> list[SectionEvent]:
        return [
            ev("enter", "a", token=1, time=0.0),
            forced("paused", at=0.1),
            *extra,
            ev("enter", "b", token=2, time=enter_at),
            ev("exit", "b", token=2, outcome="ok", time=enter_at + 0.2),
            ev("exit", "a", token=1, outcome="lost", time=5.0),
        ]

    lost = {"a": TaskOutcome("a", "FAILURE", reason="LockLost: lost")}
    early = check(history(0.2), outcomes=lost)
    assert (early.violations, early.revoked_overlaps) == (1, 0) and not early.ok
    late = check(history(2.2), outcomes=lost)  # past half the timeout: may be legitimate
    assert (late.violations, late.revoked_overlaps) == (0, 1) and late.ok
    # A pause recorded without the session timeout cannot tell: it excuses nothing.
    unknown = [forced("paused", at=0.1, timeout=None) if e.kind == "paused" else e for e in
               history(4.0)]  # fmt: skip
    assert check(unknown, outcomes=lost).violations == 1
    # A pause the session survived (resumed before the expiry) excuses nothing either.
    survived = history(4.0)
    survived.insert(4, forced("survived"))
    assert check(survived, outcomes=lost).violations == 1


def test_a_pause_that_carries_the_holders_lease_validity_is_judged_by_it() -> None:
    # A holder that stopped itself knows until when its lease clock held the lock. A server or a
    # renewer that fell behind just before the stop brings the legitimate expiry closer than
    # half the timeout (a CI run saw it), and the validity still says where the fault line is.
    def history(enter_at: float) -> list[SectionEvent]:
        return [
            ev("enter", "a", token=1, time=0.0),
            forced("paused", at=1.0, valid_until=1.8),
            ev("enter", "b", token=2, time=enter_at),
            ev("exit", "b", token=2, outcome="ok", time=enter_at + 0.2),
            ev("exit", "a", token=1, outcome="lost", time=5.0),
        ]

    lost = {"a": TaskOutcome("a", "FAILURE", reason="LockLost: lost")}
    soon = check(history(2.0), outcomes=lost)  # before half the 4 s timeout, past the validity
    assert (soon.violations, soon.revoked_overlaps) == (0, 1) and soon.ok
    inside = check(history(1.7), outcomes=lost)  # the holder's lease still held it
    assert (inside.violations, inside.revoked_overlaps) == (1, 0) and not inside.ok


def test_an_expiry_whose_call_failed_excuses_nothing() -> None:
    events = [
        ev("enter", "a", token=1),
        forced("expired"),  # recorded before the call closes the session
        forced("survived"),  # the call failed and the node was still there
        ev("enter", "b", token=2),
        ev("exit", "a", token=1, outcome="lost"),
        ev("exit", "b", token=2, outcome="ok"),
    ]
    lost = {"a": TaskOutcome("a", "FAILURE", reason="LockLost: lost")}
    assert check(events, outcomes=lost).violations == 1
    # Without the withdrawal, the same hand-over is a revoked overlap.
    succeeded = [e for e in events if e.kind != "survived"]
    assert check(succeeded, outcomes=lost).revoked_overlaps == 1
    # A withdrawal withdraws only the forced losses recorded before it.
    again = [events[0], forced("survived"), forced("expired"), *events[3:]]
    assert check(again, outcomes=lost).revoked_overlaps == 1


def test_a_forced_loss_excuses_only_a_holder_that_ended_with_its_lock_lost() -> None:
    events = [
        ev("enter", "a", token=1),
        forced("expired"),
        ev("enter", "b", token=2),
        ev("exit", "a", token=1, outcome="ok"),
        ev("exit", "b", token=2, outcome="ok"),
    ]
    assert check(events).violations == 1  # a ended SUCCESS: it never knew


def test_an_earlier_attempt_does_not_borrow_the_last_attempts_loss() -> None:
    # Task a entered twice; only its last section is the one its final LockLost speaks for.
    events = [
        ev("enter", "a", token=1),
        ev("enter", "b", token=2),  # overlaps a's first, valid attempt
        ev("exit", "a", token=1, outcome="ok"),
        ev("exit", "b", token=2, outcome="ok"),
        *section("a", 3, at=5.0),
    ]
    lost = TaskOutcome("a", "FAILURE", reason="LockLost: lost")
    report = check(events, outcomes={"a": lost})
    assert report.violations == 1 and report.retried == 1 and report.attempts["a"] == 2


# -------------------------------------------------------------------------------- fencing


def test_a_write_accepted_below_the_fences_last_token_is_stale() -> None:
    events = [ev("write", "a", token=5, accepted=True, previous_token=7)]
    report = check(events)
    assert report.stale_writes_accepted == 1 and not report.ok
    assert report.stale_writes[0].task_id == "a"


def test_a_write_accepted_below_an_earlier_recorded_write_is_stale() -> None:
    # The fence forgot key k (Redis lost its data): a's write reports no previous token, but
    # b's write of token 9 was recorded before a even entered.
    events = [
        *section("b", 9),
        ev("enter", "a", token=5, time=1.0),
        ev("write", "a", token=5, accepted=True, previous_token=None),
        ev("exit", "a", token=5, outcome="ok", time=1.2),
    ]
    report = check(events)
    assert report.stale_writes_accepted == 1 and report.violations == 0
    assert "stale_writes_accepted=1" in report.report_line()


def test_a_write_accepted_below_a_write_recorded_before_it_was_sent_is_stale() -> None:
    # a (token 10) entered first and was paused before its write; b (token 20) entered, wrote
    # and was accepted. a resumes: its `writing` record comes after b's accepted write, so b's
    # write reached the fence first, and the fence accepting token 10 while reporting no
    # previous token (a fence that forgot k) must not be taken at its word.
    events = [
        ev("enter", "a", token=10, time=0.0),
        forced("paused", at=0.1),
        ev("enter", "b", token=20, time=3.0),
        ev("writing", "b", token=20, time=3.1),
        ev("write", "b", token=20, accepted=True, previous_token=None, time=3.1),
        ev("exit", "b", token=20, outcome="ok", time=3.2),
        ev("writing", "a", token=10, time=5.0),
        ev("write", "a", token=10, accepted=True, previous_token=None, time=5.0),
        ev("exit", "a", token=10, outcome="ok", time=5.1),
    ]
    # a's release then found its lease gone: b's entry is a revoked overlap, not a violation.
    outcomes = {"a": TaskOutcome("a", "FAILURE", reason="LockLost: lost")}
    report = check(events, outcomes=outcomes)
    assert report.violations == 0 and report.revoked_overlaps == 1
    assert report.stale_writes_accepted == 1 and not report.ok
    assert [e.holder for e in report.stale_writes] == ["a#10"]
    # Without the `writing` records (older histories) the checker can only go by the writes
    # recorded before a entered, and there were none: as before, it is not flagged.
    old = check([e for e in events if e.kind != "writing"], outcomes=outcomes)
    assert old.stale_writes_accepted == 0 and old.ok


def test_concurrent_readers_writing_out_of_record_order_are_not_stale() -> None:
    # r1 announced its write before r2's accepted write was recorded: the fence may have taken
    # r1's first (it did: it reports no previous token), so r1's lower token is no evidence.
    events = [
        ev("enter", "r1", "shared", 5),
        ev("enter", "r2", "shared", 6),
        ev("writing", "r1", "shared", 5),
        ev("writing", "r2", "shared", 6),
        ev("write", "r2", "shared", 6, accepted=True, previous_token=5),
        ev("write", "r1", "shared", 5, accepted=True, previous_token=None),
        ev("exit", "r1", "shared", 5, outcome="ok"),
        ev("exit", "r2", "shared", 6, outcome="ok"),
    ]
    report = check(events)
    assert report.stale_writes_accepted == 0 and report.ok and report.writes_accepted == 2


def test_concurrent_readers_recording_writes_out_of_fence_order_are_not_stale() -> None:
    # The fence took r1's write (token 5) then r2's (token 6); r2 recorded first.
    events = [
        ev("enter", "r1", "shared", 5),
        ev("enter", "r2", "shared", 6),
        ev("write", "r2", "shared", 6, accepted=True, previous_token=5),
        ev("write", "r1", "shared", 5, accepted=True, previous_token=None),
        ev("exit", "r1", "shared", 5, outcome="ok"),
        ev("exit", "r2", "shared", 6, outcome="ok"),
    ]
    report = check(events)
    assert report.stale_writes_accepted == 0 and report.ok


# ----------------------------------------------------------------------------- accounting


def test_every_task_is_counted_exactly_once() -> None:
    events = [
        ev("enter", "ran", token=1, time=10.5),
        ev("exit", "ran", token=1, time=11.0, outcome="ok"),
        ev("enter", "failed", token=2, time=11.5),
        ev("exit", "failed", token=2, time=11.75, outcome="error:ValueError"),
        ev("enter", "retried", token=3, time=12.0),
        ev("exit", "retried", token=3, time=12.5, outcome="lost"),
        ev("enter", "retried", token=4, time=13.0),
        ev("exit", "retried", token=4, time=13.25, outcome="ok"),
    ]
    outcomes = {
        "ran": TaskOutcome("ran", "SUCCESS"),
        "skip": TaskOutcome("skip", "SUCCESS", skipped=True),
        "failed": TaskOutcome("failed", "FAILURE", reason="ValueError: boom"),
        "revoked": TaskOutcome("revoked", "REVOKED"),
        "retried": TaskOutcome("retried", "SUCCESS"),
        "started": TaskOutcome("started", "STARTED"),
        "retrying": TaskOutcome("retrying", "RETRY"),
    }
    submitted = {t: 10.0 for t in [*outcomes, "vanished"]}
    report = check_run(
        submitted=submitted, outcomes=outcomes, events=events, faults=(), leftover_nodes=2
    )
    assert (report.tasks, report.ran, report.skipped, report.failed, report.lost) == (8, 2, 1, 2, 3)
    assert report.ran + report.skipped + report.failed + report.lost == report.tasks
    assert set(report.lost_task_ids) == {"started", "retrying", "vanished"}
    assert report.failure_reasons == {"ValueError": 1, "REVOKED": 1}
    assert report.failure_examples["ValueError"] == "ValueError: boom"
    assert (report.retried, report.revocations) == (1, 1)
    assert sorted(report.wait_seconds) == pytest.approx([0.5, 1.5, 2.0])
    assert sorted(report.hold_seconds) == pytest.approx([0.25, 0.25, 0.5, 0.5])
    assert report.throughput == (0, 2, 1, 1)  # exits at +1.0, +1.75, +2.5, +3.25 s
    assert not report.ok  # lost tasks and leftover nodes
    assert report.report_line() == (
        "zklock-report: tasks=8 ran=2 skipped=1 failed=2 lost=3 violations=0 "
        "stale_writes_accepted=0 leftover_nodes=2 broker_dropped=0 rate_violations=0 "
        "duplicate_completions=0"
    )


def test_what_went_unchecked_fails_the_verdict_and_shows_in_the_report_line() -> None:
    clean = [*section("a", 1)]
    # b ran (SUCCESS) without any record: nothing of it was compared with anyone.
    report = check(clean, outcomes={"b": TaskOutcome("b", "SUCCESS")})
    assert (report.ran, report.ran_without_section, report.unchecked) == (2, 1, 1)
    assert not report.ok
    assert report.report_line().endswith(
        "duplicate_completions=0 ran_without_section=1 unexplained_open_sections=0 malformed=0 "
        "admissions_unread=0"
    )
    assert report.to_json()["unchecked"] == 1
    # c ended SUCCESS but its section never exited: its end went unchecked.
    report = check([*clean, ev("enter", "c", token=2, time=1.0)])
    assert (report.open_sections, report.unexplained_open_sections) == (1, 1) and not report.ok
    assert "unexplained_open_sections=1" in report.report_line()
    # An exit without an enter contradicts the protocol.
    report = check([*clean, ev("exit", "d", token=3, outcome="ok")])
    assert len(report.malformed) == 1 and not report.ok
    assert "malformed=1 " in report.report_line()
    # An open section of a task without a final state is what ``lost`` reports; a section
    # closed by its process's kill is not open: neither is unchecked.
    killed_then_redone = [
        ev("enter", "e", token=4, hostname=HOST, pid=41),
        killed(pid=41),
        ev("enter", "e", token=5, hostname=HOST, pid=42),
        ev("exit", "e", token=5, outcome="ok", hostname=HOST, pid=42),
    ]
    report = check([*clean, *killed_then_redone])
    assert report.unchecked == 0 and report.ok and report.killed_sections == 1
    assert "ran_without_section" not in report.report_line()  # a clean line keeps its form
    report = check([*clean, ev("enter", "f", token=6)], outcomes={"f": TaskOutcome("f", "STARTED")})
    assert (report.open_sections, report.unchecked, report.lost) == (1, 0, 1)


def test_a_task_the_broker_dropped_counts_apart_only_when_the_broker_was_restarted() -> None:
    events = [ev("enter", "ran", token=1, time=1.0), ev("exit", "ran", token=1, time=1.5)]
    submitted = {"ran": 0.0, "dropped": 0.5, "started": 0.6}
    outcomes = {"ran": TaskOutcome("ran", "SUCCESS")}
    restart = FaultRecord("broker_restart", 0.7, "broker Redis", True, "SIGKILL and restart")

    def run(faults: Sequence[FaultRecord]) -> RunReport:
        return check_run(
            submitted=submitted,
            outcomes=outcomes,
            events=events,
            faults=faults,
            leftover_nodes=0,
            never_delivered={"dropped"},
        )

    restarted = run([restart])
    assert restarted.lost_task_ids == ("started",)
    assert restarted.broker_dropped_task_ids == ("dropped",) and restarted.broker_dropped == 1
    assert restarted.report_line().endswith("lost=1 violations=0 stale_writes_accepted=0 "
                                            "leftover_nodes=0 broker_dropped=1 rate_violations=0 "
                                            "duplicate_completions=0")  # fmt: skip
    assert "dropped by the broker across its restarts" in "\n".join(restarted.summary_lines())
    assert restarted.to_json()["broker_dropped"] == 1
    # Without a broker restart nothing excuses a vanished message: it is lost.
    for faults in (
        [],
        [FaultRecord("broker_restart", 0.7, "broker Redis", False, "no permission")],
    ):
        calm = run(faults)
        assert calm.lost_task_ids == ("dropped", "started") and calm.broker_dropped == 0


def test_only_a_task_submitted_before_a_broker_restart_ended_counts_as_dropped() -> None:
    # The restart ran from t=100 to t=100.5; "during" was submitted while it ran, "after" 30 s
    # after it was over: nothing of that restart can have dropped "after"'s message.
    events = [ev("enter", "ran", token=1, time=1.0), ev("exit", "ran", token=1, time=1.5)]
    submitted = {"ran": 0.0, "before": 50.0, "during": 100.3, "after": 130.0}
    gone = {"before", "during", "after"}

    def run(restart: FaultRecord) -> RunReport:
        return check_run(
            submitted=submitted,
            outcomes={"ran": TaskOutcome("ran", "SUCCESS")},
            events=events,
            faults=[restart],
            leftover_nodes=0,
            never_delivered=gone,
        )

    restart = FaultRecord("broker_restart", 100.0, "broker", True, "down 0.50 s", ended=100.5)
    report = run(restart)
    assert report.broker_dropped_task_ids == ("before", "during")
    assert report.lost_task_ids == ("after",) and report.lost == 1 and not report.ok
    # A record without ``ended`` (older runs) ends at its start plus the downtime it states.
    old = run(FaultRecord("broker_restart", 100.0, "broker", True, "SIGKILL; down 0.20 s"))
    assert old.broker_dropped_task_ids == ("before",)
    assert old.lost_task_ids == ("during", "after")
    # ``ended`` survives the round trip through Redis's JSON, and is left out when unset.
    assert FaultRecord.from_json(restart.to_json()) == restart
    assert "ended" not in FaultRecord("kill", 1.0, "w", True, "SIGKILL").to_json()


def test_a_message_no_worker_received_counts_as_dropped_only_across_a_consumers_death() -> None:
    # kombu's Redis transport pops a message, then records it as delivered: a worker killed as
    # a whole between the two loses it. One a worker received (its log says so) and that is
    # gone was lost by the worker, the gate's failure to catch: lost whatever the faults.
    events = [ev("enter", "ran", token=1, time=1.0), ev("exit", "ran", token=1, time=1.5)]
    submitted = {"ran": 0.0, "popped": 5.0, "received": 5.0, "later": 20.0}
    gone = {"popped", "received", "later"}

    def run(fault: FaultRecord) -> RunReport:
        return check_run(
            submitted=submitted,
            outcomes={"ran": TaskOutcome("ran", "SUCCESS")},
            events=events,
            faults=[fault],
            leftover_nodes=0,
            never_delivered=gone,
            never_received={"popped", "later"},
        )

    for fault in (
        FaultRecord("kill_held", 10.0, "w1", True, f"{MAIN_PROCESS_KILL} and pool (3 processes)"),
        FaultRecord("kill", 10.0, "w1 main process", True, f"{MAIN_PROCESS_KILL}; restarted"),
    ):
        report = run(fault)
        assert report.broker_dropped_task_ids == ("popped",), fault
        assert report.lost_task_ids == ("received", "later")
    # A pool process killed, or a whole worker not killed after all: nothing excuses it.
    for fault in (
        FaultRecord("kill", 10.0, "w1 pool process", True, "SIGKILL of a pool process"),
        FaultRecord("kill_held", 10.0, "", False, "the gate held none"),
    ):
        assert run(fault).lost_task_ids == ("popped", "received", "later"), fault


def test_a_message_a_worker_received_is_lost_whatever_broker_restart_came_before() -> None:
    # Both submitted before a broker restart ended, both never started and gone; "received" was
    # then received by a worker (its log says so, after the restart: kombu recorded it as
    # delivered, on a broker that keeps what it acknowledged), so the restart did not drop it:
    # the worker lost it. Without worker logs (an external fleet) nothing tells them apart.
    events = [ev("enter", "ran", token=1, time=1.0), ev("exit", "ran", token=1, time=1.5)]
    submitted = {"ran": 0.0, "popped": 5.0, "received": 5.0}
    restart = FaultRecord("broker_restart", 6.0, "broker", True, "down 0.1 s", ended=6.1)

    def run(never_received: set[str] | None) -> RunReport:
        return check_run(
            submitted=submitted,
            outcomes={"ran": TaskOutcome("ran", "SUCCESS")},
            events=events,
            faults=[restart],
            leftover_nodes=0,
            never_delivered={"popped", "received"},
            never_received=never_received,
        )

    report = run({"popped"})
    assert report.broker_dropped_task_ids == ("popped",)
    assert report.lost_task_ids == ("received",) and not report.ok
    unknown = run(None)
    assert unknown.broker_dropped_task_ids == ("popped", "received") and unknown.lost == 0


def test_a_message_sent_again_is_judged_by_its_last_copy() -> None:
    # Both tasks were submitted at t=5 and received; each was then sent to the broker again (a
    # retry, a send-back, a give-back) and not received since. "retried" was sent again at
    # t=9, before the broker restart ended (t=10.1): its copy may have been popped by a worker
    # whose connection the restart cut; "late" at t=30, long after it: the restart cannot
    # have dropped that copy, so it is lost.
    events = [ev("enter", "ran", token=1, time=1.0), ev("exit", "ran", token=1, time=1.5)]
    submitted = {"ran": 0.0, "retried": 5.0, "late": 5.0}
    restart = FaultRecord("broker_restart", 10.0, "broker", True, "down 0.1 s", ended=10.1)
    report = check_run(
        submitted=submitted,
        outcomes={"ran": TaskOutcome("ran", "SUCCESS")},
        events=events,
        faults=[restart],
        leftover_nodes=0,
        never_delivered={"retried", "late"},
        never_received={"retried", "late"},
        resent={"retried": 9.0, "late": 30.0},
    )
    assert report.broker_dropped_task_ids == ("retried",)
    assert report.lost_task_ids == ("late",) and not report.ok


def test_unrelated_tasks_count_as_tasks_and_report_their_latency() -> None:
    events = section("a", 1)
    submitted = {"a": 0.0, **{f"u{i}": float(i) for i in range(100)}}
    unrelated = {f"u{i}" for i in range(100)}
    outcomes = {t: TaskOutcome(t, "SUCCESS") for t in submitted if t != "u99"}
    done_at = {f"u{i}": i + 0.01 * (i + 1) for i in range(100)} | {"a": 9.0}
    report = check_run(
        submitted=submitted,
        outcomes=outcomes,
        events=events,
        faults=[],
        leftover_nodes=0,
        unrelated=unrelated,
        done_at=done_at,
        gate=False,
        gate_held_max=0,
    )
    # No section of their own, and none missing: u99 (no result) is lost, the others ran.
    assert (report.tasks, report.ran, report.lost, report.unrelated) == (101, 100, 1, 100)
    assert report.ran_without_section == 0 and report.lost_task_ids == ("u99",)
    assert sorted(report.unrelated_latency_seconds) == pytest.approx(
        [0.01 * (i + 1) for i in range(99)]
    )
    line = next(x for x in report.summary_lines() if x.startswith("unrelated tasks"))
    assert "p50 0.500 s, p95 0.950 s, p99 0.990 s" in line and "(gate off, at most 0 held" in line
    assert min(report.to_json()["unrelated_latency_seconds"]) == pytest.approx(0.01)


def test_faults_are_counted_by_kind_and_tied_to_what_followed() -> None:
    faults = [
        FaultRecord("pause", 10.0, "w1 pid 41", True, "SIGSTOP 12 s"),
        FaultRecord("kill", 20.0, "w1 pid 42", True, "SIGKILL"),
        FaultRecord("leader", 25.0, "zk2", False, "no leader found"),
        FaultRecord("kill", 30.0, "w1 pid 43", True, "SIGKILL"),
    ]
    events = [
        ev("enter", "a", token=1, hostname=HOST, pid=41, time=9.0),
        forced("paused", pid=41, hostname=HOST),
        ev("enter", "b", token=2, hostname=HOST, pid=42, time=15.0),  # a lost its session
        ev("exit", "a", token=1, outcome="lost", hostname=HOST, pid=41, time=16.0),
        killed(pid=42, at=20.0),
        ev("enter", "c", token=3, hostname=HOST, pid=43, time=29.0),
        killed(pid=43, at=30.0),
    ]
    lost = TaskOutcome("a", "FAILURE", reason="LockLost: x")
    report = check(events, outcomes={"a": lost}, faults=faults)
    assert report.faults_by_kind == {
        "pause": FaultCount(1, 0),
        "kill": FaultCount(2, 0),
        "leader": FaultCount(0, 1),
    }
    pause, kill_b, kill_c = report.fault_impacts  # the fault that could not run has no impact
    assert report.faults_not_run == (faults[2],)  # ... but is kept, with why
    assert (pause.lost_sections, pause.revoked_overlaps, pause.killed_sections) == (1, 1, 0)
    assert (kill_b.killed_sections, kill_c.killed_sections) == (1, 1)
    assert report.violations == 0 and report.killed_sections == 2
    text = "\n".join(report.summary_lines())
    assert "kill 2, leader 0 (1 could not run), pause 1" in text
    assert "pause w1 pid 41: SIGSTOP 12 s; until the next fault: 1 sections lost their lock" in text
    assert "leader NOT RUN: no leader found" in text
    assert report.to_json()["faults_not_run"][0]["detail"] == "no leader found"


def test_each_fault_says_which_tasks_failed_until_the_next_one() -> None:
    faults = [
        FaultRecord("quorum_loss", 10.0, "ZooKeeper members 1, 2 of 3", True, "kept down 7 s"),
        FaultRecord("kill", 30.0, "w1 pid 42", True, "SIGKILL"),
    ]
    failed = {
        "u1": TaskOutcome("u1", "FAILURE", reason="ZooKeeperUnavailable: no connection"),
        "u2": TaskOutcome("u2", "FAILURE", reason="ZooKeeperUnavailable: no connection"),
        "t1": TaskOutcome("t1", "FAILURE", reason="LockTimeout: 12 s"),
        "early": TaskOutcome("early", "FAILURE", reason="LockTimeout: 12 s"),
        "ok": TaskOutcome("ok", "SUCCESS"),
    }
    report = check_run(
        submitted=dict.fromkeys(failed, 0.0),
        outcomes=failed,
        events=[],
        faults=faults,
        leftover_nodes=0,
        unrelated=set(failed),
        done_at={"u1": 12.0, "u2": 29.9, "t1": 31.0, "early": 5.0, "ok": 11.0},
    )
    quorum, kill = report.fault_impacts
    assert quorum.failures == {"ZooKeeperUnavailable": 2}
    assert kill.failures == {"LockTimeout": 1}  # the one before any fault is no fault's
    assert report.lost == 0 and report.failed == 4  # failed, not lost: the verdict is unchanged
    text = "\n".join(report.summary_lines())
    assert "writes refused, tasks failed: ZooKeeperUnavailable x2" in text, text
    assert report.to_json()["fault_impacts"][0]["failures"] == {"ZooKeeperUnavailable": 2}
    # Without the results' times no failure is placed.
    assert check(events=[], outcomes=failed, faults=faults).fault_impacts[0].failures == {}


def test_the_json_form_is_json_safe_and_complete() -> None:
    report = check(
        [*section("a", 1), ev("enter", "b", token=2), ev("enter", "c", token=3)],
        faults=[FaultRecord("expire", 1.0, "w1", True, "session expired")],
    )
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["report_line"] == report.report_line() and data["ok"] is False
    assert data["overlaps"][0]["inside"] == ["b#2"]
    assert data["faults_by_kind"] == {"expire": [1, 0]}
    assert data["fault_impacts"][0]["fault"]["kind"] == "expire"


def test_task_outcome_from_celery_results() -> None:
    skipped = {"__zklock_skipped__": True, "reason": "busy", "lock": "/zklock/x", "holder": "t1"}
    assert TaskOutcome.from_result("t", "SUCCESS", skipped) == TaskOutcome(
        "t", "SUCCESS", True, skip_reason="busy", skipped_for="t1"
    )
    assert TaskOutcome.from_result("t", "SUCCESS", {"token": 1}) == TaskOutcome("t", "SUCCESS")
    assert TaskOutcome.from_result("t", "FAILURE", LockLost("gone")).reason == "LockLost: gone"
    assert TaskOutcome.from_result("t", "PENDING", None) == TaskOutcome("t", "PENDING")


# ------------------------------------------------------------------- superseded calls


def superseded(task: str, reason: str, by: str) -> TaskOutcome:
    """The final state of a call a newer one superseded: a skip of ``reason`` naming ``by``."""
    return TaskOutcome(task, "SUCCESS", skipped=True, skip_reason=reason, skipped_for=by)


def test_superseded_calls_that_never_entered_are_counted_and_pass() -> None:
    """A burst of three debounced calls (the last ran) and of three ``replace`` calls (the
    first held, the third waited and ran): the others are counted by their skip's reason."""
    events = [*section("d3", 1), *section("r1", 2, at=1.0), *section("r3", 3, at=2.0)]
    outcomes = {
        "d1": superseded("d1", "debounced", "d2"),
        "d2": superseded("d2", "debounced", "d3"),
        "r2": superseded("r2", "replaced", "r3"),
        "b": TaskOutcome("b", "SUCCESS", skipped=True, skip_reason="busy", skipped_for="r1"),
    }
    report = check(events, outcomes=outcomes)
    assert report.ok and report.violations == 0 and report.superseded_ran == ()
    assert (report.ran, report.skipped, report.superseded) == (3, 4, 3)
    assert report.skip_reasons == {"debounced": 2, "replaced": 1, "busy": 1}
    summary = "\n".join(report.summary_lines())
    assert "superseded calls: 2 debounced, 1 replaced" in summary and "0 violations" in summary


def test_a_call_both_replaced_and_run_is_a_violation() -> None:
    """Its section entered (and exited, or is still open): the skip says a newer call ran
    instead, and yet its body ran. A violation, named in the summary, failing the verdict."""
    for tail in (
        [ev("exit", "r2", token=2, time=1.2, outcome="ok")],  # ran to its end
        [],  # never exited
    ):
        # r3 ran first (this rule is about the skip, not the order); r2 then entered after it
        # and overlaps nothing, so the one violation is the superseded rule's.
        events = [*section("r1", 1), *section("r3", 3, at=0.5),
                  ev("enter", "r2", token=2, time=1.0), *tail]  # fmt: skip
        report = check(events, outcomes={"r2": superseded("r2", "replaced", "r3")})
        assert report.violations == 1 and report.superseded_violations == 1, report.superseded_ran
        assert report.exclusion_violations == 0 and not report.ok
        (problem,) = report.superseded_ran
        assert problem.startswith("task r2 (replaced by r3) entered its section r2#2 on k")
        assert "violations=1 " in report.report_line()
        assert f"  superseded violation: {problem}" in report.summary_lines()
        assert report.to_json()["superseded_violations"] == 1


def test_a_debounced_call_that_ran_is_a_violation_and_one_killed_mid_body_is_not() -> None:
    """A body whose process a fault killed is Celery's at-least-once: its next copy may be
    superseded without the call having run. One that exited (even with its lock lost) ran."""
    killed_body = [ev("enter", "d1", token=1, hostname=HOST, pid=41), killed(pid=41, at=0.5)]
    report = check([*killed_body, *section("d2", 2, at=1.0)],
                   outcomes={"d1": superseded("d1", "debounced", "d2")})  # fmt: skip
    assert report.ok and report.superseded_ran == () and report.killed_sections == 1
    lost_body = [ev("enter", "d1", token=1), ev("exit", "d1", token=1, outcome="lost")]
    report = check([*lost_body, *section("d2", 2, at=1.0)],
                   outcomes={"d1": superseded("d1", "debounced", "d2")})  # fmt: skip
    assert report.superseded_violations == 1 and not report.ok
    assert "(exit lost)" in report.superseded_ran[0]


def test_a_superseded_call_must_name_another_call_of_the_run() -> None:
    events = [*section("d2", 1)]
    for named in ("elsewhere", "d1", None):
        report = check(events, outcomes={"d1": superseded("d1", "debounced", named)})  # type: ignore[arg-type]
        assert report.superseded_ran == (f"task d1 (debounced by {named}) names no other call "
                                         "of the run",), named  # fmt: skip
        assert not report.ok


def test_skip_reasons_and_named_calls_are_read_from_stored_results() -> None:
    replaced = {"__zklock_skipped__": True, "reason": "replaced", "lock": "/l", "holder": "t9"}
    assert TaskOutcome.from_result("t", "SUCCESS", replaced) == superseded("t", "replaced", "t9")
    # A skip stored by an older version without a reason still counts as skipped.
    bare = {"__zklock_skipped__": True}
    assert TaskOutcome.from_result("t", "SUCCESS", bare) == TaskOutcome("t", "SUCCESS", True)
    report = check([], outcomes={"t": TaskOutcome("t", "SUCCESS", True)})
    assert report.skip_reasons == {"?": 1} and report.ok


# ------------------------------------------------------------------------- recorded in Redis


@pytest.fixture
def run_id(redis_client: redis.Redis) -> Iterator[str]:
    run = f"test-{uuid.uuid4().hex}"
    yield run
    SectionRecorder(redis_client, run).clear()
    FaultLog(redis_client, run).clear()
    RedisFence(redis_client, fence_namespace(run)).clear()


def test_a_history_recorded_in_redis_reads_back_and_checks(
    redis_client: redis.Redis, run_id: str
) -> None:
    recorder, log = SectionRecorder(redis_client, run_id), FaultLog(redis_client, run_id)
    written = [
        ev("enter", "a", token=1, hostname=HOST, pid=41, time=1.0),
        ev("enter", "b", token=2, hostname=HOST, pid=42, time=2.0),
    ]
    for event in written:
        recorder.record(event)
    recorder.record_kill(HOST, 41, 2.5, late=True)  # found dead after b entered
    recorder.record(ev("exit", "b", token=2, hostname=HOST, pid=42, time=3.0, outcome="ok"))
    log.record(FaultRecord("kill", 2.4, f"{HOST} pid 41", True, "SIGKILL"))
    log.record(FaultRecord("broker_restart", 2.6, "redis", False, "no permission"))
    # a record written before ``outcome`` existed still reads
    redis_client.rpush(
        recorder.key, '{"kind":"enter","task_id":"old","key":"k2","mode":"shared","token":7}'
    )

    events = recorder.events()
    assert events[:2] == written and events[2] == killed(41, 2.5, late=True)
    assert events[3].outcome == "ok" and events[4].outcome is None and events[4].token == 7
    assert log.records()[1] == FaultRecord("broker_restart", 2.6, "redis", False, "no permission")

    report = check(events, faults=log.records())
    assert (report.violations, report.revoked_overlaps, report.killed_sections) == (0, 1, 1)
    assert report.faults_by_kind == {"kill": (1, 0), "broker_restart": (0, 1)}
    recorder.clear()
    log.clear()
    assert recorder.events() == [] and log.records() == []


def test_records_reject_what_they_cannot_mean() -> None:
    with pytest.raises(ValueError, match="fault kind"):
        FaultRecord("meteor", 0.0, "x", True, "")
    with pytest.raises(ValueError, match="not a fault record"):
        FaultRecord.from_json('{"kind": "kill"}')
    with pytest.raises(ValueError, match="kind"):
        ev("start", "a")
    assert set(FAULT_KINDS) == {
        "kill",
        "pause",
        "expire",
        "leader",
        "partition",
        "broker_restart",
        "blackhole",
        "follower_partition",
        "stall_before_write",
        "kill_held",
        "quorum_loss",
    }
    with pytest.raises(ValueError, match="forced loss"):
        SectionRecorder(None, "r").record_forced_loss("killed", HOST, 1, 0.0)
    assert "outcome" not in ev("enter", "a").to_json()  # older readers still parse it
    assert "late" not in killed(1).to_json()
    assert "session_timeout" not in killed(1).to_json()
    assert SectionEvent.from_json(forced("paused").to_json()).session_timeout == 4.0
    assert SectionEvent.from_json(killed(1, late=True).to_json()).late


# ------------------------------------------------------- run_section under a real lease loss


def _task(lease: object, redis_url: str, task_id: str) -> ZkLockTask:
    """The parts of a bound task ``run_section`` reads; the lease is a real ZooKeeper lease."""
    app = SimpleNamespace(conf={RECORD_URL_SETTING: redis_url})
    request = SimpleNamespace(id=task_id, hostname=HOST)
    return cast(ZkLockTask, SimpleNamespace(lock=lease, app=app, request=request))


def test_run_section_records_a_lost_lease_and_its_successor_is_fenced(
    zk_hosts: str,
    zk_client: KazooClient,
    lock_root: str,
    redis_client: redis.Redis,
    redis_url: str,
    run_id: str,
) -> None:
    """A holds the lock in a long section; its session is expired on the server; B takes the
    lock and runs its section. A's section must stop with LockLost before writing, and the
    recorded history must check clean (A's lease was revoked, not doubly granted)."""
    recorder = SectionRecorder(redis_client, run_id)
    submitted = {"a": time.time(), "b": time.time()}
    holder = KazooClient(zk_hosts, timeout=10)
    holder.start(timeout=15)
    try:
        lease_a = Mutex(holder, lock_root).acquire(timeout=10)
        failures: list[BaseException] = []

        def section_a() -> None:
            try:
                run_section(_task(lease_a, redis_url, "a"), run_id, "k", 60_000, "exclusive")
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=section_a)
        thread.start()
        wait_for(lambda: len(recorder.events()) >= 1, 10, "A's enter record")
        recorder.record_forced_loss("expired", HOST, recorder.events()[0].pid, time.time())
        expire_session(zk_hosts, holder)
        with Mutex(zk_client, lock_root).acquire(timeout=15) as lease_b:
            result_b = run_section(_task(lease_b, redis_url, "b"), run_id, "k", 0, "exclusive")
        thread.join(timeout=30)
        assert not thread.is_alive(), "A's section did not notice its lost lease"
    finally:
        holder.stop()
        holder.close()

    assert len(failures) == 1 and isinstance(failures[0], LockLost)
    assert result_b["accepted"] is True and lease_b.token > lease_a.token
    events = recorder.events()
    a_events = [e for e in events if e.task_id == "a"]
    assert [e.kind for e in a_events] == ["enter", "exit"]  # no write after the loss
    b_events = [e for e in events if e.task_id == "b"]
    assert [e.kind for e in b_events] == ["enter", "writing", "write", "exit"]
    assert a_events[-1].outcome == "lost"
    # A resuming and writing now would be refused: B's token is higher.
    fence = RedisFence(redis_client, fence_namespace(run_id))
    assert not fence.write("k", lease_a.token, "stale").accepted

    report = check_run(
        submitted=submitted,
        outcomes={
            "a": TaskOutcome.from_result("a", "FAILURE", failures[0]),
            "b": TaskOutcome("b", "SUCCESS"),
        },
        events=events,
        faults=[FaultRecord("expire", time.time(), "a", True, "server-side session expiry")],
        leftover_nodes=0,
    )
    assert report.violations == 0 and report.stale_writes_accepted == 0
    assert (report.revocations, report.failure_reasons, report.ran) == (1, {"LockLost": 1}, 1)
    assert report.ok
    assert sum(report.throughput) == 2 and len(report.throughput) <= 60


def test_throughput_from_unrelated_clocks_stays_short() -> None:
    # Submit times from another clock (or zeros) must not build a series of millions of seconds.
    events = [*section("a", 1, at=1.7e9), *section("b", 2, at=1.7e9 + 2)]
    report = check_run(
        submitted={"a": 0.0, "b": 0.0},
        outcomes={"a": TaskOutcome("a", "SUCCESS"), "b": TaskOutcome("b", "SUCCESS")},
        events=events,
        faults=(),
        leftover_nodes=0,
    )
    assert report.throughput == (1, 0, 1)


# ------------------------------------------------- a section reads its admission back


def test_find_admission_reads_the_newest_admission_of_this_run_whatever_its_name(
    zk_client: KazooClient, lock_root: str
) -> None:
    """Admission nodes as :class:`celery_zklock.RateLimit` names them (``adm-<seq>``, and
    ``adm-t-<seq>`` for a TTL node), with identities: the run's own newest one is found (by
    creation order, not by name), others' and a previous attempt's are not."""
    rate = f"{lock_root}/{RATE_NODE}"
    zk_client.ensure_path(rate)

    def admit(prefix: str, task_id: str, pid: int = 7, retries: int = 0) -> int:
        data = json.dumps({"task_id": task_id, "retries": retries, "pid": pid}).encode()
        path = zk_client.create(f"{rate}/{prefix}", data, sequence=True)
        return int(zk_client.exists(path).ctime)

    admit(ADMISSION_PREFIX, "t", retries=0)  # an earlier attempt's
    admit(ADMISSION_PREFIX, "other")
    ours = admit(TTL_ADMISSION_PREFIX, "t", retries=1)
    admit(ADMISSION_PREFIX, "t", pid=8, retries=1)  # another process (a copy): not ours
    assert find_admission(zk_client, lock_root, "t", 7, 1) == ours
    assert find_admission(zk_client, lock_root, "t", 7, 0) is not None
    assert find_admission(zk_client, lock_root, "nobody", 7, 0) is None
    assert find_admission(zk_client, f"{lock_root}/none", "t", 7, 1) is None


def test_worker_log_instants_are_read_as_the_host_writes_them() -> None:
    from datetime import datetime

    from workers.loadtest import _logged_at

    line = "[2026-11-28 05:05:58,867: INFO/MainProcess] Task t[x] retry: Retry in 5.0s"
    assert _logged_at(line) == datetime(2026, 11, 28, 5, 5, 58, 867000).timestamp()
    assert _logged_at("Traceback (most recent call last):") == 0.0


def _log(*lines: tuple[str, str]) -> str:
    """A worker log: ``(HH:MM:SS,mmm, text)`` lines, or ``("banner", name)`` for a (re)start."""
    return "\n".join(
        f" -------------- {text} v5.7.0 (collider)" if at == "banner"
        else f"[2026-11-28 08:{at}: INFO/MainProcess] {text}"
        for at, text in lines
    )  # fmt: skip


def _at(stamp: str) -> float:
    from datetime import datetime

    return datetime.strptime(f"2026-11-28 08:{stamp}", "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_message_goes_back_to_the_broker_when_sent_again_or_when_its_receiver_restarts() -> None:
    """From the fleet's worker logs (issue 42's every-fault run at acc9: a retry received by a
    worker 1 ms before the sender logged the retry, then that worker crashed on a broker
    restart and came back, and no worker logged the call received again)."""
    from workers.loadtest import broker_returns

    sender = _log(("banner", "w1"), ("33:59,620", "Task s[t1] retry: Retry in 5.0s: Unavailable"),
                  ("34:00,000", "Task s[t2] retry: Retry in 5.0s"),
                  ("34:01,000", "gate: 1 message(s) of /k go back to the broker: t3"))  # fmt: skip
    receiver = _log(("banner", "w2"), ("33:59,619", "Task s[t1] received"),
                    ("34:00,100", "Task s[t2] received"), ("34:00,400", "Task s[t3] received"),
                    ("34:03,873", "Unrecoverable error: AttributeError('hostname')"),
                    ("banner", "w2"), ("34:04,742", "Connected to redis://"))  # fmt: skip
    other = _log(("banner", "w3"), ("34:05,000", "Task s[t2] received"))
    found = broker_returns({"w1": sender, "w2": receiver, "w3": other}, ["t1", "t2", "t3", "t4"])
    # t1: received (within the log lag of the retry), then its receiver restarted.
    assert found["t1"].since == _at("34:04,742") and found["t1"].received_by == ()
    assert "w2" in found["t1"].how and "restarted" in found["t1"].how
    # t2: received by w2, which restarted, and then by w3, which did not: received.
    assert found["t2"].since == _at("34:00,000") and found["t2"].received_by == ("w2", "w3")
    # t3: given back by the gate 0.6 s after w2's receipt (more than the lag): not since.
    assert found["t3"].since == _at("34:01,000") and found["t3"].received_by == ()
    # t4: never in any log.
    assert found["t4"].since == 0.0 and found["t4"].received_by == ()


def test_an_expiry_excuses_a_section_its_process_entered_before_the_close_landed() -> None:
    # The expired event is recorded before the injector's call closes the session: a section
    # the process enters in between (a threads worker's second task) is on that session too.
    # Seen in a fleet run: granted 20 ms before the close landed, overlapped 20 ms later.
    events = [
        forced("expired", at=10.0),
        ev("enter", "a", token=1, time=10.01),
        ev("enter", "b", token=2, time=10.03),
        ev("exit", "a", token=1, outcome="lost", time=10.04),
        ev("exit", "b", token=2, outcome="ok", time=10.5),
    ]
    lost = {"a": TaskOutcome("a", "FAILURE", reason="LockLost: the session expired")}
    report = check(events, outcomes=lost)
    assert (report.violations, report.revoked_overlaps) == (0, 1), report
    # Entered past the close's bound, it was on a new session: the overlap is a violation.
    later = [events[0], *(replace(e, time=e.time + 20.0) for e in events[1:])]
    assert check(later, outcomes=lost).violations == 1
    # As before, a withdrawn expiry excuses nothing, nor one of another process.
    assert check([events[0], forced("survived"), *events[1:]], outcomes=lost).violations == 1
    other = [forced("expired", pid=99, at=10.0), *events[1:]]
    assert check(other, outcomes=lost).violations == 1
