"""The celery-zklock worker fleet: a Celery app whose tasks run critical sections under
ZooKeeper locks and record them into Redis, for the demo, load tests and the compose fleet.

- :mod:`workers.settings`: the ``ZKLOCK_*`` environment the fleet reads.
- :mod:`workers.app`: the Celery app (``workers.app:app``) and :func:`~workers.app.create_app`.
- :mod:`workers.tasks`: the exclusive and shared section tasks.
- :mod:`workers.record`: section records, the fenced resource, and the history checker.
- ``python -m workers``: start one worker (:mod:`workers.__main__`).
- :mod:`workers.demo`: the local end-to-end demo (``make demo``).

Importing this package imports nothing else, so ``python -m workers`` reads its settings first.
"""
