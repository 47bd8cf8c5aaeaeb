"""Where the message of a task with no final state is, in a Redis broker: waiting in a queue,
delivered and not acknowledged (kombu's ``unacked`` hash, redelivered after the visibility
timeout), or nowhere.

The load test looks for each task that never reached a final state. One that never started (no
state at all in the result backend) and whose message is nowhere in the broker was dropped by the
broker before any worker ran it: kombu's Redis transport pops a message (``BRPOP``) and only then
records it as delivered, so a broker killed between the two, or one that made the pop durable
and died before its answer left, loses that message. No lock is involved yet; the report counts
such tasks apart (``broker_dropped``), see :mod:`workers.checker`.

kombu's Redis layout: each queue is a list of JSON messages; a delivered message sits in the hash
``unacked`` under its delivery tag as ``[message, exchange, routing_key]``, its delivery time in
the sorted set ``unacked_index``; ``unacked_mutex`` is held while a worker restores overdue ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

__all__ = ["BrokerView", "whereabouts"]

UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
UNACKED_MUTEX_KEY = "unacked_mutex"


@dataclass(frozen=True)
class BrokerView:
    """What the broker holds for some task ids: ``places`` maps each id found to where
    (``"waiting in queue 'celery'"``, ``"delivered, not acknowledged for 12.0 s"``); an id
    missing from it is not in the broker. ``mutex_ttl``: seconds left on kombu's restore mutex
    (None when free). ``error``: why the broker could not be read (then ``places`` is empty)."""

    places: dict[str, str]
    mutex_ttl: int | None = None
    error: str | None = None


def _task_id(raw: bytes | str) -> str | None:
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    if isinstance(message, list) and message:  # an unacked entry: [message, exchange, key]
        message = message[0]
    if not isinstance(message, dict):
        return None
    headers = message.get("headers")
    return str(headers.get("id")) if isinstance(headers, dict) and "id" in headers else None


def whereabouts(
    broker_url: str, task_ids: Iterable[str], *, now: float | None = None
) -> BrokerView:
    """Look for the messages of ``task_ids`` in every list and in the unacked hash of the Redis
    broker at ``broker_url``."""
    wanted = set(task_ids)
    if not wanted:
        return BrokerView({})
    now = time.time() if now is None else now
    client = redis.Redis.from_url(broker_url, socket_timeout=10)
    try:
        places: dict[str, str] = {}
        for key in client.scan_iter(count=1000):
            if client.type(key) != b"list":
                continue
            for raw in client.lrange(key, 0, -1):
                task_id = _task_id(raw)
                if task_id in wanted:
                    places.setdefault(task_id, f"waiting in queue {key.decode()!r}")
        delivered: list[tuple[bytes, float]] = client.zrange(
            UNACKED_INDEX_KEY, 0, -1, withscores=True
        )  # type: ignore[assignment]  # redis-py's stubs type every answer loosely
        since: dict[bytes | str, float] = dict(delivered)
        for tag, raw in client.hgetall(UNACKED_KEY).items():
            task_id = _task_id(raw)
            if task_id in wanted:
                at = since.get(tag)
                age = f" for {now - at:.1f} s" if at is not None else ""
                places.setdefault(task_id, f"delivered, not acknowledged{age}")
        ttl = int(client.ttl(UNACKED_MUTEX_KEY))
    except redis.RedisError as exc:
        return BrokerView({}, error=repr(exc))
    finally:
        client.close()
    return BrokerView(places, mutex_ttl=ttl if ttl >= 0 else None)
