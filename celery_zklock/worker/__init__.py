"""The worker layer: what a ``celery worker`` of an app with ``ZkLockTask`` tasks adds to itself:
the gate (:mod:`celery_zklock.worker.gate`), the metrics endpoint
(:mod:`celery_zklock.worker.metrics`), the checks at start and the clients' close at shutdown.
Nothing is connected at import: :func:`celery_zklock.worker.wiring.install` connects it all.
The ``on_leader`` functions (:mod:`celery_zklock.worker.leader`) are wired by their decorator.
"""
