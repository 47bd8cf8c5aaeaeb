"""The task layer: :class:`~celery_zklock.task.task.ZkLockTask`, the call spec and keys
(:mod:`~celery_zklock.task.options`, :mod:`~celery_zklock.task.keys`), the run
(:mod:`~celery_zklock.task.run`), policies, interruption, delivery, dedupe, and what a run reports
(:mod:`~celery_zklock.task.events`, :mod:`~celery_zklock.task.signals`,
:mod:`~celery_zklock.task.metrics`, :mod:`~celery_zklock.task.visibility`,
:mod:`~celery_zklock.task.canvas`). It imports the locks and the ZooKeeper plumbing below it,
never the worker wiring above it.
"""
