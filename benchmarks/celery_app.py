"""The Celery app of the task-level benchmark (section 4): the fleet's configuration, no-op tasks.

A worker runs it as ``celery -A benchmarks.celery_app:app worker`` (launched by
:func:`celery_zklock.testing.celery_worker.celery_command`), configured from the ``ZKLOCK_*``
environment when first needed, as :mod:`workers.app` is. Every task does nothing with one
argument ``key``: a plain task (the baseline), :class:`~celery_zklock.ZkLockTask` with
``lock_on_busy`` ``skip`` and ``wait`` and with ``lock_dedupe="queued"`` (a ZooKeeper marker
claimed when the task is sent; section 6), ``celery_singleton.Singleton`` and
``celery_once.QueueOnce`` (both take a Redis lock when the task is sent). A third-party base
that cannot be imported is left out, with the reason in :data:`UNAVAILABLE`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Final

from celery import Celery

from celery_zklock import ZkLockTask
from workers.app import celery_config
from workers.app import create_app as create_fleet_app
from workers.settings import Settings

PLAIN: Final = "bench.plain"
ZKLOCK_SKIP: Final = "bench.zklock_skip"
ZKLOCK_WAIT: Final = "bench.zklock_wait"
ZKLOCK_DEDUPE: Final = "bench.zklock_dedupe"
SINGLETON: Final = "bench.singleton"
ONCE: Final = "bench.once"
#: Task name -> why it could not be registered (its package is missing or broken).
UNAVAILABLE: dict[str, str] = {}


def bench_config(settings: Settings) -> dict[str, Any]:
    """The fleet's Celery configuration plus what celery-singleton and celery-once read."""
    return {
        **celery_config(settings),
        "singleton_backend_url": settings.broker_url,
        "ONCE": {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": settings.broker_url, "default_timeout": 3600},
        },
    }


def noop(key: str) -> None:
    """The body of every benchmark task."""
    return None


def noop_bound(self: Any, key: str) -> None:
    """The body of the bound (ZkLockTask) benchmark tasks."""
    return None


def register_tasks(app: Celery) -> None:
    app.task(name=PLAIN, shared=False)(noop)
    locked: dict[str, Any] = {
        "bind": True,
        "base": ZkLockTask,
        "shared": False,
        "lock_key": ["key"],
        "lock_mode": "exclusive",
    }
    app.task(name=ZKLOCK_SKIP, lock_on_busy="skip", **locked)(noop_bound)
    app.task(name=ZKLOCK_WAIT, lock_on_busy="wait", lock_timeout=30.0, **locked)(noop_bound)
    app.task(name=ZKLOCK_DEDUPE, lock_on_busy="skip", lock_dedupe="queued", **locked)(noop_bound)
    # Imported by name: both packages are optional (the bench extra) and untyped.
    try:
        singleton = import_module("celery_singleton").Singleton
        app.task(name=SINGLETON, base=singleton, shared=False)(noop)
    except Exception as exc:
        UNAVAILABLE[SINGLETON] = f"celery-singleton: {type(exc).__name__}: {exc}"
    try:
        queue_once = import_module("celery_once").QueueOnce
        app.task(name=ONCE, base=queue_once, shared=False)(noop)
    except Exception as exc:
        UNAVAILABLE[ONCE] = f"celery-once: {type(exc).__name__}: {exc}"


def create_app(settings: Settings | None = None) -> Celery:
    """The benchmark app, made as :func:`workers.app.create_app` makes the fleet's."""
    return create_fleet_app(settings, main="benchmarks", config=bench_config, tasks=register_tasks)


app = create_app()
