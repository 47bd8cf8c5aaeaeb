"""``workers.whereabouts`` on a real Redis laid out as kombu's Redis transport lays it out."""

from __future__ import annotations

import json

import redis

from workers.whereabouts import UNACKED_INDEX_KEY, UNACKED_KEY, UNACKED_MUTEX_KEY, whereabouts


def message(task_id: str) -> str:
    """A Celery protocol-2 message as kombu stores it (only what whereabouts reads matters)."""
    return json.dumps({"body": "W10=", "headers": {"id": task_id, "task": "t"}, "properties": {}})


def test_finds_waiting_and_delivered_messages_and_says_which_are_gone(redis_url: str) -> None:
    # A database of its own: the tests' brokers use database 0, and the mutex below would stop
    # their redeliveries for 300 s.
    redis_url = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.lpush("celery", message("waiting"), message("other"))
    client.set("celery-task-meta-x", "{}")  # not a list: skipped
    client.hset(UNACKED_KEY, "tag-1", json.dumps([json.loads(message("delivered")), "", "celery"]))
    client.zadd(UNACKED_INDEX_KEY, {"tag-1": 100.0})
    view = whereabouts(redis_url, ["waiting", "delivered", "gone"], now=112.5)
    assert view.error is None and view.mutex_ttl is None
    assert view.places == {
        "waiting": "waiting in queue 'celery'",
        "delivered": "delivered, not acknowledged for 12.5 s",
    }
    client.set(UNACKED_MUTEX_KEY, "1", ex=300)  # a restore mutex a broker crash left behind
    assert 0 < (whereabouts(redis_url, ["gone"]).mutex_ttl or 0) <= 300
    client.flushdb()
    client.close()


def test_an_unreadable_broker_is_said_not_guessed() -> None:
    view = whereabouts("redis://127.0.0.1:1/0", ["a"])
    assert view.places == {} and view.error is not None and "Connection" in view.error
