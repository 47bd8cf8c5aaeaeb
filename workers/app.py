"""The worker fleet's Celery app.

``workers.app:app`` is configured from the ``ZKLOCK_*`` environment (see
:mod:`workers.settings`) when its configuration is first needed, so importing it needs no
environment and a missing variable is reported by name when a worker starts. Code that sends
tasks to a fleet it started itself (the demo, the load test) builds its own app with
:func:`create_app` and explicit settings instead of changing the environment.

Configuration (:func:`celery_config`): JSON only, Redis broker and result backend, and what
keeps a message from being lost when a worker dies or the broker restarts:

- ``task_acks_late`` and ``worker_prefetch_multiplier=1``: a worker takes one message per free
  slot, and a message is acknowledged only after its task ran;
- ``task_reject_on_worker_lost``: when a prefork pool process dies mid-task (``kill -9``), its
  worker puts the message back on the queue at once instead of failing the task;
- ``broker_transport_options``: ``visibility_timeout`` (``ZKLOCK_VISIBILITY_TIMEOUT``) after which
  a message taken by a worker that died as a whole (its acknowledgement never comes) is handed
  to another worker, swept for every second or so (``unacked_restore_interval``/``_throttle``);
- broker connections retried without limit and publishing retried for about 15 s (a Redis
  restart), running tasks kept running meanwhile.

Also ``task_track_started`` (a running task is visible as STARTED), ``worker_direct`` (each
worker also consumes a queue of its own, to send a task to one chosen worker), the
``zklock_*`` settings for :class:`celery_zklock.ZkLockTask`, and ``fleet_record_url`` for the
section records. Importing this module also registers the ``zklock_chatter`` remote control
command (:mod:`workers.chatter`) in every worker of the fleet.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

import workers.chatter  # noqa: F401  (registers the zklock_chatter control command)
from workers.settings import Settings, load_settings
from workers.tasks import RECORD_URL_SETTING, register_tasks

__all__ = ["app", "broker_transport_options", "celery_config", "create_app"]


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery configuration of a fleet app with ``settings``."""
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.result_backend,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        # Each worker also consumes its own queue (celery.utils.worker_direct(nodename)), so a
        # task can be sent to one chosen worker (a test aiming a fault at it).
        "worker_direct": True,
        "broker_transport_options": broker_transport_options(settings.visibility_timeout),
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Publishing (a retry, or a client sending) rides out a broker restart of ~10 s.
        "task_publish_retry_policy": {
            "max_retries": 40,
            "interval_start": 0,
            "interval_step": 0.1,
            "interval_max": 0.5,
        },
        "result_expires": 24 * 3600,
        "zklock_hosts": settings.zk_hosts,
        "zklock_session_timeout": settings.session_timeout,
        "zklock_root": settings.zk_root,
        RECORD_URL_SETTING: settings.record_url,
    }


def broker_transport_options(visibility_timeout: float) -> dict[str, Any]:
    """The Redis transport options of the fleet: redelivery after ``visibility_timeout`` s."""
    # kombu sweeps for overdue messages every interval * throttle seconds (100 s by default):
    # sweep often enough that a dead worker's message waits about the visibility timeout.
    interval = max(1, min(10, int(visibility_timeout // 10)))
    return {
        "visibility_timeout": visibility_timeout,
        "unacked_restore_interval": interval,
        "unacked_restore_throttle": 1,
    }


def create_app(settings: Settings | None = None, *, main: str = "workers") -> Celery:
    """A Celery app with the fleet's tasks.

    With ``settings``, configured from them now. Without, configured from the environment
    (:func:`workers.settings.load_settings`) when the configuration is first read; a missing or
    bad variable then raises :class:`workers.settings.SettingsError`.
    """
    app = Celery(main, set_as_current=False)
    if settings is None:
        app.add_defaults(lambda: celery_config(load_settings()))
    else:
        app.conf.update(celery_config(settings))
    register_tasks(app)
    return app


app = create_app()
