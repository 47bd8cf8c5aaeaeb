"""Highly available ``celery beat``: every beat process runs
``celery -A proj beat -S celery_zklock.beat:LeaderScheduler``, one is elected through a
ZooKeeper lock (:mod:`~celery_zklock.beat.election`) and only it sends
(:mod:`~celery_zklock.beat.scheduler`), recording each send in the schedule's state kept in
ZooKeeper (:mod:`~celery_zklock.beat.state`) so that the next leader neither repeats a recorded
send nor skips a due time. The settings, the guarantees and their limits: ``docs/beat.md``.
"""

from __future__ import annotations

from celery_zklock.beat.scheduler import LeaderScheduler
from celery_zklock.beat.state import (
    RunRecord,
    apply_record,
    apply_records,
    decode_state,
    encode_state,
    record_of,
    records_of_new_entries,
)
from celery_zklock.zk.settings import DEFAULT_BEAT_SCHEDULER as DEFAULT_SCHEDULER
from celery_zklock.zk.settings import BeatSettings

__all__ = [
    "DEFAULT_SCHEDULER",
    "BeatSettings",
    "LeaderScheduler",
    "RunRecord",
    "apply_record",
    "apply_records",
    "decode_state",
    "encode_state",
    "record_of",
    "records_of_new_entries",
]
