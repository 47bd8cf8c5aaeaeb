"""The metrics endpoint of a worker, on ``zklock_metrics_port``: at ``worker_init`` it starts
recording (:mod:`celery_zklock.task.metrics`) and serves the metrics over HTTP, from a
registry of its own for the in-process pools (threads, solo, gevent, eventlet), or, for
prefork, from the files its pool processes write to a multiprocess directory it sets up before
they start (prometheus-client's multiprocess mode); ``worker_shutdown`` stops it and removes
what it made. Unset, nothing is imported or started; set while prometheus-client is missing or
on a port that cannot be bound, the worker refuses to start with a
:class:`~celery_zklock.ConfigurationError`. How the processes share the metrics:
``docs/metrics.md``.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from celery_zklock.errors import ConfigurationError
from celery_zklock.task.metrics import Recorder, active_recorder, use_recorder
from celery_zklock.zk.settings import settings_of

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


logger = logging.getLogger("celery_zklock.metrics")

PORT_SETTING: Final = "zklock_metrics_port"
INSTALL_HINT: Final = "pip install celery-zklock[prometheus]"
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
CHILD_ENV: Final = "CELERY_ZKLOCK_METRICS_DIR"
"""Set by a prefork worker's main process for its pool processes: the multiprocess directory
(pool processes started by ``spawn`` or ``forkserver`` inherit no Python state, only this)."""


# -- serving ----------------------------------------------------------------------------
@dataclass
class _Serving:
    httpd: Any
    thread: threading.Thread
    addr: str
    port: int
    multiproc_dir: str | None
    made_dir: bool
    previous_env: str | None


_serving: _Serving | None = None
_multiproc_dir: str | None = None
"""The multiprocess directory of this prefork worker (main and pool processes), else None."""


def _module(name: str) -> Any:
    """A prometheus-client module whose functions carry no annotations (typed as Any here)."""
    return importlib.import_module(name)


def _import_prometheus(port: int) -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            f"{PORT_SETTING} is set ({port}) but prometheus-client is not installed: "
            f"{INSTALL_HINT}, or unset {PORT_SETTING} / ZKLOCK_METRICS_PORT"
        ) from None


def _use_multiprocess_values() -> None:
    """Make the metrics built from now on write to the multiprocess directory.

    prometheus-client picks its value class from ``PROMETHEUS_MULTIPROC_DIR`` when first
    imported; if something imported it before the worker set the variable, switch it now.
    """
    values = _module("prometheus_client.values")
    if values.ValueClass is values.MutexValue:
        logger.info(
            "prometheus_client was imported before the worker started: metrics made before now "
            "are not collected from pool processes"
        )
        values.ValueClass = values.MultiProcessValue()


class _LiveCollector:
    """A ``MultiProcessCollector`` that first drops the ``livesum`` share of pool processes
    that are gone without saying so (killed), which ``worker_process_shutdown`` did not see."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._inner = _module("prometheus_client.multiprocess").MultiProcessCollector(None, path)

    def collect(self) -> Iterable[Metric]:
        multiprocess = _module("prometheus_client.multiprocess")
        for pid in _gone_pids(self._path):
            multiprocess.mark_process_dead(pid, self._path)
        metrics: Iterable[Metric] = self._inner.collect()
        return metrics


def _gone_pids(path: str) -> list[int]:
    """Pids of the live-gauge files in ``path`` whose process no longer exists."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    live = [n[: -len(".db")] for n in names if n.startswith("gauge_live") and n.endswith(".db")]
    pids = [int(pid) for pid in (name.rsplit("_", 1)[-1] for name in live) if pid.isdigit()]
    return [pid for pid in pids if not _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process
    return True


def serve(app: Any, *, multiprocess: bool) -> tuple[str, int] | None:
    """Start recording the lock signals and serving the metrics over HTTP on ``app``'s
    ``zklock_metrics_port`` and ``zklock_metrics_addr``: the bound ``(addr, port)``, or None
    when the port is unset.

    ``multiprocess``: the signals are sent in pool processes this process forks or spawns after
    this call (prefork); the multiprocess directory is set up and the pool processes record
    into it. Raises ConfigurationError on a bad setting, a missing prometheus-client or a
    port that cannot be bound (nothing is left started), RuntimeError if already serving.
    """
    global _serving, _multiproc_dir
    settings = settings_of(app, connection=False)  # metrics need no ZooKeeper settings
    port = settings.metrics_port
    if port is None:
        return None
    if _serving is not None:
        raise RuntimeError("celery-zklock metrics are already served by this process")
    addr = settings.metrics_addr
    previous = os.environ.get(MULTIPROC_ENV)
    path: str | None = None
    made_dir = False
    if multiprocess:  # before prometheus_client's import, which reads it
        made_dir = not previous
        path = previous or tempfile.mkdtemp(prefix="zklock-metrics-")
        os.environ[MULTIPROC_ENV] = path
        os.environ[CHILD_ENV] = path
    try:
        _import_prometheus(port)
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        if path is not None:  # the pool processes' files, read by the collector
            _use_multiprocess_values()
            registry.register(_LiveCollector(path))
        recorder = Recorder(registry=registry if path is None else None)
        try:
            httpd, thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:
            raise ConfigurationError(
                f"{PORT_SETTING}: cannot serve metrics on {addr}:{port} ({exc}); give each "
                f"worker on a host a port of its own ({PORT_SETTING} / ZKLOCK_METRICS_PORT)"
            ) from exc
    except BaseException:
        _undo_multiprocess(path, made_dir, previous)
        raise
    _serving = _Serving(httpd, thread, addr, port, path, made_dir, previous)
    _multiproc_dir = path
    use_recorder(recorder)
    return addr, port


def stop() -> None:
    """Stop recording and serving (no-op if not serving); remove the multiprocess directory
    :func:`serve` made and restore ``PROMETHEUS_MULTIPROC_DIR``."""
    global _serving, _multiproc_dir
    serving, _serving = _serving, None
    use_recorder(None)
    _multiproc_dir = None
    if serving is None:
        return
    serving.httpd.shutdown()
    serving.httpd.server_close()
    serving.thread.join(5.0)
    _undo_multiprocess(serving.multiproc_dir, serving.made_dir, serving.previous_env)


def _undo_multiprocess(path: str | None, made_dir: bool, previous: str | None) -> None:
    """Undo what :func:`serve` did for the multiprocess directory ``path`` (None: nothing):
    restore ``PROMETHEUS_MULTIPROC_DIR`` to ``previous`` and remove ``path`` if it made it."""
    if path is None:
        return
    os.environ.pop(CHILD_ENV, None)
    if previous is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = previous
    if made_dir:
        shutil.rmtree(path, ignore_errors=True)


# -- the worker's lifecycle ---------------------------------------------------------------
def _forks(pool_cls: Any) -> bool:
    """True if ``pool_cls`` (a class, or a name as ``--pool`` takes it) runs tasks in pool
    processes: Celery's prefork pool or a subclass."""
    from celery.concurrency import get_implementation

    if pool_cls is None:
        return False
    if isinstance(pool_cls, str):
        pool_cls = get_implementation(pool_cls)
    from celery.concurrency.prefork import TaskPool

    return isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        if settings_of(app, connection=False).metrics_port is None:
            return
        serve(app, multiprocess=_forks(getattr(sender, "pool_cls", None)))
    except ConfigurationError as exc:
        # Celery logs and ignores exceptions of signal receivers: end the worker instead.
        raise SystemExit(f"celery-zklock: {exc}") from None


def _on_worker_ready(**_: Any) -> None:
    serving = _serving
    if serving is not None:  # worker_init comes before Celery sets up the worker's logging
        logger.info(
            "celery-zklock metrics on http://%s:%d/metrics%s",
            serving.addr,
            serving.port,
            f" (multiprocess directory {serving.multiproc_dir})" if serving.multiproc_dir else "",
        )


def _on_worker_process_init(**_: Any) -> None:
    global _multiproc_dir, _serving
    serving, _serving = _serving, None
    if serving is not None:  # forked: the endpoint is the main process's, not this one's
        serving.httpd.socket.close()
    recorder = active_recorder()
    if recorder is not None:  # forked: the parent's metrics, with this process's own files
        recorder.after_fork()
        return
    path = os.environ.get(CHILD_ENV)
    if path and os.environ.get(MULTIPROC_ENV) == path:  # spawned by a prefork worker
        try:
            _use_multiprocess_values()
            use_recorder(Recorder(registry=None))
            _multiproc_dir = path
        except ImportError:
            logger.warning("celery-zklock metrics: prometheus-client is not importable here")


def _on_worker_process_shutdown(pid: Any = None, **_: Any) -> None:
    path = _multiproc_dir
    if path is not None:
        dead = pid if isinstance(pid, int) else os.getpid()
        _module("prometheus_client.multiprocess").mark_process_dead(dead, path)


def _on_worker_shutdown(**_: Any) -> None:
    stop()


#: This module's worker signal receivers, in order, for :func:`celery_zklock.worker.wiring.install`.
RECEIVERS: Final = (
    (worker_init, _on_worker_init),
    (worker_ready, _on_worker_ready),
    (worker_process_init, _on_worker_process_init),
    (worker_process_shutdown, _on_worker_process_shutdown),
    (worker_shutdown, _on_worker_shutdown),
)
