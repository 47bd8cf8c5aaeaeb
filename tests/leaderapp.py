"""A Celery app with one ``on_leader`` function, for tests/task/test_on_leader.py (the task
tests' workers run tests.taskapp, which has none).

Configured from the environment the test sets: TASKAPP_BROKER (broker URL), ZKLOCK_HOSTS,
ZKLOCK_SESSION_TIMEOUT, TASKAPP_DIR (the function's log, ``leader.log``), LEADERAPP_CLEANUP
(seconds :func:`sweep` takes to return once ``stop`` is set).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from celery import Celery

from celery_zklock import on_leader
from celery_zklock.worker.leader import Stop
from tests.support.leaders import LeaderLog

app = Celery("leaderapp", broker=os.environ.get("TASKAPP_BROKER", "redis://127.0.0.1:1/0"))
app.conf.update(zklock_root="/taskapp", broker_connection_retry_on_startup=True)
LOG = LeaderLog(Path(os.environ.get("TASKAPP_DIR", "/tmp")) / "leader.log")
CLEANUP = float(os.environ.get("LEADERAPP_CLEANUP", "0"))


SESSION_TIMEOUT = float(os.environ.get("ZKLOCK_SESSION_TIMEOUT", "10"))


@on_leader(app, "sweeper")
def sweep(stop: Stop) -> None:
    """Log ``start <pid> <1 if on the main thread, else 0> <fencing token>``, wait for
    ``stop``, log ``stopped``, take CLEANUP seconds, log ``return``. ``unstopped <pid>``: a
    ``stop.is_set()`` that said False after a look a session timeout earlier (a worker that
    went a whole session without running, a pause, would go on as the leader)."""
    me = str(os.getpid())
    LOG.write("start", me, int(threading.current_thread() is threading.main_thread()), stop.token)
    looked = time.monotonic()
    while not stop.is_set():
        if time.monotonic() - looked > SESSION_TIMEOUT:
            LOG.write("unstopped", me)
        looked = time.monotonic()
        stop.wait(0.2)
    LOG.write("stopped", me)
    time.sleep(CLEANUP)
    LOG.write("return", me)
