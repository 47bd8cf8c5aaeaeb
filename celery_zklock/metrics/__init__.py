"""Prometheus metrics of the lock signals, served by a worker on ``zklock_metrics_port`` (the
``celery-zklock[prometheus]`` extra): :mod:`~celery_zklock.metrics.recorder` turns the signals
into metrics in the process that runs the task, :mod:`~celery_zklock.metrics.server` serves
them from the worker. Importing this package (``celery_zklock`` does) connects the worker
lifecycle receivers, and nothing else happens unless the setting is set. What is measured and
how: ``docs/metrics.md``.
"""

from __future__ import annotations

from celery_zklock.metrics.recorder import (
    BUCKETS,
    LOST_REASONS,
    OUTCOMES,
    Recorder,
    busy_outcome,
    lost_reason,
    use_recorder,
)
from celery_zklock.metrics.server import INSTALL_HINT, metrics_addr, metrics_port, serve, stop

__all__ = [
    "BUCKETS",
    "INSTALL_HINT",
    "LOST_REASONS",
    "OUTCOMES",
    "Recorder",
    "busy_outcome",
    "lost_reason",
    "metrics_addr",
    "metrics_port",
    "serve",
    "stop",
    "use_recorder",
]
