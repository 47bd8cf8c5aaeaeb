"""Held messages given back to the broker, in the order their calls must start.

The gate gives held messages back when the broker's redelivery bound comes and when the worker
stops: rather than let the broker hand out a copy of a message the worker still holds, or let
the worker's close put them back in whatever order the transport restores (kombu's Redis
transport restores a closing channel's unacknowledged messages at the head of the queue one by
one, which reverses them), the gate rejects them with requeue itself, one key's messages in the
order their calls must start. Redis then queues each at the tail of its queue (behind what was
queued meanwhile, in that order); RabbitMQ puts a requeued message back at its place in the
queue where it can. A message that cannot be given back (the broker unreachable) stays
unacknowledged, and the broker hands it out again after its bound, as for a worker that died.

Past the gate's cap on held messages, a message is *sent later* instead (:func:`send_later`):
published again with a short ETA and the instant its call first reached a gate, then
acknowledged. An ETA message raises the worker's prefetch as Celery keeps it, so the worker goes
on fetching other work; back at a gate the call takes its place in its key's line by that
instant. Not a retry: the message body, task id, retry count and headers are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.worker import state as worker_state

from celery_zklock.task.sendback import FIRST_DUE

logger = logging.getLogger("celery_zklock.gate")

__all__ = ["give_back", "send_later"]


def give_back(requests: Sequence[Any]) -> int:
    """Reject the held ``requests`` with requeue, in the order given (the order their calls
    must start), and forget them in this worker; returns how many went back."""
    failed: list[BaseException] = []
    for request in requests:
        try:
            request.reject(requeue=True)
        except Exception as exc:
            failed.append(exc)
        worker_state.task_ready(request)
    if failed:
        logger.warning(
            "celery-zklock gate: could not give %d held message(s) back to the broker (%r); "
            "the broker hands them out again after its redelivery bound or when the channel "
            "closes",
            len(failed),
            failed[0],
        )
    return len(requests) - len(failed)


def send_later(request: Any, countdown: float, due: float) -> bool:
    """Publish the message of ``request`` again, ``countdown`` seconds from now (an ETA),
    carrying ``due`` (:data:`~celery_zklock.task.sendback.FIRST_DUE`, or the earlier instant it
    carries already); then acknowledge this delivery and forget it in this worker. False, with
    nothing done, when the broker did not take the copy."""
    message = request.message
    headers = dict(message.headers or {})
    carried = headers.get(FIRST_DUE)
    headers[FIRST_DUE] = min(due, carried) if isinstance(carried, (int, float)) else due
    headers["eta"] = (datetime.now(timezone.utc) + timedelta(seconds=countdown)).isoformat()
    info, properties = message.delivery_info or {}, message.properties or {}
    try:
        with request.task.app.producer_or_acquire() as producer:
            producer.publish(
                message.body,
                exchange=info.get("exchange") or "",
                routing_key=info.get("routing_key"),
                headers=headers,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                correlation_id=properties.get("correlation_id"),
                reply_to=properties.get("reply_to"),
                priority=properties.get("priority"),
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.2},
            )
    except Exception as exc:
        logger.warning("celery-zklock gate: could not send %s to the broker (%r)", request.id, exc)
        return False
    request.acknowledge()
    worker_state.task_ready(request)
    return True
