"""The Celery app of ``python -m benchmarks.call_path --worker``: one locked task with default
options, and the probe (:mod:`benchmarks.call_path_probe`) in every process of its worker.

``celery -A benchmarks.call_path_app:app worker``, configured from the ``ZKLOCK_*`` environment
as :mod:`workers.app` is. With :data:`~benchmarks.call_path_probe.DIR_ENV` set, importing this
module installs the probe in the worker's main process, which Celery's command line does before
the worker starts any thread, and listens for its signals; each pool process installs and listens
again at ``worker_process_init`` (Celery resets some signals there; the fork already passed on
the profile function and the closed window).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Final

from celery import Celery
from celery.signals import worker_process_init

from benchmarks import call_path_probe as probe
from celery_zklock import ZkLockTask
from workers.app import celery_config
from workers.app import create_app as create_fleet_app
from workers.settings import Settings

TASK: Final = "callpath.sync_account"


def sync_account(account_id: int, hold: float = 0.0) -> int:
    """A no-op that returns its pool process's pid (the warm-up's ``hold`` keeps a process
    busy, so that the next call goes to the other one)."""
    if hold:
        time.sleep(hold)
    return os.getpid()


def register_tasks(app: Celery) -> None:
    app.task(name=TASK, base=ZkLockTask, shared=False, lock_key=["account_id"])(sync_account)


def create_app(settings: Settings | None = None) -> Celery:
    """The app, made as :func:`workers.app.create_app` makes the fleet's."""
    return create_fleet_app(settings, main="callpath", config=celery_config, tasks=register_tasks)


app = create_app()


def _probe(**_: Any) -> None:
    probe.install()
    probe.listen(Path(os.environ[probe.DIR_ENV]))


if os.environ.get(probe.DIR_ENV):
    _probe()
    worker_process_init.connect(_probe, weak=False, dispatch_uid="callpath-probe")
