"""The verdict on one recorded run: mutual exclusion, rate limits, fencing, task accounting and
faults.

:func:`check_run` replays a run's section events (:mod:`workers.record`) in the order Redis
received them, by the overlap rule of :mod:`celery_zklock.testing.exclusion`, with the tasks'
final states and the faults injected, and returns a :class:`RunReport`. Which overlaps count as
revoked (a fault took the holder's lease, and it knew) and which as violations, which rate
admissions were one too many (:mod:`workers.admissions`), which bodies completed twice, which
writes are stale and how tasks are counted: ``docs/fleet.md``, "The verdict".

A call that ended *superseded* (a skip of reason ``debounced`` or ``replaced``: a newer call of
its key ran instead) must not have run: a section of its task entered and not ended by a kill
(a body killed mid-run is Celery's at-least-once, whose next copy may then be superseded) is a
violation, and so is a skip naming no other call of the run (:attr:`RunReport.superseded_ran`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from celery_zklock import is_skipped
from celery_zklock.task.run import PREEMPTED
from celery_zklock.testing.exclusion import Exclusion
from workers.admissions import Admission, RateOverrun, rate_overruns
from workers.record import (
    EXPIRE_CALL_TIMEOUT,
    FORCED_LOSS_KINDS,
    MAIN_PROCESS_KILL,
    PREEMPTED_OUTCOME,
    FaultRecord,
    Mode,
    SectionEvent,
)

__all__ = [
    "SUPERSEDED_REASONS",
    "FaultCount",
    "FaultImpact",
    "RunReport",
    "SectionOverlap",
    "TaskOutcome",
    "check_run",
]

FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
COMPLETED_OUTCOMES = ("ok", "error:")
"""``exit`` outcomes (prefixes) of a body that ran to its end: it returned, or raised on its
own. ``lost`` and ``preempted`` bodies were stopped; an exit without an outcome (older records)
says nothing, and counts as neither."""
LOST_REASON_PREFIX = "LockLost"
PREEMPTED_FAILURE = "LockLost (preempted)"
"""The failure kind of a task whose lock a newer ``preempt`` call broke."""
SUPERSEDED_REASONS = frozenset({"debounced", "replaced"})
"""Skip reasons of a call a newer one superseded: it must never have run its body."""
MAX_SERIES_SECONDS = 7 * 24 * 3600
PAUSE_EXPIRY_FRACTION = 0.5
"""A pause excuses an overlap only once this fraction of the session timeout has passed since
the stop was sent (``paused`` event's time, on the same host's clock as the enter): the server
cannot expire the session sooner than 2/3 of the timeout after it (kazoo sends at least every
third of the timeout), so an earlier successor is a lock fault, a later one may be legitimate.
That holds only while the process and the server keep that pace: a ``paused`` event that carries
the holder's own ``valid_until`` (a holder that stopped itself) is judged by it instead."""


@dataclass(frozen=True)
class TaskOutcome:
    """A submitted task's final state as Celery reports it.

    ``state`` is Celery's state name; ``skipped`` is true for a SUCCESS whose lock was busy and
    which skipped its body, ``skip_reason`` then the skip's reason (``busy``, ``rate``,
    ``debounced``, ``replaced``, ...) and ``skipped_for`` the call it names (the holder, or
    the newer call that superseded it); ``reason`` is ``"ExcType: message"`` for a FAILURE.
    """

    task_id: str
    state: str
    skipped: bool = False
    reason: str | None = None
    skip_reason: str | None = None
    skipped_for: str | None = None

    @classmethod
    def from_result(cls, task_id: str, state: str, result: Any) -> TaskOutcome:
        """From a Celery ``AsyncResult``'s ``state`` and ``result`` (a stored result's
        ``status`` and ``result`` alike)."""
        if state == "SUCCESS":
            if not is_skipped(result):
                return cls(task_id, state)
            why, named = result.get("reason"), result.get("holder")
            return cls(task_id, state, skipped=True,
                       skip_reason=None if why is None else str(why),
                       skipped_for=None if named is None else str(named))  # fmt: skip
        if state == "FAILURE":
            reason = (
                f"{type(result).__name__}: {result}"
                if isinstance(result, BaseException)
                else str(result)
            )
            return cls(task_id, state, reason=reason)
        return cls(task_id, state)


@dataclass(frozen=True)
class SectionOverlap:
    """A section that entered while conflicting sections of its key were inside."""

    key: str
    position: int
    """Index of the entering ``enter`` event in the event list."""
    entering: str
    entering_mode: Mode
    inside: tuple[str, ...]
    """The conflicting holders (``task_id#token``) inside at that moment."""
    revoked: bool
    """Every conflicting holder had its lease revoked (see the module docstring)."""


class FaultCount(NamedTuple):
    """Faults of one kind: how many were injected, how many could not be."""

    injected: int
    could_not_run: int


@dataclass(frozen=True)
class FaultImpact:
    """What followed one injected fault, until the next fault (or the end of the run)."""

    fault: FaultRecord
    lost_sections: int
    """Sections that exited with outcome ``"lost"`` in that window."""
    killed_sections: int
    revoked_overlaps: int
    refused_writes: int
    failures: Mapping[str, int] = field(default_factory=dict)
    """Tasks whose FAILURE (or REVOKED) was stored in that window, by exception type as in
    ``failure_reasons``: what ended on the fault's account, e.g. ``ZooKeeperUnavailable`` after
    a ``quorum_loss`` (known only with the results' ``done_at``)."""

    def failures_text(self) -> str:
        """``, tasks failed: ZooKeeperUnavailable x2, LockLost x1`` (empty when none did)."""
        if not self.failures:
            return ""
        ordered = sorted(self.failures.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", tasks failed: " + ", ".join(f"{kind} x{n}" for kind, n in ordered)


@dataclass(frozen=True)
class RunReport:
    """What :func:`check_run` found. ``ok``: no violation (mutual exclusion or rate), stale
    write, lost task, leftover or body completed twice, and nothing left unchecked
    (:attr:`unchecked`)."""

    tasks: int
    ran: int
    skipped: int
    failed: int
    lost: int
    violations: int
    """Overlaps no fault explains (``overlaps`` not revoked) plus ``rate_violations`` plus
    ``superseded_violations``."""
    revoked_overlaps: int
    stale_writes_accepted: int
    leftover_nodes: int
    retried: int
    """Tasks whose section was entered more than once (retries, redeliveries)."""
    revocations: int
    """Sections that exited with outcome ``"lost"`` (a preempted one is counted in
    ``preempted``)."""
    killed_sections: int
    open_sections: int
    """Sections entered that neither exited nor were killed."""
    writes_accepted: int
    writes_refused: int
    ran_without_section: int
    """Tasks that ran (SUCCESS) with no ``enter`` recorded: records went missing."""
    failure_reasons: Mapping[str, int]
    """Failed tasks by exception type (``REVOKED`` for revoked tasks)."""
    failure_examples: Mapping[str, str]
    """One full reason per exception type."""
    faults_by_kind: Mapping[str, FaultCount]
    fault_impacts: tuple[FaultImpact, ...]
    """The faults that ran, in time order, each with what followed it."""
    faults_not_run: tuple[FaultRecord, ...]
    """The faults that could not be injected, each with why (its ``detail``)."""
    overlaps: tuple[SectionOverlap, ...]
    stale_writes: tuple[SectionEvent, ...]
    malformed: tuple[str, ...]
    """Events that contradict the protocol: an exit without an open enter, a second enter."""
    lost_task_ids: tuple[str, ...]
    wait_seconds: tuple[float, ...]
    """Per task that entered: first enter time minus submit time."""
    hold_seconds: tuple[float, ...]
    """Per exited section: exit time minus enter time."""
    throughput: tuple[int, ...]
    """Section exits per second, from the first submission (without submissions, or when the
    submit times are more than a week before the exits, from the first exit)."""
    attempts: Mapping[str, int] = field(default_factory=dict)
    unexplained_open_sections: int = 0
    """Open sections (see ``open_sections``) whose task reached a final state: it ended
    without its ``exit`` record, so the section's end was never checked. An open section of a
    task without a final state is reported by ``lost`` (or belongs to no submitted task: a
    section a fault planted)."""
    unrelated: int = 0
    """Of ``tasks``, the unrelated ones: tasks of no lock (``workers.unrelated``), counted in
    ``ran``, ``failed`` or ``lost`` like the others but with no section of their own."""
    unrelated_latency_seconds: tuple[float, ...] = ()
    """Per unrelated task that succeeded: its result's ``date_done`` minus its submit time."""
    preempted: int = 0
    """Sections that exited with outcome ``"preempted"``: a newer ``preempt`` call broke their
    lock. Their exit must be recorded before the newer call's enter like any other hand-over:
    a preempt excuses no overlap (an overlap with a preempted section is a violation unless a
    fault explains it, as for any section). Their tasks are counted in ``failed``."""
    gate: bool | None = None
    """Whether the workers ran with the gate (None: not known, e.g. an external fleet)."""
    gate_held_max: int | None = None
    """The most messages the fleet's gates held at one look during the run (asked every
    second); None if never asked."""
    broker_dropped_task_ids: tuple[str, ...] = ()
    """Tasks with no final state that never started and whose message the broker no longer
    held, submitted before the end of a broker restart of the run, or received by no worker
    (by their logs) and submitted before a fault killed a worker's main process: dropped by the
    broker's transport before any worker ran them (:mod:`workers.whereabouts`: popped, and
    lost with the broker or the consumer before it was recorded as delivered). Not counted in
    ``lost``; any other such task is lost."""
    rate_overruns: tuple[RateOverrun, ...] = ()
    """Admissions of rate-limited sections that made more than N in one period of their key
    (:func:`workers.admissions.rate_overruns`); each is a rate violation."""
    rate_admissions: int = 0
    """Admissions checked: rate-limited sections that recorded their admission's ``ctime``."""
    admissions_unread: int = 0
    """Rate-limited sections that could not read their admission: not checked (unchecked)."""
    completed_twice: Mapping[str, int] = field(default_factory=dict)
    """Task id -> how many times its body ran to its end (``exit`` ``ok`` or ``error:...``) on
    one key, for the tasks whose body did so more than once: a redelivered copy of a call
    that had ended ran it again. Each fails the verdict. A body whose process was killed
    while it ran or just after it ended (before its message was acknowledged) is not counted:
    its copy is Celery's at-least-once (:meth:`_Replay.died_before_its_ack`)."""
    skip_reasons: Mapping[str, int] = field(default_factory=dict)
    """Skipped tasks by their skip's reason (``busy``, ``rate``, ``debounced``,
    ``replaced``, ...; ``?`` for a skip that gives none)."""
    superseded_ran: tuple[str, ...] = ()
    """What went wrong with calls that ended superseded (:data:`SUPERSEDED_REASONS`), one line
    each: a section of the call entered and not ended by a kill ("both replaced and run"), or
    a skip naming no other call of the run. Each is a violation."""

    @property
    def broker_dropped(self) -> int:
        return len(self.broker_dropped_task_ids)

    @property
    def rate_violations(self) -> int:
        return len(self.rate_overruns)

    @property
    def superseded_violations(self) -> int:
        return len(self.superseded_ran)

    @property
    def superseded(self) -> int:
        """Calls that ended superseded by a newer call (debounced or replaced)."""
        return sum(self.skip_reasons.get(reason, 0) for reason in SUPERSEDED_REASONS)

    @property
    def exclusion_violations(self) -> int:
        """The violations that are overlaps (mutual exclusion), without the rate and
        superseded ones."""
        return self.violations - self.rate_violations - self.superseded_violations

    @property
    def completed_twice_task_ids(self) -> tuple[str, ...]:
        return tuple(self.completed_twice)

    @property
    def duplicate_completions(self) -> int:
        return len(self.completed_twice)

    @property
    def unchecked(self) -> int:
        """Records missing or contradicting the protocol: tasks that ran without an ``enter``,
        sections of finished tasks left open, malformed events, rate-limited sections without
        their admission. Each hides what the replay should have compared, so any of them fails
        the verdict."""
        return (
            self.ran_without_section
            + self.unexplained_open_sections
            + len(self.malformed)
            + self.admissions_unread
        )

    @property
    def ok(self) -> bool:
        return (
            self.violations == 0
            and self.stale_writes_accepted == 0
            and self.lost == 0
            and self.leftover_nodes == 0
            and self.duplicate_completions == 0
            and self.unchecked == 0
        )

    def report_line(self) -> str:
        """The one-line verdict; the counts of what went unchecked are appended only when
        there are some (the line of a clean run keeps its form)."""
        line = (
            f"zklock-report: tasks={self.tasks} ran={self.ran} skipped={self.skipped} "
            f"failed={self.failed} lost={self.lost} violations={self.violations} "
            f"stale_writes_accepted={self.stale_writes_accepted} "
            f"leftover_nodes={self.leftover_nodes} broker_dropped={self.broker_dropped} "
            f"rate_violations={self.rate_violations} "
            f"duplicate_completions={self.duplicate_completions}"
        )
        if self.unchecked:
            line += (
                f" ran_without_section={self.ran_without_section} "
                f"unexplained_open_sections={self.unexplained_open_sections} "
                f"malformed={len(self.malformed)} admissions_unread={self.admissions_unread}"
            )
        return line

    def to_json(self) -> dict[str, Any]:
        """Every field, plus ``ok`` and ``report_line``, as JSON-safe values only (str keys,
        lists, numbers, strings, booleans, None): ``json.loads(json.dumps(d)) == d``."""
        data: dict[str, Any] = _plain(asdict(self))
        data["ok"] = self.ok
        data["broker_dropped"] = self.broker_dropped
        data["rate_violations"] = self.rate_violations
        data["superseded_violations"] = self.superseded_violations
        data["duplicate_completions"] = self.duplicate_completions
        data["unchecked"] = self.unchecked
        data["report_line"] = self.report_line()
        return data

    def summary_lines(self) -> list[str]:
        """A human summary: tasks, mutual exclusion, fencing, failures, faults and what followed
        them, timings; the last line is :meth:`report_line`."""
        return _summary(self)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ------------------------------------------------------------------------------------ replay


@dataclass
class _Section:
    enter: SectionEvent
    known_token: int | None
    """Highest accepted token of the key among writes recorded before this enter."""
    end: str | None = None
    """``"exit"`` or ``"killed"``; None while open."""
    died_unseen: bool = False
    """Closed by a ``late`` kill: its process was found dead at an unknown point before."""
    outcome: str | None = None
    forces: list[_Force] = field(default_factory=list)
    """The ``paused`` or ``expired`` events for its process recorded while it was open."""


@dataclass
class _Force:
    """A ``paused`` or ``expired`` event; ``survived`` once a ``survived`` event withdrew it."""

    event: SectionEvent
    survived: bool = False

    def excuses(self, entering: SectionEvent) -> bool:
        """Whether it may have taken the holder's session before ``entering`` was granted."""
        if self.survived:
            return False
        if self.event.kind == "expired":
            return True
        if self.event.valid_until is not None:  # the holder's own lease clock: exact
            return entering.time >= self.event.valid_until
        timeout = self.event.session_timeout
        return timeout is not None and (
            entering.time >= self.event.time + PAUSE_EXPIRY_FRACTION * timeout
        )


@dataclass
class _Replay:
    sections: dict[str, _Section] = field(default_factory=dict)
    inside: Exclusion[_Section] = field(default_factory=Exclusion)
    highest_accepted: dict[str, int] = field(default_factory=dict)
    last_section: dict[tuple[str, str], _Section] = field(default_factory=dict)
    """``(task id, key)`` -> the task's latest section of that key."""
    attempts_by_key: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(task id, key)`` -> sections entered: a section over several keys enters each once."""
    first_enter: dict[str, float] = field(default_factory=dict)
    raw_overlaps: list[tuple[int, _Section, tuple[tuple[_Section, tuple[_Force, ...]], ...]]] = (
        field(default_factory=list)
    )
    """``(position, entering section, ((conflicting section, its forces by then), ...))``."""
    pending_forces: dict[tuple[str, int], list[_Force]] = field(default_factory=dict)
    malformed: list[str] = field(default_factory=list)
    stale: list[SectionEvent] = field(default_factory=list)
    holds: list[float] = field(default_factory=list)
    exit_times: list[float] = field(default_factory=list)
    lost_exit_times: list[float] = field(default_factory=list)
    preempted: int = 0
    kill_times: list[tuple[float, int]] = field(default_factory=list)
    refused_times: list[float] = field(default_factory=list)
    accepted: int = 0
    writing_known: dict[str, int | None] = field(default_factory=dict)
    """Holder -> highest accepted token of its key among writes recorded before its
    ``writing`` event (None: none yet), for holders that recorded one."""
    admissions: list[Admission] = field(default_factory=list)
    admissions_unread: int = 0
    completions: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(task id, key)`` -> bodies that ran to their end (:data:`COMPLETED_OUTCOMES`)."""
    completed_in: dict[tuple[str, str], list[tuple[str, int, float, float]]] = field(
        default_factory=dict
    )
    """``(task id, key)`` -> (hostname, pid, enter time, exit time) of each completed body."""
    kills: list[tuple[str, int, float]] = field(default_factory=list)
    """(hostname, pid, time) of every process a fault killed."""

    def feed(self, position: int, event: SectionEvent) -> None:
        if event.kind == "killed":
            self._killed(event)
        elif event.kind in FORCED_LOSS_KINDS:
            self._forced(event)
        elif event.kind == "survived":
            for force in self.pending_forces.pop((event.hostname, event.pid), []):
                force.survived = True
        elif event.kind == "enter":
            self._enter(position, event)
        elif event.kind == "exit":
            self._exit(position, event)
        elif event.kind == "writing":
            self.writing_known[event.holder] = self.highest_accepted.get(event.key)
        else:
            self._write(event)

    def _killed(self, event: SectionEvent) -> None:
        closed = self.inside.close(lambda section: _same_process(section.enter, event))
        for section in closed:
            section.end = "killed"
            section.died_unseen = event.late
        self.kill_times.append((event.time, len(closed)))
        self.kills.append((event.hostname, event.pid, event.time))

    def _forced(self, event: SectionEvent) -> None:
        force = _Force(event)
        self.pending_forces.setdefault((event.hostname, event.pid), []).append(force)
        for _, section in self.inside:
            if _same_process(section.enter, event):
                section.forces.append(force)

    def _enter(self, position: int, event: SectionEvent) -> None:
        if event.holder in self.sections:
            self.malformed.append(f"#{position}: second enter of {event.holder}")
            return
        section = _Section(event, self.highest_accepted.get(event.key))
        self.sections[event.holder] = section
        # Entered after an ``expired`` event but before the close it announces could have
        # landed (it is recorded before the call): on the session being closed, as those open.
        for force in self.pending_forces.get((event.hostname, event.pid), []):
            recent = event.time - force.event.time <= EXPIRE_CALL_TIMEOUT
            if force.event.kind == "expired" and not force.survived and recent:
                section.forces.append(force)
        overlapped = self.inside.enter(event.key, event.holder, event.mode == "exclusive", section)
        self.last_section[(event.task_id, event.key)] = section
        self.attempts_by_key[(event.task_id, event.key)] += 1
        self.first_enter.setdefault(event.task_id, event.time)
        if event.rate is not None:
            if event.admitted is None:
                self.admissions_unread += 1
            else:
                self.admissions.append(
                    Admission(event.key, event.rate, event.admitted, event.holder)
                )
        if overlapped:
            self.raw_overlaps.append(
                (position, section, tuple((s, tuple(s.forces)) for _, s in overlapped))
            )

    def _exit(self, position: int, event: SectionEvent) -> None:
        section = self.inside.exit(event.key, event.holder)
        if section is None:
            self.malformed.append(f"#{position}: exit of {event.holder} without an open enter")
            return
        section.end = "exit"
        section.outcome = event.outcome
        if (event.outcome or "").startswith(COMPLETED_OUTCOMES):
            self.completions[(event.task_id, event.key)] += 1
            self.completed_in.setdefault((event.task_id, event.key), []).append(
                (event.hostname, event.pid, section.enter.time, event.time)
            )
        self.holds.append(max(0.0, event.time - section.enter.time))
        self.exit_times.append(event.time)
        if event.outcome == "lost":
            self.lost_exit_times.append(event.time)
        elif event.outcome == PREEMPTED_OUTCOME:
            self.preempted += 1

    def died_before_its_ack(self, task_id: str, key: str) -> bool:
        """Whether the process of the body's first completion was killed while it ran or
        within :data:`KILL_ACK_WINDOW` seconds of its end: its message may not have been
        acknowledged nor its result stored, and a copy running the body again is Celery's
        at-least-once, not a duplicate delivery of a call that had ended."""
        hostname, pid, entered, exited = self.completed_in[(task_id, key)][0]
        return any(
            (h, p) == (hostname, pid) and entered <= t <= exited + KILL_ACK_WINDOW
            for h, p, t in self.kills
        )

    @property
    def attempts(self) -> Counter[str]:
        """Task id -> its attempts: the sections it entered on any one key (a task over
        several keys enters each of them once per attempt)."""
        attempts: Counter[str] = Counter()
        for (task_id, _), count in self.attempts_by_key.items():
            attempts[task_id] = max(attempts[task_id], count)
        return attempts

    def _write(self, event: SectionEvent) -> None:
        if not event.accepted:
            self.refused_times.append(event.time)
            return
        self.accepted += 1
        section = self.sections.get(event.holder)
        known = section.known_token if section is not None else None
        # The fence's own answer, the writes recorded before the section entered, and (in
        # records that have it) those recorded before the write was sent: each reached the
        # fence before this write did, so a lower token is stale whatever the fence said.
        writing = self.writing_known.get(event.holder)
        bounds = [b for b in (event.previous_token, known, writing) if b is not None]
        if any(event.token < bound for bound in bounds):
            self.stale.append(event)
        self.highest_accepted[event.key] = max(
            event.token, self.highest_accepted.get(event.key, event.token)
        )


KILL_ACK_WINDOW = 10.0
"""Seconds after a body's end within which its process's death may still have come before
its message was acknowledged and its result stored (:meth:`_Replay.died_before_its_ack`)."""


def _same_process(a: SectionEvent, b: SectionEvent) -> bool:
    return (a.hostname, a.pid) == (b.hostname, b.pid)


def check_run(
    *,
    submitted: Mapping[str, float],
    outcomes: Mapping[str, TaskOutcome],
    events: Sequence[SectionEvent],
    faults: Sequence[FaultRecord],
    leftover_nodes: int,
    never_delivered: Collection[str] = (),
    never_received: Collection[str] | None = None,
    resent: Mapping[str, float] | None = None,
    unrelated: Collection[str] = (),
    done_at: Mapping[str, float] | None = None,
    gate: bool | None = None,
    gate_held_max: int | None = None,
) -> RunReport:
    """Check one run; see the module docstring for what each count means.

    ``submitted`` maps each task id sent to its submit time (``time.time()``); ``outcomes``
    holds the final states known at the end (a task missing from it is lost); ``events`` is the
    run's event list in Redis order; ``faults`` what the fault injector did; ``leftover_nodes``
    the znodes left under the lock root after the run; ``never_delivered`` the tasks without a
    final state that never started and whose message is not in the broker (counted as
    ``broker_dropped`` when submitted no later than the end of a ``broker_restart`` fault that
    ran and not received by a worker, else as lost; the load test passes none for a RabbitMQ
    broker, which has no window that drops a message, so that every task it lost counts as
    lost); ``never_received`` those of them that no worker's log shows received (counted as
    ``broker_dropped`` when submitted no later than a fault that killed a worker's main
    process, else as lost), or None when the workers' logs are not at hand (an external fleet:
    a broker restart then excuses every such task, and a consumer's death none); a task a
    worker received and that is then gone was lost by the worker, whatever the faults before
    it. A task whose message a worker sent to the broker again (a retry, a run's send-back in an
    outage, the gate's give-back at the broker's bound: ``resent``, the last such instant, from
    the workers' logs) is judged by that last copy: ``never_delivered`` and ``never_received``
    then mean "since then", and the windows above count from it; ``unrelated`` the
    submitted tasks of no lock (they run no section), ``done_at`` when each task's result was
    stored (``date_done``), for their latency; ``gate`` and ``gate_held_max`` are carried into
    the report as given.
    """
    done = done_at or {}
    replay = _Replay()
    for position, event in enumerate(events):
        replay.feed(position, event)

    def revoked(section: _Section, forces: tuple[_Force, ...], entering: _Section) -> bool:
        # An injected kill is recorded right after it landed, and a kill closes the section:
        # an overlap of a killed section was recorded before its kill, while it was alive.
        # Only a death found after the fact (``late``) may have come before the overlap.
        if section.died_unseen:
            return True
        if not any(force.excuses(entering.enter) for force in forces):
            return False
        # The fault is the excuse; the outcome only shows the holder learned of the loss. A
        # preempt alone never excuses: its holder must have exited before the newer call
        # entered, and then there is no overlap.
        if section.outcome in ("lost", PREEMPTED_OUTCOME):
            return True
        task = outcomes.get(section.enter.task_id)
        return (
            task is not None
            and task.state == "FAILURE"
            and (task.reason or "").startswith(LOST_REASON_PREFIX)
            and replay.last_section.get((section.enter.task_id, section.enter.key)) is section
        )

    overlaps = tuple(
        SectionOverlap(
            key=section.enter.key,
            position=position,
            entering=section.enter.holder,
            entering_mode=section.enter.mode,
            inside=tuple(s.enter.holder for s, _ in inside),
            revoked=all(revoked(s, forces, section) for s, forces in inside),
        )
        for position, section, inside in replay.raw_overlaps
    )
    tally = _tally(submitted, outcomes)
    restarts_end = max(
        (_restart_end(f) for f in faults if f.kind == "broker_restart" and f.ran), default=None
    )
    consumers_killed = max(
        (f.time for f in faults if f.ran and _killed_a_consumer(f)), default=None
    )
    unreceived = set(never_delivered if never_received is None else never_received)
    last_sent = {t: max(submitted[t], (resent or {}).get(t, 0.0)) for t in tally.lost}
    dropped = tuple(
        t
        for t in tally.lost
        if t in never_delivered
        and t in unreceived
        and (
            (restarts_end is not None and last_sent[t] <= restarts_end)
            or (
                never_received is not None
                and consumers_killed is not None
                and last_sent[t] <= consumers_killed
            )
        )
    )
    tally.lost = [t for t in tally.lost if t not in dropped]
    start = min(submitted.values(), default=min((e.time for e in events), default=0.0))
    attempts = replay.attempts
    overruns = rate_overruns(replay.admissions)
    completed_twice: dict[str, int] = {}
    for (task_id, key), count in replay.completions.items():
        if count > 1 and not replay.died_before_its_ack(task_id, key):
            completed_twice[task_id] = max(count, completed_twice.get(task_id, 0))
    superseded_ran = _superseded_ran(submitted, outcomes, replay)
    return RunReport(
        tasks=len(submitted),
        ran=len(tally.ran),
        skipped=tally.skipped,
        failed=sum(tally.failure_reasons.values()),
        lost=len(tally.lost),
        violations=sum(1 for o in overlaps if not o.revoked) + len(overruns) + len(superseded_ran),
        revoked_overlaps=sum(1 for o in overlaps if o.revoked),
        stale_writes_accepted=len(replay.stale),
        leftover_nodes=leftover_nodes,
        retried=sum(1 for n in attempts.values() if n > 1),
        revocations=len(replay.lost_exit_times),
        killed_sections=sum(s.end == "killed" for s in replay.sections.values()),
        open_sections=sum(s.end is None for s in replay.sections.values()),
        unexplained_open_sections=sum(
            s.end is None
            and (o := outcomes.get(s.enter.task_id)) is not None
            and o.state in FINAL_STATES
            for s in replay.sections.values()
        ),
        writes_accepted=replay.accepted,
        writes_refused=len(replay.refused_times),
        ran_without_section=sum(
            1 for t in tally.ran if t not in replay.first_enter and t not in unrelated
        ),
        failure_reasons=dict(tally.failure_reasons),
        failure_examples=tally.failure_examples,
        faults_by_kind=_count_faults(faults),
        fault_impacts=_fault_impacts(faults, replay, overlaps, events, tally.failed_at(done)),
        faults_not_run=tuple(sorted((f for f in faults if not f.ran), key=lambda f: f.time)),
        overlaps=overlaps,
        stale_writes=tuple(replay.stale),
        malformed=tuple(replay.malformed),
        lost_task_ids=tuple(tally.lost),
        wait_seconds=tuple(
            max(0.0, replay.first_enter[t] - at)
            for t, at in submitted.items()
            if t in replay.first_enter
        ),
        hold_seconds=tuple(replay.holds),
        throughput=_per_second(replay.exit_times, start),
        attempts=dict(attempts),
        broker_dropped_task_ids=dropped,
        unrelated=len(unrelated),
        unrelated_latency_seconds=tuple(
            max(0.0, done[t] - submitted[t])
            for t in unrelated
            if t in submitted and t in done and (o := outcomes.get(t)) and o.state == "SUCCESS"
        ),
        preempted=replay.preempted,
        gate=gate,
        gate_held_max=gate_held_max,
        rate_overruns=overruns,
        rate_admissions=len(replay.admissions),
        admissions_unread=replay.admissions_unread,
        completed_twice=completed_twice,
        skip_reasons=dict(tally.skip_reasons),
        superseded_ran=superseded_ran,
    )


def _superseded_ran(
    submitted: Mapping[str, float], outcomes: Mapping[str, TaskOutcome], replay: _Replay
) -> tuple[str, ...]:
    """See :attr:`RunReport.superseded_ran`."""
    sections: dict[str, list[_Section]] = {}
    for section in replay.sections.values():
        sections.setdefault(section.enter.task_id, []).append(section)
    problems = []
    for task_id in submitted:
        outcome = outcomes.get(task_id)
        if outcome is None or outcome.skip_reason not in SUPERSEDED_REASONS:
            continue
        what = f"task {task_id} ({outcome.skip_reason} by {outcome.skipped_for})"
        for section in sections.get(task_id, ()):
            if section.end != "killed":
                ended = "still open" if section.end is None else f"exit {section.outcome}"
                problems.append(f"{what} entered its section {section.enter.holder} on "
                                f"{section.enter.key} ({ended})")  # fmt: skip
        if outcome.skipped_for == task_id or outcome.skipped_for not in submitted:
            problems.append(f"{what} names no other call of the run")
    return tuple(problems)


# -------------------------------------------------------------------------------- accounting


_DOWN = re.compile(r"\bdown (\d+(?:\.\d+)?) s\b")


def _restart_end(fault: FaultRecord) -> float:
    """When a broker restart was over: its ``ended`` time; in records without one, its start
    plus the downtime its detail gives (``down N s``), else its start."""
    if fault.ended is not None:
        return fault.ended
    down = _DOWN.search(fault.detail)
    return fault.time + (float(down.group(1)) if down else 0.0)


def _killed_a_consumer(fault: FaultRecord) -> bool:
    """Whether ``fault`` killed a worker's main process, the one that takes messages from the
    broker: one it had popped and not yet recorded as delivered is gone (see ``broker_dropped``)."""
    return fault.kind == "kill_held" or (
        fault.kind == "kill" and fault.detail.startswith(MAIN_PROCESS_KILL)
    )


@dataclass
class _Tally:
    ran: list[str] = field(default_factory=list)
    skipped: int = 0
    skip_reasons: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    failure_reasons: Counter[str] = field(default_factory=Counter)
    failure_examples: dict[str, str] = field(default_factory=dict)
    failure_kinds: dict[str, str] = field(default_factory=dict)
    """Task id -> its failure's kind, for the failed tasks."""

    def failed_at(self, done_at: Mapping[str, float]) -> list[tuple[float, str]]:
        """(when its result was stored, failure kind) of each failed task whose time is known."""
        return sorted(
            (done_at[task_id], kind)
            for task_id, kind in self.failure_kinds.items()
            if task_id in done_at
        )


def _tally(submitted: Mapping[str, float], outcomes: Mapping[str, TaskOutcome]) -> _Tally:
    tally = _Tally()
    for task_id in submitted:
        outcome = outcomes.get(task_id)
        if outcome is None or outcome.state not in FINAL_STATES:
            tally.lost.append(task_id)
        elif outcome.state == "SUCCESS":
            if outcome.skipped:
                tally.skipped += 1
                tally.skip_reasons[outcome.skip_reason or "?"] += 1
            else:
                tally.ran.append(task_id)
        else:
            reason = outcome.reason or outcome.state
            kind = reason.split(":", 1)[0].strip() or outcome.state
            if kind == LOST_REASON_PREFIX and PREEMPTED in reason:
                kind = PREEMPTED_FAILURE
            tally.failure_reasons[kind] += 1
            tally.failure_examples.setdefault(kind, reason)
            tally.failure_kinds[task_id] = kind
    return tally


def _count_faults(faults: Sequence[FaultRecord]) -> dict[str, FaultCount]:
    counts: dict[str, FaultCount] = {}
    for fault in faults:
        injected, failed = counts.get(fault.kind, FaultCount(0, 0))
        counts[fault.kind] = FaultCount(injected + fault.ran, failed + (not fault.ran))
    return counts


def _fault_impacts(
    faults: Sequence[FaultRecord],
    replay: _Replay,
    overlaps: Sequence[SectionOverlap],
    events: Sequence[SectionEvent],
    failed_at: Sequence[tuple[float, str]] = (),
) -> tuple[FaultImpact, ...]:
    ordered = sorted((f for f in faults if f.ran), key=lambda f: f.time)
    overlap_times = [events[o.position].time for o in overlaps if o.revoked]
    impacts = []
    for index, fault in enumerate(ordered):
        until = ordered[index + 1].time if index + 1 < len(ordered) else math.inf
        impacts.append(
            FaultImpact(
                fault=fault,
                lost_sections=_count_between(replay.lost_exit_times, fault.time, until),
                killed_sections=sum(n for t, n in replay.kill_times if fault.time <= t < until),
                revoked_overlaps=_count_between(overlap_times, fault.time, until),
                refused_writes=_count_between(replay.refused_times, fault.time, until),
                failures=dict(Counter(kind for t, kind in failed_at if fault.time <= t < until)),
            )
        )
    return tuple(impacts)


def _count_between(times: Sequence[float], since: float, before: float) -> int:
    return sum(1 for t in times if since <= t < before)


def _per_second(times: Sequence[float], start: float) -> tuple[int, ...]:
    if not times:
        return ()
    if max(times) - start > MAX_SERIES_SECONDS:
        # Submit times and event times from unrelated clocks: count from the first exit instead
        # of building a series of millions of empty seconds.
        start = min(times)
    buckets = Counter(max(0, int(t - start)) for t in times)
    return tuple(buckets.get(second, 0) for second in range(max(buckets) + 1))


# ----------------------------------------------------------------------------------- summary


def _summary(report: RunReport) -> list[str]:
    r = report
    lines = [
        f"tasks: {r.tasks} submitted; ran {r.ran}, skipped {r.skipped}, failed {r.failed}, "
        f"lost {r.lost}; {r.retried} entered their section more than once (retry/redelivery)",
    ]
    if r.lost_task_ids:
        lines.append("  lost (no final state): " + _first(r.lost_task_ids))
    if r.broker_dropped_task_ids:
        lines.append(
            f"  dropped by the broker across its restarts or a consumer's death (never "
            f"started, message gone): "
            f"{r.broker_dropped} ({_first(r.broker_dropped_task_ids)})"
        )
    if r.ran_without_section:
        lines.append(f"  {r.ran_without_section} ran without an enter record (records missing)")
    lines.append(
        f"sections: {len(r.hold_seconds)} exited, {r.revocations} of them after losing the lock"
        + (f", {r.preempted} preempted by a newer call" if r.preempted else "")
        + f"; {r.killed_sections} killed, {r.open_sections} never closed"
        + (
            f" ({r.unexplained_open_sections} of them of tasks that ended: records missing)"
            if r.unexplained_open_sections
            else ""
        )
    )
    if r.completed_twice:
        lines.append(
            f"  bodies completed more than once: {r.duplicate_completions} ("
            + _first([f"{t} x{n}" for t, n in r.completed_twice.items()])
            + ")"
        )
    lines.append(
        f"mutual exclusion: {r.exclusion_violations} violations; {r.revoked_overlaps} revoked "
        "overlaps "
        "(the holder inside was killed, or paused or expired by a fault, and ended with its "
        "lock lost: the fence covers that window)"
    )
    for overlap in [o for o in r.overlaps if not o.revoked][:10]:
        lines.append(
            f"  violation at event #{overlap.position}: {overlap.entering} "
            f"({overlap.entering_mode}) entered {overlap.key} while "
            f"{', '.join(overlap.inside)} held it"
        )
    if r.rate_admissions or r.admissions_unread:
        lines.append(
            f"rate limits: {r.rate_admissions} admissions checked (ZooKeeper ctimes), "
            f"{r.rate_violations} over their rate in one period"
            + (f"; {r.admissions_unread} not read (unchecked)" if r.admissions_unread else "")
        )
    for overrun in r.rate_overruns[:10]:
        lines.append(f"  rate violation: {overrun.describe()}")
    if r.superseded or r.superseded_ran:
        lines.append(
            f"superseded calls: {r.skip_reasons.get('debounced', 0)} debounced, "
            f"{r.skip_reasons.get('replaced', 0)} replaced (skipped, a newer call ran instead); "
            f"{r.superseded_violations} violations (superseded and run, or naming no call)"
        )
    for problem in r.superseded_ran[:10]:
        lines.append(f"  superseded violation: {problem}")
    lines.append(
        f"fenced writes: {r.writes_accepted} accepted, {r.writes_refused} refused; "
        f"{r.stale_writes_accepted} stale writes accepted"
    )
    for event in r.stale_writes[:10]:
        lines.append(
            f"  stale write accepted: {event.holder} on {event.key} "
            f"(previous token {event.previous_token})"
        )
    for kind, count in sorted(r.failure_reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"failure: {kind} x{count}, e.g. {r.failure_examples[kind]}")
    lines.extend(_fault_lines(r))
    for name, values in (("wait", r.wait_seconds), ("hold", r.hold_seconds)):
        if values:
            lines.append(
                f"{name} time: p50 {_quantile(values, 0.5):.3f} s, "
                f"p95 {_quantile(values, 0.95):.3f} s, max {max(values):.3f} s"
            )
    if r.unrelated:
        lines.append(_unrelated_line(r))
    if r.throughput:
        lines.append(
            f"throughput: {sum(r.throughput) / len(r.throughput):.1f} exits/s over "
            f"{len(r.throughput)} s, peak {max(r.throughput)}/s"
        )
    if r.malformed:
        lines.append(f"malformed records: {len(r.malformed)}: " + _first(r.malformed))
    lines.append(f"leftover znodes under the lock root: {r.leftover_nodes}")
    lines.append(r.report_line())
    return lines


def _unrelated_line(r: RunReport) -> str:
    """The unrelated tasks' latency, and the gate it was measured with."""
    gate = {True: "on", False: "off", None: "unknown"}[r.gate]
    held = "" if r.gate_held_max is None else f", at most {r.gate_held_max} held at once"
    values = r.unrelated_latency_seconds
    latency = (
        f"p50 {_quantile(values, 0.5):.3f} s, p95 {_quantile(values, 0.95):.3f} s, "
        f"p99 {_quantile(values, 0.99):.3f} s, max {max(values):.3f} s"
        if values
        else "none finished"
    )
    return f"unrelated tasks (no lock): {r.unrelated}, send to result {latency} (gate {gate}{held})"


def _fault_lines(r: RunReport) -> list[str]:
    if not r.faults_by_kind:
        return ["faults: none injected"]
    lines = [
        "faults: "
        + ", ".join(
            f"{kind} {c.injected}"
            + (f" ({c.could_not_run} could not run)" if c.could_not_run else "")
            for kind, c in sorted(r.faults_by_kind.items())
        )
    ]
    for impact in r.fault_impacts:
        f = impact.fault
        lines.append(
            f"  {f.kind} {f.target}: {f.detail}; until the next fault: "
            f"{impact.lost_sections} sections lost their lock, {impact.killed_sections} killed, "
            f"{impact.revoked_overlaps} revoked overlaps, {impact.refused_writes} writes refused"
            + impact.failures_text()
        )
    for fault in r.faults_not_run:
        lines.append(f"  {fault.kind} NOT RUN: {fault.detail}")
    return lines


def _first(items: Sequence[str], limit: int = 10) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
