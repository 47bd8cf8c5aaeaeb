"""Highly available ``celery beat`` (being split into a package: see beat/scheduler.py)."""

from __future__ import annotations

from celery_zklock.beat.scheduler import (
    DEFAULT_SCHEDULER,
    BeatSettings,
    LeaderScheduler,
    NotLeader,
    RunRecord,
    Superseded,
    Term,
    ZooKeeperState,
    apply_record,
    apply_records,
    beat_settings,
    decode_state,
    encode_state,
    ensure_held,
    guarded_producer,
    record_of,
    records_of_new_entries,
    scheduler_class,
)

__all__ = [
    "DEFAULT_SCHEDULER",
    "BeatSettings",
    "LeaderScheduler",
    "NotLeader",
    "RunRecord",
    "Superseded",
    "Term",
    "ZooKeeperState",
    "apply_record",
    "apply_records",
    "beat_settings",
    "decode_state",
    "encode_state",
    "ensure_held",
    "guarded_producer",
    "record_of",
    "records_of_new_entries",
    "scheduler_class",
]
