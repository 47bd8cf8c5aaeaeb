"""The ``zklock_held`` replies as ``celery zklock locks`` reads them: this version's (each held
message named) and an older worker's (counts only, during a rolling deploy), alone and mixed.
Pure: the replies as the broadcast returns them (real workers: tests/task/test_waiters_named.py)."""

from __future__ import annotations

import json

from celery_zklock.ops.commands.render import held_document, held_table
from celery_zklock.worker.gate.step import HeldMessage, merge_held

PATH = "/app/sync/account_id=42~ab"
OTHER = "/app/sync/account_id=7~cd"


def named(*messages: tuple[str, float]) -> dict[str, object]:
    """This version's reply for one path: ``messages`` are (task id, held for), in line order."""
    return {
        "held": len(messages),
        "oldest": max(held_for for _, held_for in messages),
        "messages": [
            {"task_id": task_id, "task": "app.sync", "held_for": held_for, "position": i}
            for i, (task_id, held_for) in enumerate(messages, start=1)
        ],
    }


OLD = {"held": 3, "oldest": 9.5}
"""A worker of the version before named messages: count and oldest only."""


def test_new_replies_name_every_message_by_position_then_worker() -> None:
    replies = [
        {"w2@h": {PATH: named(("c", 4.0), ("d", 1.0))}},
        {"w1@h": {PATH: named(("a", 5.0), ("b", 2.0)), OTHER: named(("e", 0.5))}},
        {"idle@h": {}},
    ]
    first, second = merge_held(replies)
    assert (first.path, first.count, first.oldest, first.workers) == (
        PATH, 4, 5.0, ("w1@h", "w2@h"),
    )  # fmt: skip
    assert [(m.task_id, m.worker, m.position) for m in first.messages] == [
        ("a", "w1@h", 1), ("c", "w2@h", 1), ("b", "w1@h", 2), ("d", "w2@h", 2),
    ]  # fmt: skip
    assert first.unnamed == 0
    assert second.messages == (HeldMessage("e", "app.sync", "w1@h", 0.5, 1),)


def test_an_older_workers_counts_are_kept_beside_named_messages() -> None:
    replies = [{"old@h": {PATH: OLD}}, {"new@h": {PATH: named(("a", 1.0))}}]
    (held,) = merge_held(replies)
    assert (held.count, held.oldest, held.workers, held.unnamed) == (
        4, 9.5, ("new@h", "old@h"), 3,
    )  # fmt: skip
    (document,) = json.loads(json.dumps(held_document([held])))
    assert document["count"] == 4 and document["workers"] == ["new@h", "old@h"]
    assert [m["task_id"] for m in document["messages"]] == ["a"]
    rows = held_table([held]).splitlines()
    assert rows[0].split() == ["HELD", "AT", "GATES", "LINE", "FOR", "TASK", "ID", "TASK", "WORKER"]
    assert rows[1].split() == [PATH, "1", "1.0s", "a", "app.sync", "new@h"]
    assert rows[2].split() == ["-", "9.5s", "3", "not", "named", "(older", "version)", "-", "old@h"]


def test_only_older_workers() -> None:
    (held,) = merge_held([{"old@h": {PATH: OLD}}, {"old2@h": {PATH: {"held": 1, "oldest": 1.0}}}])
    assert (held.count, held.oldest, held.messages, held.unnamed) == (4, 9.5, (), 4)
    table = held_table([held])
    assert "4 not named (older version)" in table and "old2@h,old@h" in table
