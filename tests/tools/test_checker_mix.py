"""The checker on the issue-36 mix, from hand-built histories: sections a newer ``preempt`` call
ended (a hand-over only when their exit, or their process's death, came before the newer
section entered: a preempt excuses no overlap), and sections over two keys (recorded once per
key, each with that key's token); on issue 42's: rate-limited sections (at most N admission
``ctime``s in any ``[t, t + period)`` per key), bodies completed twice for one task id, and ETA
calls in the plan."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

from celery_zklock import LockLost
from celery_zklock.errors import LossCode
from celery_zklock.task.run import PREEMPTED
from workers.checker import PREEMPTED_FAILURE, RunReport, TaskOutcome, check_run
from workers.loadtest import HOT_KEY, LoadConfig, WorkItem, _Progress, _send_all, plan_workload
from workers.record import Mode, SectionEvent
from workers.tasks import (
    DEBOUNCED_TASK,
    PAIR_TASK,
    PREEMPTED_OUTCOME,
    TASK_FOR_MODE,
    loss_outcome,
)

HOST = "w1@test"
PREEMPT_REASON = (
    "LockLost: lock /zklock/workers.section/key=k~0 broken by operator task "
    f"workers.exclusive_section[new]: {PREEMPTED}"
)


def ev(
    kind: str, task: str, token: int, key: str = "k", mode: Mode = "exclusive", **extra: Any
) -> SectionEvent:
    extra.setdefault("hostname", HOST)
    extra.setdefault("pid", 100 + token)
    return SectionEvent(kind=kind, task_id=task, key=key, mode=mode, token=token, **extra)  # type: ignore[arg-type]


def enter(task: str, token: int, key: str = "k", **extra: Any) -> SectionEvent:
    return ev("enter", task, token, key, **extra)


def leave(task: str, token: int, key: str = "k", outcome: str = "ok", **extra: Any) -> SectionEvent:
    return ev("exit", task, token, key, outcome=outcome, **extra)


def write(task: str, token: int, key: str = "k", **extra: Any) -> SectionEvent:
    return ev("write", task, token, key, accepted=True, **extra)


def process_event(kind: str, pid: int, *, late: bool = False) -> SectionEvent:
    return SectionEvent(kind, "", "", "exclusive", 0, hostname=HOST, pid=pid, late=late)  # type: ignore[arg-type]


def check(events: Sequence[SectionEvent], outcomes: dict[str, TaskOutcome]) -> RunReport:
    tasks = {e.task_id for e in events if e.task_id} | set(outcomes)
    return check_run(
        submitted={t: 0.0 for t in sorted(tasks)},
        outcomes={t: outcomes.get(t, TaskOutcome(t, "SUCCESS")) for t in tasks},
        events=events,
        faults=[],
        leftover_nodes=0,
    )


def preempted(task: str) -> TaskOutcome:
    return TaskOutcome(task, "FAILURE", reason=PREEMPT_REASON)


# ------------------------------------------------------------------------------- preempt


def test_a_preempted_holder_that_exits_before_the_newer_call_enters_is_a_hand_over() -> None:
    report = check(
        [
            enter("old", 1),
            leave("old", 1, outcome=PREEMPTED_OUTCOME),
            enter("new", 2),
            write("new", 2),
            leave("new", 2),
        ],
        {"old": preempted("old")},
    )
    assert report.ok, report.summary_lines()
    assert (report.violations, report.revoked_overlaps, report.lost) == (0, 0, 0)
    assert (report.preempted, report.revocations, report.failed, report.ran) == (1, 0, 1, 1)
    assert report.failure_reasons == {PREEMPTED_FAILURE: 1}
    assert any("1 preempted by a newer call" in line for line in report.summary_lines())
    assert report.to_json()["preempted"] == 1


def test_a_preempted_holder_still_inside_when_the_newer_call_enters_is_a_violation() -> None:
    report = check(
        [
            enter("old", 1),
            enter("new", 2),
            leave("old", 1, outcome=PREEMPTED_OUTCOME),
            leave("new", 2),
        ],
        {"old": preempted("old")},
    )
    assert (report.violations, report.revoked_overlaps) == (1, 0)
    assert not report.ok
    assert report.overlaps[0].inside == ("old#1",) and report.overlaps[0].entering == "new#2"


def test_a_preempted_holders_death_recorded_before_the_newer_enter_closes_its_section() -> None:
    report = check(
        [enter("old", 1), process_event("killed", 101), enter("new", 2), leave("new", 2)],
        {"old": preempted("old")},
    )
    assert report.violations == 0 and report.killed_sections == 1


def test_a_kill_recorded_after_the_newer_enter_does_not_let_a_preempt_excuse_the_overlap() -> None:
    # An injected kill is recorded once it landed: recorded after the newer enter, the holder
    # was alive then, whatever the task says about a preempt.
    report = check(
        [enter("old", 1), enter("new", 2), process_event("killed", 101), leave("new", 2)],
        {"old": preempted("old")},
    )
    assert report.violations == 1


def test_a_preempted_section_overlapped_after_a_fault_took_its_session_is_revoked() -> None:
    # The expiry is the excuse; the preempted outcome only shows the holder learned of the loss.
    report = check(
        [
            enter("old", 1),
            process_event("expired", 101),
            enter("new", 2),
            leave("old", 1, outcome=PREEMPTED_OUTCOME),
            leave("new", 2),
        ],
        {"old": preempted("old")},
    )
    assert (report.violations, report.revoked_overlaps, report.preempted) == (0, 1, 1)


def test_loss_outcome_tells_a_preempt_from_other_losses() -> None:
    by = "broken by operator task workers.exclusive_section[x]"
    assert loss_outcome(LockLost(f"{by}: {PREEMPTED}", code=LossCode.BROKEN)) == "preempted"
    assert loss_outcome(LockLost(f"{by}: maintenance", code=LossCode.BROKEN)) == "lost"
    assert loss_outcome(LockLost("session expired", code=LossCode.SESSION_EXPIRED)) == "lost"
    assert loss_outcome(LockLost(PREEMPTED)) == "lost"  # no code: not a break request
    # The interruption raises LockLost without a code (or a message, in a threads pool): the
    # lease says why it was lost.
    lease = SimpleNamespace(lost_code=LossCode.BROKEN, lost_reason=f"{by}: {PREEMPTED}")
    assert loss_outcome(LockLost(), lease) == "preempted"
    expired = SimpleNamespace(lost_code=LossCode.SESSION_EXPIRED, lost_reason="expired")
    assert loss_outcome(LockLost(), expired) == "lost"


# ------------------------------------------------------------------------------ two keys


def pair(
    task: str, tokens: tuple[int, int], keys: tuple[str, str] = ("a", "b"), outcome: str = "ok"
) -> list[SectionEvent]:
    """A whole pair section: each event once per key, each key with its own token."""
    pid = {"pid": 500}
    return [
        *(enter(task, t, k, **pid) for k, t in zip(keys, tokens, strict=True)),
        *(write(task, t, k, **pid) for k, t in zip(keys, tokens, strict=True)),
        *(leave(task, t, k, outcome, **pid) for k, t in zip(keys, tokens, strict=True)),
    ]


def test_a_pair_section_between_single_key_sections_of_its_keys_is_ok() -> None:
    report = check(
        [
            enter("s1", 1, "a"),
            leave("s1", 1, "a"),
            *pair("p", (2, 3)),
            enter("s2", 4, "b"),
            leave("s2", 4, "b"),
        ],
        {},
    )
    assert report.ok, report.summary_lines()
    assert (report.retried, report.attempts["p"], report.writes_accepted) == (0, 1, 2)
    assert len(report.hold_seconds) == 4  # one per key's section


def test_a_single_key_section_entering_one_of_a_pairs_keys_is_a_violation() -> None:
    report = check(
        [
            enter("p", 2, "a", pid=500),
            enter("p", 3, "b", pid=500),
            enter("s", 4, "b"),
            leave("s", 4, "b"),
            leave("p", 2, "a", pid=500),
            leave("p", 3, "b", pid=500),
        ],
        {},
    )
    assert report.violations == 1
    assert (report.overlaps[0].key, report.overlaps[0].inside) == ("b", ("p#3",))


def test_a_pair_entering_while_a_shared_section_holds_one_key_is_a_violation() -> None:
    report = check(
        [
            ev("enter", "r", 1, "a", mode="shared"),
            *pair("p", (2, 3)),
            ev("exit", "r", 1, "a", mode="shared", outcome="ok"),
        ],
        {},
    )
    assert report.violations == 1 and report.overlaps[0].key == "a"


def test_a_pair_run_twice_counts_as_retried_once() -> None:
    # The first attempt lost its locks (a retry is legitimate then); its exits, one per key,
    # are one body, and the second attempt's body is the one that completed.
    report = check([*pair("p", (2, 3), outcome="lost"), *pair("p", (4, 5))], {})
    assert report.ok and report.retried == 1 and report.attempts == {"p": 2}
    assert report.duplicate_completions == 0


def test_a_pairs_sections_overlapped_after_its_session_expired_are_revoked_on_each_key() -> None:
    lost = TaskOutcome("p", "FAILURE", reason="LockLost: session expired")
    report = check(
        [
            enter("p", 2, "a", pid=500),
            enter("p", 3, "b", pid=500),
            process_event("expired", 500),
            enter("s", 4, "a"),
            enter("t", 5, "b"),
            leave("s", 4, "a"),
            leave("t", 5, "b"),
        ],
        {"p": lost},
    )
    # Both keys' sections of the pair are the task's last (per key): the task's LockLost
    # answers for each, though neither recorded its exit.
    assert (report.violations, report.revoked_overlaps) == (0, 2)


# ------------------------------------------------------------------------------ the mix


def test_the_mix_ratios_at_zero_leave_the_plan_as_it_was() -> None:
    base = LoadConfig(tasks=200, keys=6, rate_ratio=0.2, scenario="hot-key", hot_share=0.3)
    assert plan_workload(base) == plan_workload(
        LoadConfig(**{**base.__dict__, "preempt_ratio": 0.0, "pair_ratio": 0.0})
    )


def test_the_mix_has_pair_sections_off_the_hot_key_and_preempt_sections_on_all_keys() -> None:
    config = LoadConfig(
        tasks=400, keys=6, rate_ratio=0.2, scenario="hot-key", hot_share=0.3,
        preempt_ratio=0.15, pair_ratio=0.15,
    )  # fmt: skip
    plan = [item for item in plan_workload(config) if not item.unrelated]
    pairs = [item for item in plan if item.key_b is not None]
    preempts = [item for item in plan if item.on_busy == "preempt"]
    assert 30 < len(pairs) < 90 and 20 < len(preempts) < 80
    assert all(p.key != p.key_b and p.mode == "exclusive" and p.rate is None for p in pairs)
    assert {p.key_b for p in pairs} <= {f"key-{i}" for i in range(6)}
    assert all(p.rate is None and p.key_b is None for p in preempts)
    hot = [item for item in plan if item.key == HOT_KEY]
    assert hot and all(h.on_busy in ("wait", "preempt") and h.key_b is None for h in hot)
    assert any(h.on_busy == "preempt" for h in hot) and any(p.key != HOT_KEY for p in preempts)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, dict[str, Any]]] = []

    def apply_async(self, args: Any, *, task_id: str, **options: Any) -> None:
        self.sent.append((args, options))


def test_a_pair_item_is_sent_to_the_pair_task_with_both_keys() -> None:
    single, pair_task = Recorder(), Recorder()
    tasks: dict[str, Any] = {name: single for name in TASK_FOR_MODE.values()}
    app: Any = SimpleNamespace(tasks={**tasks, PAIR_TASK: pair_task})
    plan = [
        WorkItem("exclusive", "wait", "key-1", 10, key_b="key-3"),
        WorkItem("exclusive", "preempt", "key-2", 10),
    ]
    progress = _Progress(len(plan))
    _send_all(app, "run", plan, LoadConfig(tasks=2, duration=0.0), progress,
              lambda: False, 1, threading.Event())  # fmt: skip
    assert progress.send_error is None
    assert pair_task.sent == [
        (("run", "key-1", "key-3", 10), {"zklock": {"on_busy": "wait", "timeout": 20.0}})
    ]
    assert single.sent == [
        (("run", "key-2", 10), {"zklock": {"on_busy": "preempt", "timeout": 20.0}})
    ]


# ------------------------------------------------------------------------- rate windows


def rated(
    task: str, token: int, admitted: int | None, key: str = "k", rate: str = "2/s"
) -> list[SectionEvent]:
    """A whole rate-limited section admitted at ZooKeeper ``ctime`` ``admitted`` (ms; None: its
    admission could not be read), one after the other so that no two of them overlap. Every
    event of the section carries the rate and the admission, as the fleet's sections record."""
    admission = {"rate": rate, "admitted": admitted, "pid": 700}
    return [
        enter(task, token, key, **admission),
        write(task, token, key, **admission),
        leave(task, token, key, **admission),
    ]


def test_n_plus_one_admissions_in_one_period_are_a_rate_violation() -> None:
    # 2/s: admissions at 0, 400 and 999 ms all fall in [0, 1000).
    report = check([*rated("a", 1, 0), *rated("b", 2, 400), *rated("c", 3, 999)], {})
    assert report.rate_violations == 1 and report.violations == 1, report.summary_lines()
    assert not report.ok
    (overrun,) = report.rate_overruns
    assert (overrun.key, overrun.rate, overrun.window_start) == ("k", "2/s", 0)
    assert overrun.holders == ("a#1", "b#2", "c#3")
    assert " rate_violations=1 " in report.report_line()
    assert report.to_json()["rate_violations"] == 1
    summary = "\n".join(report.summary_lines())
    assert "mutual exclusion: 0 violations" in summary
    assert "3 admissions in [0, 1000) ms (rate 2/s)" in summary


def test_n_admissions_in_every_half_open_period_pass() -> None:
    # 0 and 400 in [0, 1000); 1000 is the next window's (half-open), so is 1400.
    report = check(
        [*rated("a", 1, 0), *rated("b", 2, 400), *rated("c", 3, 1000), *rated("d", 4, 1400)], {}
    )
    assert report.ok and report.rate_violations == 0 and report.violations == 0
    assert report.rate_admissions == 4
    assert " rate_violations=0 " in report.report_line()


def test_each_key_has_its_own_rate_windows() -> None:
    report = check([*rated("a", 1, 0), *rated("b", 2, 10, key="other"), *rated("c", 3, 20)], {})
    assert report.ok and report.rate_violations == 0


def test_a_rate_limited_section_whose_admission_was_not_read_is_unchecked() -> None:
    report = check([*rated("a", 1, 0), *rated("b", 2, None)], {})
    assert report.admissions_unread == 1 and report.unchecked == 1 and not report.ok
    assert report.report_line().endswith("admissions_unread=1")


# --------------------------------------------------------------------- completed twice


def test_a_body_completed_twice_for_one_task_id_fails_the_verdict() -> None:
    # A redelivered copy of a call that ended ran its body again, after the original.
    report = check([enter("t", 1), leave("t", 1), enter("t", 2), leave("t", 2)], {})
    assert report.violations == 0 and report.duplicate_completions == 1
    assert report.completed_twice_task_ids == ("t",) and not report.ok
    assert report.report_line().endswith(" duplicate_completions=1")
    assert "bodies completed more than once: 1 (t x2)" in "\n".join(report.summary_lines())
    # A body that raised on its own ran to its end too: run again, it completed twice.
    failed = TaskOutcome("f", "FAILURE", reason="ValueError: boom")
    report = check(
        [enter("f", 1), leave("f", 1, outcome="error:ValueError"), enter("f", 2), leave("f", 2)],
        {"f": failed},
    )
    assert report.duplicate_completions == 1 and not report.ok


def test_a_body_run_again_after_its_lock_was_lost_or_its_process_killed_completed_once() -> None:
    report = check(
        [
            enter("t", 1),
            leave("t", 1, outcome="lost"),
            enter("t", 2, pid=300),
            process_event("killed", 300),
            enter("t", 3),
            leave("t", 3),
        ],
        {},
    )
    assert report.ok and report.duplicate_completions == 0 and report.retried == 1
    assert report.report_line().endswith(" rate_violations=0 duplicate_completions=0")


# ------------------------------------------------------------------------ ETA in the mix


def test_the_eta_ratio_at_zero_leaves_the_plan_as_it_was() -> None:
    base = LoadConfig(tasks=200, keys=6, rate_ratio=0.2, pair_ratio=0.1, preempt_ratio=0.1)
    plan = plan_workload(base)
    assert all(item.countdown is None for item in plan)
    with_eta = plan_workload(LoadConfig(**{**base.__dict__, "eta_ratio": 0.3}))
    assert [replace(item, countdown=None) for item in with_eta] == plan


def test_eta_sections_get_a_countdown_of_half_to_all_of_eta_countdown() -> None:
    config = LoadConfig(tasks=400, keys=6, scenario="hot-key", eta_ratio=0.25, eta_countdown=4.0)
    plan = plan_workload(config)
    delayed = [item for item in plan if item.countdown is not None]
    assert 60 < len(delayed) < 140
    assert all(2.0 <= item.countdown <= 4.0 for item in delayed)  # type: ignore[operator]
    assert not any(item.unrelated for item in delayed)
    assert any(item.key == HOT_KEY for item in delayed)


def test_an_eta_item_is_sent_with_its_countdown() -> None:
    single, pair_task = Recorder(), Recorder()
    tasks: dict[str, Any] = {name: single for name in TASK_FOR_MODE.values()}
    app: Any = SimpleNamespace(tasks={**tasks, PAIR_TASK: pair_task})
    plan = [
        WorkItem("exclusive", "wait", "key-1", 10, countdown=3.5),
        WorkItem("exclusive", "wait", "key-1", 10, key_b="key-2", countdown=2.0),
        WorkItem("shared", "skip", "key-2", 10),
    ]
    progress = _Progress(len(plan))
    _send_all(app, "run", plan, LoadConfig(tasks=3, duration=0.0), progress,
              lambda: False, 1, threading.Event())  # fmt: skip
    assert progress.send_error is None
    assert [options.get("countdown") for _, options in single.sent] == [3.5, None]
    assert [options.get("countdown") for _, options in pair_task.sent] == [2.0]


def test_a_body_run_again_because_its_worker_died_before_the_ack_is_not_a_duplicate() -> None:
    """The body ran to its end and its process was killed (docker kill, SIGKILL) before its
    message was acknowledged: the copy runs it again (Celery's at-least-once with
    ``acks_late``). Not counted; a kill of another process, or long after, does not excuse."""

    def killed(pid: int, at: float) -> SectionEvent:
        return SectionEvent("killed", "", "", "exclusive", 0, hostname=HOST, pid=pid, time=at)  # type: ignore[arg-type]

    first = [enter("t", 1, time=10.0), leave("t", 1, time=10.2)]
    again = [enter("t", 2, time=40.0), leave("t", 2, time=40.2)]
    assert check([*first, killed(101, 10.5), *again], {}).duplicate_completions == 0
    assert check([killed(101, 10.1), *first, *again], {}).duplicate_completions == 0
    assert check([*first, killed(999, 10.5), *again], {}).duplicate_completions == 1
    assert check([*first, killed(101, 25.0), *again], {}).duplicate_completions == 1


# ---------------------------------------------------------- debounced and replace bursts


def test_the_burst_ratios_at_zero_leave_the_plan_as_it_was_and_bursts_keep_their_key() -> None:
    base = LoadConfig(tasks=300, keys=6, rate_ratio=0.2, pair_ratio=0.1, preempt_ratio=0.1,
                      scenario="hot-key", hot_share=0.3, eta_ratio=0.2)  # fmt: skip
    assert plan_workload(base) == plan_workload(
        LoadConfig(**{**base.__dict__, "debounce_ratio": 0.0, "replace_ratio": 0.0})
    )
    mixed = plan_workload(LoadConfig(**{**base.__dict__, "debounce_ratio": 0.1,
                                        "replace_ratio": 0.1, "burst": 3}))  # fmt: skip
    sections = [item for item in mixed if not item.unrelated]
    assert len(sections) == len([item for item in plan_workload(base) if not item.unrelated])
    assert len(mixed) == len(plan_workload(base))  # the unrelated tasks are all still there
    heads = [i for i, item in enumerate(sections) if item.on_busy in ("wait", "replace")
             and (item.debounced or item.on_busy == "replace") and not item.follows]  # fmt: skip
    assert any(sections[i].debounced for i in heads) and any(
        sections[i].on_busy == "replace" for i in heads
    )
    for i in heads:
        burst = sections[i : i + 3]
        assert [item.follows for item in burst] == [False, True, True], burst
        assert len({(item.key, item.on_busy, item.debounced) for item in burst}) == 1, burst
        head = burst[0]
        assert head.key != HOT_KEY and head.mode == "exclusive"
        assert all(item.rate is None and item.key_b is None and item.countdown is None
                   for item in burst)  # fmt: skip
    # A burst's calls are sent back to back: no unrelated task between them.
    for before, item in pairwise(mixed):
        if item.follows:
            assert not before.unrelated


def test_a_debounced_item_goes_to_the_debounced_task_and_a_replace_item_with_its_policy() -> None:
    single, debounced = Recorder(), Recorder()
    tasks: dict[str, Any] = {name: single for name in TASK_FOR_MODE.values()}
    app: Any = SimpleNamespace(tasks={**tasks, DEBOUNCED_TASK: debounced})
    plan = [
        WorkItem("exclusive", "wait", "key-1", 10, debounced=True),
        WorkItem("exclusive", "wait", "key-1", 10, debounced=True, follows=True),
        WorkItem("exclusive", "replace", "key-2", 10),
    ]
    progress = _Progress(len(plan))
    _send_all(app, "run", plan, LoadConfig(tasks=3, duration=0.0), progress,
              lambda: False, 1, threading.Event())  # fmt: skip
    assert progress.send_error is None
    assert [args for args, _ in debounced.sent] == [("run", "key-1", 10)] * 2
    assert single.sent == [
        (("run", "key-2", 10), {"zklock": {"on_busy": "replace", "timeout": 20.0}})
    ]
