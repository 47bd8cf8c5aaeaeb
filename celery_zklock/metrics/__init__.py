"""Prometheus metrics of the lock signals (being split into a package: see metrics/server.py)."""

from __future__ import annotations

from celery_zklock.metrics.server import (
    _RECEIVERS,
    BUCKETS,
    INSTALL_HINT,
    LOST_REASONS,
    OUTCOMES,
    Recorder,
    _forks,
    _gone_pids,
    _on_timeout,
    _on_worker_init,
    _serving,
    busy_outcome,
    lost_reason,
    metrics_addr,
    metrics_port,
    serve,
    stop,
    use_recorder,
)

__all__ = [
    "BUCKETS",
    "INSTALL_HINT",
    "LOST_REASONS",
    "OUTCOMES",
    "_RECEIVERS",
    "Recorder",
    "_forks",
    "_gone_pids",
    "_on_timeout",
    "_on_worker_init",
    "_serving",
    "busy_outcome",
    "lost_reason",
    "metrics_addr",
    "metrics_port",
    "serve",
    "stop",
    "use_recorder",
]
