"""The prerun send-ahead: a locked run's first request goes out when Celery announces the run.

At ``task_prerun`` (in a worker, for exclusive and shared locks without ``dedupe``) the run is
worked out (a :class:`~celery_zklock.run.LockedRun`: options, lock path, identity) and the create
of its contender node is sent without waiting, so that its round trip overlaps what Celery does
before the call (the track-started write). ``ZkLockTask.__call__`` takes the run over
(:func:`call`) and the run's acquire finishes that create. A run that never reaches its acquire
removes the node: at the end of the call, or at ``task_postrun`` when Celery failed between the
two. All the task-side state of it lives here, in one :class:`SentAhead` on the task's request;
the lock side (the create in flight) is ``Mutex._send_ahead`` and ``Mutex._drop_sent_ahead``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from celery.signals import task_postrun, task_prerun
from kazoo.client import KazooClient

from celery_zklock.interrupt import STOPPING
from celery_zklock.locks import Mutex
from celery_zklock.locks.identity import identity
from celery_zklock.options import TaskLockSpec
from celery_zklock.run import LockedRun
from celery_zklock.session import get_client

__all__ = ["SentAhead", "call", "connect_signals"]

#: The task request's attribute holding the :class:`SentAhead` made at ``task_prerun``.
REQUEST_ATTRIBUTE: Final = "_zklock_run_ahead"


class SentAhead:
    """A run made at ``task_prerun`` and the create sent for it, until ``__call__`` takes it.

    ``side`` and ``client`` are the lock side the create went on and the client it used;
    ``stopped`` what stopped the send (a soft time limit, the lock's loss), for the call to
    raise: Celery's signal dispatch would swallow it.
    """

    def __init__(self, run: LockedRun) -> None:
        self.run = run
        self.side: Mutex | None = None
        self.client: KazooClient | None = None
        self.stopped: BaseException | None = None

    def send(self) -> bool:
        """Send the create of the run's contender node now, without waiting; whether it went.
        Never raises: whatever stops it here (no connection yet, a setting to fix) is met
        again, and reported, by the run."""
        run, options = self.run, self.run.options
        if not run.in_worker or options.mode == "semaphore" or options.dedupe is not None:
            return False
        try:
            client = get_client(run.settings.client)
            # recorded before the send, so that whatever cuts it short still finds its node
            side = self.side = run.side_for(client)
            self.client = client
            return side._send_ahead(identity(run.task, run.request))
        except STOPPING as exc:
            self.stopped = exc
            return False
        except Exception:
            return False

    def side_for(self, client: KazooClient) -> Mutex:
        """The side the run acquires on ``client``: the one the create went on, or (none sent,
        or on another client) a new one, once the sent node is removed."""
        side = self.side
        if side is None or self.client is not client:
            self.drop()
            side = self.run.side_for(client)
        return side

    def drop(self) -> None:
        """Remove the node of the create sent if no acquire took it up (else a no-op)."""
        if self.side is not None:
            self.side._drop_sent_ahead()


def call(task: Any, spec: TaskLockSpec, args: Any, kwargs: Any, body: Callable[[], Any]) -> Any:
    """``ZkLockTask.__call__``: run ``body`` under the lock, taking over the run made at
    ``task_prerun`` if it is for these arguments (a subclass may have changed them)."""
    sent = _take(task.request)  # a call nested in the body makes its own
    try:  # from here its node is removed on the way out; before, task_postrun removes it
        if sent is None or sent.run.call != (args, kwargs):
            if sent is not None:
                sent.drop()  # before this run contends: the node could be on its own key
            return LockedRun(task, spec, args, kwargs).run(body)
        if sent.stopped is not None:
            raise sent.stopped
        return sent.run.run(body, sent.side_for)
    finally:
        if sent is not None:
            sent.drop()  # a no-op once its acquire took the node up


def _take(request: Any) -> SentAhead | None:
    sent: SentAhead | None = getattr(request, REQUEST_ATTRIBUTE, None)
    if sent is not None:
        setattr(request, REQUEST_ATTRIBUTE, None)
    return sent


def connect_signals(task_class: type[Any]) -> None:
    """Connect the ``task_prerun`` send and the ``task_postrun`` clean-up for the tasks that
    are instances of ``task_class`` (``ZkLockTask``)."""

    def send_at_prerun(sender: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
        """A call it cannot work out (arguments the key refuses, say) is left to ``__call__``,
        which reports it."""
        if not isinstance(sender, task_class):
            return
        try:
            spec = sender._zklock_compile(sender.name)
            run = LockedRun(sender, spec, tuple(args or ()), dict(kwargs or {}))
        except Exception:
            return
        sent = SentAhead(run)
        setattr(sender.request, REQUEST_ATTRIBUTE, sent)  # first: a send cut short is dropped
        sent.send()

    def drop_at_postrun(sender: Any = None, **_: Any) -> None:
        """Remove the node of a create no ``__call__`` took up (Celery failed between the
        two: its track-started write, say)."""
        if isinstance(sender, task_class):
            sent = _take(sender.request)
            if sent is not None:
                sent.drop()

    task_prerun.connect(send_at_prerun, weak=False)
    task_postrun.connect(drop_at_postrun, weak=False)
