"""What the lock signals become as Prometheus metrics, in the process that sends them (the one
running the task): :class:`Recorder` holds the counters, histograms and the held-leases gauge
and counts each lost lease once, whichever of ``lock_lost`` and ``lock_released(lost=True)``
tells it first; :func:`use_recorder` connects the signal receivers only while there is a
recorder, so a worker that serves no metrics pays nothing per task. Names, labels and the
outcome and reason tables: ``docs/metrics.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from celery_zklock.task import signals

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


OUTCOMES: Final = (
    "granted", "skipped", "timed_out", "busy_raised", "retried", "debounced", "replaced",
)  # fmt: skip
"""The ``outcome`` label of ``zklock_acquisitions_total``: one per attempt that got or gave up
the lock (a ``wait`` ends as granted or timed_out; a ``replace`` wait as granted, timed_out or
replaced), and one per call a newer call of its debounce window superseded (``debounced``)."""
LOST_REASONS: Final = (
    "session_expired", "lease_clock", "node_deleted", "broken", "preempted", "other",
)  # fmt: skip
"""The ``reason`` label of ``zklock_lost_total``: the values of
:class:`~celery_zklock.errors.LossCode`, and ``other``."""
BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Histogram buckets (seconds) of the wait and hold times: 1 ms to 10 min, then ``+Inf``."""

_BUSY_OUTCOMES: Final[Mapping[str, str]] = {
    "skip": "skipped",
    "retry": "retried",
    "raise": "busy_raised",
}
_LOST_MEMORY: Final = 1024
"""Leases remembered per process to count each loss once whichever signal tells it first."""


def busy_outcome(policy: str) -> str | None:
    """The outcome of an attempt that found the lock busy under ``policy`` (``lock_busy``'s
    keyword): ``skipped``, ``retried`` or ``busy_raised``; None for ``wait``, whose outcome is
    decided later (``granted`` by ``lock_acquired``, or ``timed_out``)."""
    return _BUSY_OUTCOMES.get(policy)


def lost_reason(code: object) -> str:
    """One of :data:`LOST_REASONS` for the ``code`` of a lost lease (a
    :class:`~celery_zklock.errors.LossCode`, or its value).

    ``lease_clock``: the lease clock ran out (no answer from the ZooKeeper leader in time, or
    the process was paused); ``session_expired``: the session behind the node expired or was
    replaced; ``node_deleted``: someone else deleted the lock node; ``broken``: an operator broke
    it (``celery zklock break``); ``preempted``: a newer ``preempt`` call broke it; ``other``: a
    code this version does not know, None included.
    """
    text = str(code) if isinstance(code, str) else ""
    return text if text in LOST_REASONS else "other"


class Recorder:
    """The metrics of one process and the bookkeeping that turns the lock signals into them.

    ``registry``: where the metrics register (None in multiprocess mode, where a
    ``MultiProcessCollector`` reads them from the files instead). Thread-safe: ``lock_lost``
    comes from the lease clock's thread.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.acquisitions = Counter(
            "zklock_acquisitions",
            "Lock acquisition attempts of locked tasks, by outcome.",
            ["task", "outcome"],
            registry=registry,
        )
        self.wait = Histogram(
            "zklock_wait_seconds",
            "Seconds from the start of a locked run to the grant of its lock.",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "zklock_hold_seconds",
            "Seconds a lock was held, from its grant to its release.",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.lost = Counter(
            "zklock_lost", "Leases lost, by reason.", ["task", "reason"], registry=registry
        )
        self.held = Gauge(
            "zklock_leases_held",
            "Leases granted and not yet released.",
            ["task"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.rate = Counter(
            "zklock_rate_decisions",
            "Admissions under lock_rate, by outcome (admitted, refused).",
            ["task", "outcome"],
            registry=registry,
        )
        self.gate_held = Gauge(
            "zklock_gate_held",
            "Messages the workers' gates hold until their lock can be granted.",
            ["task"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._lock = threading.Lock()
        self._lost_leases: OrderedDict[tuple[Any, ...], None] = OrderedDict()

    def after_fork(self) -> None:
        """Forget what the parent process knew (a pool process starts with no lease)."""
        self._lock = threading.Lock()
        self._lost_leases = OrderedDict()

    def acquired(self, task: str, waited: float) -> None:
        self.acquisitions.labels(task, "granted").inc()
        self.wait.labels(task).observe(max(0.0, waited))
        self.held.labels(task).inc()

    def outcome(self, task: str, outcome: str) -> None:
        self.acquisitions.labels(task, outcome).inc()

    def lease_lost(self, task: str, lease: tuple[Any, ...], code: object) -> None:
        """``lock_lost``: counted unless the release already counted this lease's loss."""
        with self._lock:
            if self._lost_leases.pop(lease, False) is None:
                return
            self._remember(lease)
        self.lost.labels(task, lost_reason(code)).inc()

    def released(self, task: str, lease: tuple[Any, ...], held: float, lost: bool) -> None:
        """``lock_released``; a lease released lost whose loss was not told (found at the
        release, or told after it) counts as lost here, with its reason unknown (``other``)."""
        self.hold.labels(task).observe(max(0.0, held))
        self.held.labels(task).dec()
        with self._lock:
            told = self._lost_leases.pop(lease, False) is None
            if lost and not told:
                self._remember(lease)  # so a late lock_lost for it is not counted twice
        if lost and not told:
            self.lost.labels(task, "other").inc()

    def _remember(self, lease: tuple[Any, ...]) -> None:
        self._lost_leases[lease] = None
        while len(self._lost_leases) > _LOST_MEMORY:
            self._lost_leases.popitem(last=False)


# -- the signal receivers: record in the process that runs the task -----------------------
_recorder: Recorder | None = None


def _task(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "unknown")


def _lease(kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    return (kwargs.get("task_id"), kwargs.get("path"), kwargs.get("token"))


def _seconds(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _on_acquired(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.acquired(_task(sender), _seconds(kwargs.get("waited")))


def _on_busy(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    outcome = busy_outcome(str(kwargs.get("policy")))
    if recorder is not None and outcome is not None:
        recorder.outcome(_task(sender), outcome)


def _on_timeout(sender: Any = None, **_: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.outcome(_task(sender), "timed_out")


def _on_lost(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.lease_lost(_task(sender), _lease(kwargs), kwargs.get("code"))


def _on_released(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.released(
            _task(sender), _lease(kwargs), _seconds(kwargs.get("held")), bool(kwargs.get("lost"))
        )


_RECEIVERS: Final = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_busy, _on_busy),
    (signals.lock_lost, _on_lost),
    (signals.lock_released, _on_released),
    (signals.lock_timeout, _on_timeout),
)


def use_recorder(recorder: Recorder | None) -> None:
    """Record the lock signals of this process with ``recorder`` (None: stop recording).

    The receivers are connected only while there is a recorder: a signal without receivers
    costs a locked task nothing (celery_zklock.task.events skips the send), and most workers do not
    serve metrics.
    """
    global _recorder
    _recorder = recorder
    for signal, receiver in _RECEIVERS:
        if recorder is None:
            signal.disconnect(receiver, dispatch_uid="zklock-metrics")
        else:
            signal.connect(receiver, weak=False, dispatch_uid="zklock-metrics")


def count_rate(task: str, admitted: bool) -> None:
    """A run of ``task`` was admitted under its ``lock_rate``, or refused."""
    recorder = _recorder
    if recorder is not None:
        recorder.rate.labels(task=task, outcome="admitted" if admitted else "refused").inc()


def count_outcome(task: str, outcome: str) -> None:
    """An attempt of ``task`` ended as ``outcome`` (one of :data:`OUTCOMES`) without a signal
    that tells it: ``debounced``, ``replaced``."""
    recorder = _recorder
    if recorder is not None:
        recorder.outcome(task, outcome)


def count_held(task: str, change: int) -> None:
    """The worker's gate holds ``change`` more (or, negative, fewer) messages of ``task``."""
    recorder = _recorder
    if recorder is not None:
        recorder.gate_held.labels(task=task).inc(change)


def active_recorder() -> Recorder | None:
    """The recorder of this process's lock signals, or None while they are not recorded."""
    return _recorder
