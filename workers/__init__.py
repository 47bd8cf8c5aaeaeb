"""The celery-zklock worker fleet: a Celery app whose tasks run critical sections under
ZooKeeper locks and record them into Redis, for the demo, load tests and the compose fleet.

- :mod:`workers.settings`: the ``ZKLOCK_*`` environment the fleet reads.
- :mod:`workers.app`: the Celery app (``workers.app:app``) and :func:`~workers.app.create_app`.
- :mod:`workers.tasks`: the exclusive and shared section tasks.
- :mod:`workers.record`: section records (with kills, pauses and forced expiries), fault logs.
- :mod:`workers.checker`: the verdict on a recorded run; :mod:`workers.report`: its JSON, text
  and HTML reports.
- ``python -m workers``: start one worker (:mod:`workers.__main__`); :mod:`workers.fleet`: N of
  them on a local stack.
- :mod:`workers.faults` (with :mod:`workers.netns` and :mod:`workers.chatter`): the faults a
  load test injects.
- :mod:`workers.loadtest`: ``celery-zklock loadtest``; :mod:`workers.demo`: the same,
  demo-sized (``make demo``).

Importing this package imports nothing else, so ``python -m workers`` reads its settings first.
"""
