"""The worker fleet's Celery app.

``workers.app:app`` is configured from the ``ZKLOCK_*`` environment (see
:mod:`workers.settings`) when its configuration is first needed, so importing it needs no
environment and a missing variable is reported by name when a worker starts. Code that sends
tasks to a fleet it started itself (the demo, the load test) builds its own app with
:func:`create_app` and explicit settings instead of changing the environment.

Configuration (:func:`celery_config`): JSON only, Redis broker and result backend,
``worker_prefetch_multiplier=1`` and ``task_acks_late=True`` (a worker takes one message at a
time and a message is acknowledged after its task ran), ``task_track_started`` (a running task
is visible as STARTED), the ``zklock_*`` settings for :class:`celery_zklock.ZkLockTask`, and
``fleet_record_url`` for the section records.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from workers.settings import Settings, load_settings
from workers.tasks import RECORD_URL_SETTING, register_tasks

__all__ = ["app", "celery_config", "create_app"]


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
        "task_track_started": True,
        "broker_connection_retry_on_startup": True,
        "result_expires": 24 * 3600,
        "zklock_hosts": settings.zk_hosts,
        "zklock_session_timeout": settings.session_timeout,
        "zklock_root": settings.zk_root,
        RECORD_URL_SETTING: settings.record_url,
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
