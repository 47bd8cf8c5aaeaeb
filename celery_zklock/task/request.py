"""A locked task's request in the worker's main process: an ignored copy keeps its message.

Celery acknowledges a run that raised ``Ignore``. A copy of a message that finds its original
still running or waiting (:class:`~celery_zklock.task.delivery.OriginalAlive`) must not: on
kombu's Redis transport every copy of a message carries the delivery tag of the first delivery,
and the broker keeps one unacknowledged record per tag, so the copy's acknowledgement would
remove the original's record too. A worker killed while the original then still waited lost
the call for good (nothing left to hand out again). :class:`LockedRequest` ends such a copy in
this worker only, leaving the record to the original: the original's end acknowledges it, and
if the original dies, the broker hands the message out again after its visibility timeout.
Brokers whose copies carry their own delivery (RabbitMQ) acknowledge the copy as Celery does.
"""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.transport import virtual

from celery_zklock.task.delivery import OriginalAlive

__all__ = ["LockedRequest", "forget"]


class LockedRequest(Request):  # type: ignore[misc]
    """Celery's request, except that a copy ignored beside its living original leaves the
    message's unacknowledged record in the broker where copies share it (see the module)."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
        acknowledged = self.acknowledged  # type: ignore[has-type]
        if isinstance(exc, OriginalAlive) and not acknowledged and forget(self._message):
            task_ready(self)
            self.acknowledged = True
            return None
        return super().on_failure(exc_info, send_failed_event, return_ok)


def forget(message: Any) -> bool:
    """Drop ``message`` from this worker's unacknowledged set (its prefetch slot, its restore
    at shutdown) without touching the broker's record; False, doing nothing, for a broker
    whose copies do not share a record (one unacknowledged record for all the copies of a
    message: kombu's Redis transport, and Sentinel, whose QoS restores records by delivery
    tag)."""
    qos = getattr(getattr(message, "channel", None), "qos", None)
    if not isinstance(qos, virtual.QoS) or not hasattr(qos, "restore_by_tag"):
        return False
    # The base class's ack: this worker's bookkeeping, not the Redis QoS's removal of the record.
    virtual.QoS.ack(qos, message.delivery_tag)  # type: ignore[no-untyped-call]
    return True
