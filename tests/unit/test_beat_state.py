"""The pure part of the leader beat (celery_zklock.beat): the state document, merging stored last
runs into Celery's entries, and one term of leadership driving Celery's own Scheduler against an
in-memory broker, a stand-in lease and a stand-in state node (no server)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from itertools import count

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler

from celery_zklock.beat import (
    BeatSettings,
    RunRecord,
    apply_records,
    decode_state,
    encode_state,
    record_of,
)
from celery_zklock.beat.election import NotLeader, ensure_held
from celery_zklock.beat.scheduler import Term, guarded_producer, scheduler_class
from celery_zklock.beat.state import Superseded
from celery_zklock.errors import ConfigurationError
from celery_zklock.zk.settings import forget_settings, settings_of

UTC = timezone.utc
_queues = count()


class StandInLease:
    """A lease that turns lost after ``held_reads`` reads of :attr:`held` (never by default)."""

    def __init__(self, token: int = 7, held_reads: int | None = None) -> None:
        self.token = token
        self.reads = 0
        self._held_reads = held_reads

    @property
    def held(self) -> bool:
        self.reads += 1
        return self._held_reads is None or self.reads <= self._held_reads

    @property
    def lost(self) -> bool:
        return self._held_reads is not None and self.reads > self._held_reads

    @property
    def lost_reason(self) -> str | None:
        return "clock ran out" if self._held_reads is not None else None


class StandInState:
    """The state node: a document in memory, every write kept; ``superseded`` refuses writes."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data
        self.writes: list[bytes] = []
        self.superseded = False

    def load(self) -> dict[str, RunRecord]:
        return decode_state(self.data)

    def save(self, data: bytes) -> None:
        if self.superseded:
            raise Superseded("another leader wrote")
        self.data = data
        self.writes.append(data)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("unit-beat", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = "127.0.0.1:1"
    yield app
    app.close()


def queue_size(app: Celery, queue: str) -> int:
    with app.connection_for_write() as connection:
        simple = connection.SimpleQueue(queue)
        try:
            return int(simple.qsize())
        finally:
            simple.close()


def term_for(
    app: Celery, lease: StandInLease, store: StandInState, every: float = 1.0
) -> tuple[Term, str]:
    """A term over Celery's own Scheduler with one entry "job" sent to a fresh queue."""
    queue = f"beat-unit-{next(_queues)}"
    app.conf.beat_schedule = {
        "job": {"task": "unit.job", "schedule": every, "options": {"queue": queue}}
    }
    producer = guarded_producer(app.amqp.Producer, lambda: ensure_held(lease))
    scheduler = Scheduler(app, Producer=producer)
    return Term(lease, scheduler, store, threading.RLock(), "host:1"), queue


def stored(last_run_at: datetime, total: int) -> StandInState:
    records = {"job": RunRecord(last_run_at, total)}
    return StandInState(encode_state(records, leader="old:1", token=3, written_at=last_run_at))


# -- the document -------------------------------------------------------------------------------


def test_state_document_round_trips_aware_and_naive_times_as_utc() -> None:
    paris = timezone(timedelta(hours=2))
    records = {
        "aware": RunRecord(datetime(2024, 5, 1, 12, 0, 0, 250000, tzinfo=paris), 3),
        "naive-utc": RunRecord(datetime(2024, 5, 1, 10, 0, 1), 0),
    }
    data = encode_state(records, leader="h:1", token=99, written_at=datetime(2024, 5, 1))
    decoded = decode_state(data)
    assert decoded == {
        "aware": RunRecord(datetime(2024, 5, 1, 10, 0, 0, 250000, tzinfo=UTC), 3),
        "naive-utc": RunRecord(datetime(2024, 5, 1, 10, 0, 1, tzinfo=UTC), 0),
    }
    assert all(record.last_run_at.tzinfo is not None for record in decoded.values())
    assert b'"token": 99' in data and b'"leader": "h:1"' in data


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[]", b'{"format": 2, "entries": {}}', b'{"format": 1}',
     b'{"format": 1, "entries": {"a": {"last_run_at": "yesterday", "total_run_count": 1}}}'],
)  # fmt: skip
def test_anything_else_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a celery-zklock beat state document"):
        decode_state(data)


def test_an_empty_node_holds_no_records() -> None:
    assert decode_state(b"") == {}


# -- merging into entries -----------------------------------------------------------------------


def test_stored_runs_replace_the_entries_own_and_keep_their_convention(app: Celery) -> None:
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    entries = {
        "aware": ScheduleEntry("aware", "t", last_run_at=now, schedule=10.0, app=app),
        "naive": ScheduleEntry("naive", "t", last_run_at=now.replace(tzinfo=None), schedule=10.0,
                               app=app),
        "unrecorded": ScheduleEntry("unrecorded", "t", last_run_at=now, schedule=10.0, app=app),
    }  # fmt: skip
    earlier = now - timedelta(seconds=30)
    records = {
        "aware": RunRecord(earlier, 5),
        "naive": RunRecord(earlier, 2),
        "gone-from-the-schedule": RunRecord(earlier, 1),
    }
    assert sorted(apply_records(entries, records)) == ["aware", "naive"]
    assert entries["aware"].last_run_at == earlier and entries["aware"].total_run_count == 5
    assert entries["naive"].last_run_at == earlier.replace(tzinfo=None)
    assert entries["naive"].last_run_at.tzinfo is None
    assert entries["unrecorded"].last_run_at == now  # no record: the scheduler's own
    assert apply_records(entries, records) == []  # applied already: nothing changes
    assert record_of(entries["naive"]) == RunRecord(earlier, 2)


def test_due_times_missed_during_a_takeover_are_coalesced_into_one_send(app: Celery) -> None:
    now = datetime.now(UTC)
    entry = ScheduleEntry("job", "t", schedule=1.0, app=app)
    apply_records({"job": entry}, {"job": RunRecord(now - timedelta(seconds=5.5), 10)})
    assert entry.is_due()[0]  # five due times passed: Celery says "due", once
    sent = next(entry)
    assert not sent.is_due()[0] and sent.total_run_count == 11


# -- a term of leadership -----------------------------------------------------------------------


def test_a_term_restores_the_stored_last_run_and_sends_nothing_before_it_is_due(
    app: Celery,
) -> None:
    last = datetime.now(UTC) - timedelta(seconds=0.5)
    store = stored(last, 41)
    term, queue = term_for(app, StandInLease(token=8), store)
    term.claim()
    assert term.scheduler.schedule["job"].last_run_at == last  # not the fresh entry's "now"
    assert decode_state(store.writes[0]) == {"job": RunRecord(last, 41)}
    assert b'"token": 8' in store.writes[0]  # the claim fences older leaders
    delay = term.tick()
    assert 0 < delay <= 0.5 and queue_size(app, queue) == 0


def test_a_term_sends_an_overdue_entry_once_and_records_it(app: Celery) -> None:
    store = stored(datetime.now(UTC) - timedelta(seconds=5), 41)
    term, queue = term_for(app, StandInLease(), store)
    term.claim()
    before = datetime.now(UTC)
    assert term.tick() == 0  # Celery's tick: one send, then look again at once
    assert term.tick() > 0.5
    assert queue_size(app, queue) == 1
    record = decode_state(store.data)["job"]
    assert record.total_run_count == 42 and record.last_run_at >= before
    assert len(store.writes) == 2  # the claim, then the send's record


def test_a_lost_lease_sends_nothing_and_records_nothing(app: Celery) -> None:
    store = stored(datetime.now(UTC) - timedelta(seconds=5), 41)
    lease = StandInLease()
    term, queue = term_for(app, lease, store)
    term.claim()
    lease._held_reads = lease.reads  # lost from the next read of the clock on
    with pytest.raises(NotLeader, match="clock ran out"):
        term.tick()
    assert queue_size(app, queue) == 0
    assert len(store.writes) == 1 and decode_state(store.data)["job"].total_run_count == 41


def test_a_lease_lost_between_the_send_check_and_the_publish_stops_the_publish(
    app: Celery,
) -> None:
    store = stored(datetime.now(UTC) - timedelta(seconds=5), 41)
    lease = StandInLease()
    term, queue = term_for(app, lease, store)
    term.claim()
    # reserve and apply_async read the clock; the producer's read is the one that finds it lost
    lease._held_reads = lease.reads + 2
    with pytest.raises(NotLeader):
        term.tick()
    assert lease.reads >= lease._held_reads + 1
    assert queue_size(app, queue) == 0
    assert decode_state(store.data)["job"].total_run_count == 41


def test_a_stop_raised_inside_a_send_is_not_replaced_by_the_lost_lease(app: Celery) -> None:
    # celery beat's SIGTERM handler raises SystemExit wherever the main thread is; if the lease
    # is gone by then, the record's NotLeader must not replace it (LeaderScheduler.tick catches
    # NotLeader, and the beat would keep running).
    store = stored(datetime.now(UTC) - timedelta(seconds=5), 41)
    lease = StandInLease()
    term, queue = term_for(app, lease, store)
    term.claim()

    def stopped_in_the_send(*args: object, **kwargs: object) -> None:
        lease._held_reads = lease.reads  # released under the send from here on
        raise SystemExit()

    term._apply_async = stopped_in_the_send
    with pytest.raises(SystemExit):
        term.tick()
    assert len(store.writes) == 1 and queue_size(app, queue) == 0  # the lease was gone


def test_a_state_written_by_another_beat_makes_this_one_step_down(app: Celery) -> None:
    store = stored(datetime.now(UTC) - timedelta(seconds=5), 41)
    term, queue = term_for(app, StandInLease(), store)
    term.claim()
    store.superseded = True
    with pytest.raises(NotLeader, match="another beat wrote"):
        term.tick()
    # published before the write was refused: the documented window (at-least-once)
    assert queue_size(app, queue) == 1


def test_an_entry_never_sent_keeps_its_first_seen_time_across_takeovers(app: Celery) -> None:
    # A single beat with a shelve counts a new entry's first interval from when it first saw
    # it; a takeover must not start it afresh (takeovers more frequent than the interval would
    # then never send it).
    store = StandInState()
    before = datetime.now(UTC)
    first, queue = term_for(app, StandInLease(token=1), store, every=60.0)
    first.claim()
    first_seen = decode_state(store.data)["job"]
    assert first_seen.total_run_count == 0 and first_seen.last_run_at >= before
    assert first.tick() > 59 and queue_size(app, queue) == 0
    first.close()

    for token in (2, 3):  # takeovers, each with a fresh scheduler whose entry says "now"
        lease = StandInLease(token=token)
        producer = guarded_producer(app.amqp.Producer, lambda lease=lease: ensure_held(lease))
        term = Term(lease, Scheduler(app, Producer=producer), store, threading.RLock(), "h:2")
        term.claim()
        assert term.scheduler.schedule["job"].last_run_at == first_seen.last_run_at
        assert decode_state(store.data)["job"] == first_seen
        term.close()

    # The same entry first seen 61 s ago (one period passed, no leader ever sent it): due once,
    # now, as a shelve that old would make it; then a period from that send.
    store = StandInState(
        encode_state(
            {"job": RunRecord(before - timedelta(seconds=61), 0)},
            leader="old:1",
            token=3,
            written_at=before,
        )
    )
    term, queue = term_for(app, StandInLease(token=4), store, every=60.0)
    term.claim()
    assert term.tick() == 0 and term.tick() > 59
    assert queue_size(app, queue) == 1
    assert decode_state(store.data)["job"].total_run_count == 1


def test_an_entry_added_later_counts_from_when_it_was_first_seen(app: Celery) -> None:
    # Its baseline is its own first sighting, not the first claim of the schedule: an entry
    # added to an old schedule is not due at once.
    long_ago = datetime.now(UTC) - timedelta(days=3)
    store = stored(long_ago, 41)  # "job", sent long ago: due now
    term, queue = term_for(app, StandInLease(), store, every=3600.0)
    added = ScheduleEntry("added", "unit.job", schedule=3600.0, app=app,
                          options={"queue": queue})  # fmt: skip
    term.scheduler.schedule["added-at-start"] = added
    term.claim()
    records = decode_state(store.data)
    assert records["job"] == RunRecord(long_ago, 41)
    assert records["added-at-start"].total_run_count == 0
    assert records["added-at-start"].last_run_at > long_ago + timedelta(days=2)
    assert term.tick() == 0  # "job" is due: one send
    # An entry that shows up in the middle of a term (a scheduler reloading its schedule) is
    # recorded at the next tick, with the time its scheduler first saw it.
    term.scheduler.schedule["added-mid-term"] = ScheduleEntry(
        "added-mid-term", "unit.job", schedule=3600.0, app=app, options={"queue": queue}
    )
    assert term.tick() == term.scheduler.max_interval  # nothing due within it
    records = decode_state(store.data)
    assert records["added-mid-term"].total_run_count == 0
    assert records["job"].total_run_count == 42
    assert queue_size(app, queue) == 1  # only "job": neither new entry is due


def test_a_claim_that_keeps_losing_the_version_race_does_not_lead(app: Celery) -> None:
    store = StandInState()
    store.superseded = True
    term, _ = term_for(app, StandInLease(), store)
    with pytest.raises(NotLeader, match="kept changing"):
        term.claim()


# -- settings -----------------------------------------------------------------------------------


def test_settings_name_the_group_after_the_app_or_the_setting(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZKLOCK_BEAT_NAME", raising=False)
    monkeypatch.delenv("ZKLOCK_BEAT_SCHEDULER", raising=False)
    monkeypatch.delenv("ZKLOCK_ROOT", raising=False)
    settings = settings_of(app).beat
    assert settings == BeatSettings("/zklock", "unit-beat", "celery.beat:PersistentScheduler")
    assert settings.election == "/zklock/beat/unit-beat/leader"
    assert settings.state == "/zklock/beat/unit-beat/schedule"
    monkeypatch.setenv("ZKLOCK_BEAT_NAME", "from-env")
    assert settings_of(app).beat is settings  # read once per app
    forget_settings(app)
    assert settings_of(app).beat.name == "from-env"
    app.conf.zklock_beat_name = "billing"
    app.conf.zklock_beat_scheduler = "celery.beat.Scheduler"
    forget_settings(app)
    assert settings_of(app).beat == BeatSettings("/zklock", "billing", "celery.beat.Scheduler")
    assert scheduler_class(settings_of(app).beat.scheduler) is Scheduler


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("zklock_beat_name", "a/b", "one znode name"),
        ("zklock_beat_name", "..", "one znode name"),
        ("zklock_beat_scheduler", "celery_zklock.beat:LeaderScheduler", "not LeaderScheduler"),
    ],
)
def test_bad_settings_are_refused_by_name(
    app: Celery, setting: str, value: str, message: str
) -> None:
    app.conf[setting] = value
    with pytest.raises(ConfigurationError, match=message):
        _ = settings_of(app).beat


def test_a_scheduler_that_cannot_be_imported_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        scheduler_class("no_such_module_here:Scheduler")
    with pytest.raises(ConfigurationError, match="not a celery beat scheduler"):
        scheduler_class("celery_zklock.beat:encode_state")
