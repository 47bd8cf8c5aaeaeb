"""The Celery app of the task-level benchmark (section 4): the fleet's configuration, no-op tasks.

A worker runs it as ``celery -A benchmarks.celery_app:app worker ...`` with the fleet's worker
options (:func:`workers.__main__.worker_argv`) and settings from the ``ZKLOCK_*`` environment,
read when the configuration is first needed (as :mod:`workers.app` does); the sender builds its
own app with :func:`create_app` and explicit settings.

Every task has the same body, which does nothing, and one argument ``key``:

``bench.plain``
    a plain Celery task (the baseline);
``bench.zklock_skip`` / ``bench.zklock_wait``
    :class:`~celery_zklock.ZkLockTask` with ``lock_key=["key"]``, exclusive, ``lock_on_busy``
    ``skip`` and ``wait``;
``bench.singleton``
    ``celery_singleton.Singleton`` (a Redis ``SET NX`` taken when the task is sent, deleted
    when it ends);
``bench.once``
    ``celery_once.QueueOnce`` with its Redis backend (a redis-py ``Lock`` taken when the task
    is sent, deleted when it ends).

A third-party base that cannot be imported is left out, and the reason is kept in
:data:`UNAVAILABLE`, so the benchmark can say so instead of measuring something else.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Final

from celery import Celery

from celery_zklock import ZkLockTask
from workers.app import celery_config
from workers.settings import Settings, load_settings

PLAIN: Final = "bench.plain"
ZKLOCK_SKIP: Final = "bench.zklock_skip"
ZKLOCK_WAIT: Final = "bench.zklock_wait"
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
    """The benchmark app; configured from ``settings`` now, or from the environment later."""
    app = Celery("benchmarks", set_as_current=False)
    if settings is None:
        app.add_defaults(lambda: bench_config(load_settings()))
    else:
        app.conf.update(bench_config(settings))
    register_tasks(app)
    return app


app = create_app()
