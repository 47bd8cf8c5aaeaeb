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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery.worker import state as worker_state

logger = logging.getLogger("celery_zklock.gate")

__all__ = ["give_back"]


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
