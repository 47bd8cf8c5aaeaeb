"""The Celery app of the `celery worker` and `celery zklock` subprocesses of
tests/task/test_setting_names_workers.py: a user's app with a mistake in it.

Configured from the environment the test sets: SETTINGSAPP_BROKER (broker and result backend),
SETTINGSAPP_CONF (JSON: app settings put in ``app.conf`` as they are, so a test can misspell
one), SETTINGSAPP_MISTAKE (``option``: a task whose decorator misspells a lock option;
``base``: a task whose shared base class does). ZooKeeper: ``ZKLOCK_HOSTS``.

Its tasks are not shared (``shared=False``): a process that imports this module does not make
them in every app it finalizes.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from celery import Celery
from celery.exceptions import SecurityWarning

from celery_zklock import ZkLockTask

# The tests read the worker's whole output; the suite may run as root, of which Celery warns.
warnings.filterwarnings("ignore", category=SecurityWarning)

BROKER = os.environ.get("SETTINGSAPP_BROKER", "redis://127.0.0.1:1/0")
app = Celery("settingsapp", broker=BROKER, backend=BROKER)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    zklock_root="/settingsapp",
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("SETTINGSAPP_CONF", "{}")))


@app.task(base=ZkLockTask, lock_key=["key"], shared=False)
def locked(key: str) -> str:
    return key


MISTAKE = os.environ.get("SETTINGSAPP_MISTAKE")

if MISTAKE == "option":

    @app.task(base=ZkLockTask, lock_key=["key"], lock_on_bussy="skip", shared=False)
    def misspelt(key: str) -> str:
        return key


if MISTAKE == "base":

    class SkipWhenBusy(ZkLockTask):  # type: ignore[misc]
        """A base class for the app's tasks, its option misspelt."""

        lock_on_bussy = "skip"

    @app.task(base=SkipWhenBusy, lock_key=["key"], shared=False)
    def inherits(key: str) -> Any:
        return key
