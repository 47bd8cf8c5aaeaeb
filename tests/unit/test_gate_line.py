"""The gate's dispatch rule (celery_zklock.worker.gate.line), pure: when a held message may go to
the pool, for each lock kind, given the lock's queue and what this worker already sent."""

from __future__ import annotations

from celery_zklock.locks.contenders import READ, WRITE, lock_kind, queue_of
from celery_zklock.worker.gate.line import Held, KeyLine, may_enter

WRITER = "_c_a-__WRIT__0000000001"
READER = "_c_b-__READ__0000000002"
LEASE = "_c_c-lock-0000000003"


def test_writer_needs_a_free_lock_and_nothing_sent() -> None:
    assert may_enter(WRITE, [], [])
    assert not may_enter(WRITE, queue_of([READER]), [])
    assert not may_enter(WRITE, [], [WRITE])  # one sent writer per worker and grant
    assert not may_enter(WRITE, [], [READ])


def test_reader_is_not_held_behind_readers() -> None:
    assert may_enter(READ, queue_of([READER]), [READ, READ])
    assert not may_enter(READ, queue_of([WRITER]), [])
    assert not may_enter(READ, queue_of([READER]), [WRITE])


def test_semaphore_admits_up_to_its_limit() -> None:
    two = lock_kind("semaphore", 2)
    assert may_enter(two, queue_of([LEASE]), [two])
    assert not may_enter(two, queue_of([LEASE, "_c_d-lock-0000000004"]), [])
    assert not may_enter(two, [], [two, two])


def next_ready(line: KeyLine) -> Held | None:
    """The head of the line if it may go to the pool now, taken (as the gate's ``_advance``)."""
    return line.held.popleft() if line.head_ready() else None


def test_line_releases_in_arrival_order_and_one_writer_per_grant() -> None:
    line = KeyLine("/zklock/t/k")
    first, second = Held("r1", WRITE, 1.0), Held("r2", WRITE, 2.0)
    line.held.extend([first, second])
    assert next_ready(line) is None  # queue not read yet
    line.queue = []
    assert next_ready(line) is first
    line.sent["r1"] = WRITE
    assert next_ready(line) is None  # r1 has not ended
    line.forget_ended({"r1"})  # still running
    assert next_ready(line) is None
    line.forget_ended(set())  # r1 ended
    assert next_ready(line) is second
    assert not line.held and not line.sent  # nothing held, nothing sent: the gate forgets it


class _Request:
    """A worker request as a line keeps it: hashed by identity, with its task ``id``."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_a_sent_run_whose_named_node_went_no_longer_holds_the_next_back() -> None:
    """The node the gate named as the holder is gone from the queue: the sent run of that task
    id released its lock, and the next message may go while that run still ends; a later run of
    the same task id (a retry) is not forgotten for it."""
    run, other = _Request("t1"), _Request("t2")
    line = KeyLine("/zklock/t/k", queue=queue_of([WRITER]), holder="t1", named=WRITER)
    waiting = Held("r2", WRITE, 2.0)
    line.held.append(waiting)
    line.sent.update({run: WRITE, other: WRITE})
    line.forget_released()
    assert set(line.sent) == {run, other}  # the named node is still there
    line.queue = []
    line.forget_released()
    assert set(line.sent) == {other}  # t1's run released; t2's has not been seen go
    del line.sent[other]
    assert next_ready(line) is waiting
    retry = _Request("t1")
    line.sent[retry] = WRITE
    line.forget_released()
    assert set(line.sent) == {retry}  # once per named node
    unnamed = KeyLine("/zklock/t/k", queue=[], holder="", named=WRITER)
    unnamed.sent[run] = WRITE
    unnamed.forget_released()
    assert set(unnamed.sent) == {run}  # not a task run's node: nothing to forget


def test_readers_behind_a_held_writer_keep_their_turn() -> None:
    line = KeyLine("/zklock/t/k", queue=queue_of([READER]))
    writer, reader = Held("w", WRITE, 1.0), Held("r", READ, 2.0)
    line.held.extend([writer, reader])
    assert next_ready(line) is None  # the writer is first in line, and blocked by the reader
    assert list(line.held) == [writer, reader]


def test_a_line_goes_back_to_the_broker_from_the_first_message_at_its_bound() -> None:
    """At the broker bound of one held message, it and every message behind it leave together,
    in line order (none may overtake another of its key); those ahead of it stay."""
    line = KeyLine("/zklock/t/k")
    first = Held("r1", WRITE, 1.0, bound_at=20.0)
    second = Held("r2", WRITE, 2.0, bound_at=10.0)  # received earlier (an ETA message)
    third = Held("r3", WRITE, 3.0, bound_at=30.0)
    line.held.extend([first, second, third])
    assert line.take_due(9.0) == []
    assert line.take_due(10.0) == [second, third]
    assert list(line.held) == [first]


def test_a_timed_out_message_goes_first_at_a_free_slot_and_stays_held_until_then() -> None:
    """Its run applies ``lock_on_timeout``: it goes ahead of the busy head, whatever the queue
    (here unread), but stays in the line, its broker bound running, until the gate has a free
    pool slot for it (:meth:`KeyLine.next_ready`)."""
    line = KeyLine("/zklock/t/k")
    first = Held("r1", WRITE, 1.0, bound_at=100.0, timeout_at=50.0)
    second = Held("r2", WRITE, 2.0, bound_at=100.0, timeout_at=5.0)
    line.held.extend([first, second])
    assert first.next_at == 50.0 and second.next_at == 5.0
    assert line.next_ready() is None and not line.going
    assert line.take_due(5.0) == []
    assert line.going and (first.go, second.go) == (False, True)
    assert line.next_ready() is second and list(line.held) == [first, second]
    assert line.take_due(100.0) == [first, second]  # the bound wins: back to the broker
