"""The worker fleet's Celery app, ``workers.app:app``, configured from ``ZKLOCK_*`` when needed.

Importing it needs no environment, and a missing variable is reported by name when a worker
starts; code that sends to a fleet it started builds its own app with :func:`create_app` and
explicit settings. The configuration (:func:`celery_config`) keeps a message from being lost
when a worker dies or the broker restarts. Importing this module also registers the
``zklock_chatter`` control command (:mod:`workers.chatter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

import workers.chatter  # noqa: F401  (registers the zklock_chatter control command)
from workers.settings import Settings, broker_transport_options, load_settings
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
        # One message per free slot, acknowledged only after its task ran.
        "worker_prefetch_multiplier": 1,
        "task_acks_late": True,
        # A prefork pool process killed mid-task: its message goes back on the queue at once.
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        # Each worker also consumes its own queue (celery.utils.worker_direct(nodename)), so a
        # task can be sent to one chosen worker (a test aiming a fault at it).
        "worker_direct": True,
        # A worker that died as a whole never acknowledges: its messages go to another worker
        # after the visibility timeout (Redis), when its connection closes (RabbitMQ).
        "broker_transport_options": broker_transport_options(
            settings.visibility_timeout, settings.broker_url
        ),
        # A broker restart: reconnect without limit, and keep running tasks running meanwhile.
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
        "zklock_gate": settings.gate,
        RECORD_URL_SETTING: settings.record_url,
    }


def create_app(
    settings: Settings | None = None,
    *,
    main: str = "workers",
    config: Callable[[Settings], dict[str, Any]] = celery_config,
    tasks: Callable[[Celery], None] = register_tasks,
) -> Celery:
    """A Celery app with the fleet's configuration (``config``) and tasks (``tasks``).

    With ``settings``, configured from them now. Without, configured from the environment
    (:func:`workers.settings.load_settings`) when the configuration is first read; a missing or
    bad variable then raises :class:`workers.settings.SettingsError`.
    """
    app = Celery(main, set_as_current=False)
    if settings is None:
        app.add_defaults(lambda: config(load_settings()))
    else:
        app.conf.update(config(settings))
    tasks(app)
    return app


app = create_app()
