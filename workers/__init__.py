"""The celery-zklock worker fleet: a Celery app whose tasks run critical sections under
ZooKeeper locks and record them into Redis, for the demo, load tests and the compose fleet.

A folder of the repository, not part of the library's wheel (``pip install celery-zklock``
installs ``celery_zklock`` only): run it from the repository root or with the root on
``PYTHONPATH``. It uses the library; the library never imports it.

- :mod:`workers.settings`: the ``ZKLOCK_*`` environment the fleet reads.
- :mod:`workers.app`: the Celery app (``workers.app:app``) and :func:`~workers.app.create_app`.
- :mod:`workers.tasks`: the exclusive and shared section tasks.
- :mod:`workers.record`: section records (with kills, pauses and forced expiries), fault logs.
- :mod:`workers.checker`: the verdict on a recorded run; :mod:`workers.report`: its JSON, text
  and HTML reports.
- ``python -m workers worker|demo|loadtest`` (:mod:`workers.__main__`): start one worker, run
  the demo, run a load test; :mod:`workers.fleet`: N workers on a local stack.
- :mod:`workers.faults` (with :mod:`workers.netns` and :mod:`workers.chatter`): the faults a
  load test injects.
- :mod:`workers.loadtest`: ``python -m workers loadtest``; :mod:`workers.demo`: the same,
  demo-sized (``python -m workers demo``, ``make demo``).

Importing this package imports nothing else, so ``python -m workers worker`` reads its settings
first.
"""
