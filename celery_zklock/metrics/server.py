"""Prometheus metrics of the lock signals, served by a worker on ``zklock_metrics_port``.

Enabling: set ``zklock_metrics_port`` (env ``ZKLOCK_METRICS_PORT``) and install the
``prometheus`` extra (``pip install celery-zklock[prometheus]``); ``zklock_metrics_addr`` (env
``ZKLOCK_METRICS_ADDR``, default ``0.0.0.0``) is the address the endpoint binds. Unset, nothing
happens: prometheus-client is not imported and the signal receivers return at once. Set while
the package is missing, or on a port that cannot be bound, the worker refuses to start with a
:class:`~celery_zklock.ConfigurationError` naming what to do.

What is measured (names, types and labels: ``docs/metrics.md``): acquisitions by outcome, wait
and hold times, lost leases by reason (:func:`lost_reason` maps the lease code's texts to a
small set), and the leases held now.

Processes. The receivers record in the process that sends the signal, the one running the task.

- ``threads``, ``solo``, ``gevent``, ``eventlet`` pools: in-process. At ``worker_init`` the worker
  builds the metrics in a registry of its own and serves that registry over HTTP.
- ``prefork``: the pool processes record, the worker's main process serves, through
  prometheus-client's multiprocess mode. At ``worker_init`` (in the main process, before any
  pool process is forked) the worker points ``PROMETHEUS_MULTIPROC_DIR`` at a directory made
  for this worker (or keeps the one already set), so every pool process writes its values to
  files of its own there; the main process serves a ``MultiProcessCollector`` over that
  directory. A pool process that exits drops its share of the ``leases_held`` gauge
  (``mark_process_dead`` at ``worker_process_shutdown``; one killed without that chance is
  dropped at the next scrape). ``worker_shutdown`` stops the server and removes the directory
  the worker made. Counters and histograms of pool processes that exited stay in the totals.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from celery_zklock import signals
from celery_zklock.errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = [
    "BUCKETS",
    "LOST_REASONS",
    "OUTCOMES",
    "Recorder",
    "busy_outcome",
    "lost_reason",
    "metrics_addr",
    "metrics_port",
    "serve",
    "stop",
]

logger = logging.getLogger("celery_zklock.metrics")

PORT_SETTING: Final = "zklock_metrics_port"
ADDR_SETTING: Final = "zklock_metrics_addr"
DEFAULT_ADDR: Final = "0.0.0.0"
INSTALL_HINT: Final = "pip install celery-zklock[prometheus]"
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
CHILD_ENV: Final = "CELERY_ZKLOCK_METRICS_DIR"
"""Set by a prefork worker's main process for its pool processes: the multiprocess directory
(pool processes started by ``spawn`` or ``forkserver`` inherit no Python state, only this)."""

OUTCOMES: Final = ("granted", "skipped", "timed_out", "busy_raised", "retried")
"""The ``outcome`` label of ``zklock_acquisitions_total``: one per attempt that got or gave up
the lock (a ``wait`` ends as granted or timed_out)."""
LOST_REASONS: Final = ("session_expired", "lease_clock", "node_deleted", "broken", "other")
"""The ``reason`` label of ``zklock_lost_total``."""
BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Histogram buckets (seconds) of the wait and hold times: 1 ms to 10 min, then ``+Inf``."""

_BUSY_OUTCOMES: Final[Mapping[str, str]] = {
    "skip": "skipped",
    "retry": "retried",
    "raise": "busy_raised",
}
# Lowercase fragments of the reasons celery_zklock.locks gives (context.py, mutex.py), first
# match wins; tests/unit/test_metrics_mapping.py checks every reason the lease code can give.
_REASON_FRAGMENTS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("lease_clock", ("lease clock", "no answer from the zookeeper leader")),
    (
        "session_expired",
        ("session expired", "session changed", "session that created the lock node ended"),
    ),
    ("node_deleted", ("node was deleted",)),
    ("broken", ("broken by operator",)),
)
_LOST_MEMORY: Final = 1024
"""Leases remembered per process to count each loss once whichever signal tells it first."""


def busy_outcome(policy: str) -> str | None:
    """The outcome of an attempt that found the lock busy under ``policy`` (``lock_busy``'s
    keyword): ``skipped``, ``retried`` or ``busy_raised``; None for ``wait``, whose outcome is
    decided later (``granted`` by ``lock_acquired``, or ``timed_out``)."""
    return _BUSY_OUTCOMES.get(policy)


def lost_reason(reason: object) -> str:
    """One of :data:`LOST_REASONS` for the free-text ``reason`` of a lost lease.

    ``lease_clock``: the lease clock ran out (no answer from the ZooKeeper leader in time, or
    the process was paused); ``session_expired``: the session behind the node expired or was
    replaced; ``node_deleted``: someone else deleted the lock node; ``broken``: an operator broke
    it (``celery zklock break``); ``other``: anything else,
    None included.
    """
    text = str(reason or "").lower()
    for kind, fragments in _REASON_FRAGMENTS:
        if any(fragment in text for fragment in fragments):
            return kind
    return "other"


def metrics_port(conf: Mapping[str, Any]) -> int | None:
    """``zklock_metrics_port`` (env ``ZKLOCK_METRICS_PORT``): the port, or None (off) when unset
    or empty. Raises ConfigurationError unless it is a port number (1-65535)."""
    value = _setting(conf, PORT_SETTING)
    if value is None or str(value).strip() == "":
        return None
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if isinstance(value, bool) or not 1 <= port <= 65535:
        raise ConfigurationError(f"{PORT_SETTING} must be a port number (1-65535), got {value!r}")
    return port


def metrics_addr(conf: Mapping[str, Any]) -> str:
    """``zklock_metrics_addr`` (env ``ZKLOCK_METRICS_ADDR``): the address the endpoint binds."""
    value = _setting(conf, ADDR_SETTING)
    return DEFAULT_ADDR if value is None or str(value).strip() == "" else str(value).strip()


def _setting(conf: Mapping[str, Any], name: str) -> Any:
    value = conf.get(name)
    return os.environ.get(name.upper()) if value is None else value


class Recorder:
    """The metrics of one process and the bookkeeping that turns the lock signals into them.

    ``registry``: where the metrics register (None in multiprocess mode, where a
    ``MultiProcessCollector`` reads them from the files instead). Thread-safe: ``lock_lost``
    comes from the lease clock's thread.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.acquisitions = Counter(
            "zklock_acquisitions",
            "Lock acquisition attempts of locked tasks, by outcome.",
            ["task", "outcome"],
            registry=registry,
        )
        self.wait = Histogram(
            "zklock_wait_seconds",
            "Seconds from the start of a locked run to the grant of its lock.",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "zklock_hold_seconds",
            "Seconds a lock was held, from its grant to its release.",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.lost = Counter(
            "zklock_lost",
            "Leases lost, by reason.",
            ["task", "reason"],
            registry=registry,
        )
        self.held = Gauge(
            "zklock_leases_held",
            "Leases granted and not yet released.",
            ["task"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._lock = threading.Lock()
        self._lost_leases: OrderedDict[tuple[Any, ...], None] = OrderedDict()

    def after_fork(self) -> None:
        """Forget what the parent process knew (a pool process starts with no lease)."""
        self._lock = threading.Lock()
        self._lost_leases = OrderedDict()

    def acquired(self, task: str, waited: float) -> None:
        self.acquisitions.labels(task, "granted").inc()
        self.wait.labels(task).observe(max(0.0, waited))
        self.held.labels(task).inc()

    def outcome(self, task: str, outcome: str) -> None:
        self.acquisitions.labels(task, outcome).inc()

    def lease_lost(self, task: str, lease: tuple[Any, ...], reason: object) -> None:
        """``lock_lost``: counted unless the release already counted this lease's loss."""
        with self._lock:
            if self._lost_leases.pop(lease, False) is None:
                return
            self._remember(lease)
        self.lost.labels(task, lost_reason(reason)).inc()

    def released(self, task: str, lease: tuple[Any, ...], held: float, lost: bool) -> None:
        """``lock_released``; a lease released lost whose loss was not told (found at the
        release, or told after it) counts as lost here, with its reason unknown (``other``)."""
        self.hold.labels(task).observe(max(0.0, held))
        self.held.labels(task).dec()
        with self._lock:
            told = self._lost_leases.pop(lease, False) is None
            if lost and not told:
                self._remember(lease)  # so a late lock_lost for it is not counted twice
        if lost and not told:
            self.lost.labels(task, "other").inc()

    def _remember(self, lease: tuple[Any, ...]) -> None:
        self._lost_leases[lease] = None
        while len(self._lost_leases) > _LOST_MEMORY:
            self._lost_leases.popitem(last=False)


# -- the signal receivers: record in the process that runs the task -----------------------
_recorder: Recorder | None = None


def _task(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "unknown")


def _lease(kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    return (kwargs.get("task_id"), kwargs.get("path"), kwargs.get("token"))


def _seconds(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _on_acquired(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.acquired(_task(sender), _seconds(kwargs.get("waited")))


def _on_busy(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    outcome = busy_outcome(str(kwargs.get("policy")))
    if recorder is not None and outcome is not None:
        recorder.outcome(_task(sender), outcome)


def _on_timeout(sender: Any = None, **_: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.outcome(_task(sender), "timed_out")


def _on_lost(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.lease_lost(_task(sender), _lease(kwargs), kwargs.get("reason"))


def _on_released(sender: Any = None, **kwargs: Any) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.released(
            _task(sender), _lease(kwargs), _seconds(kwargs.get("held")), bool(kwargs.get("lost"))
        )


_RECEIVERS: Final = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_busy, _on_busy),
    (signals.lock_lost, _on_lost),
    (signals.lock_released, _on_released),
    (signals.lock_timeout, _on_timeout),
)


def use_recorder(recorder: Recorder | None) -> None:
    """Record the lock signals of this process with ``recorder`` (None: stop recording).

    The receivers are connected only while there is a recorder: a signal without receivers
    costs a locked task nothing (celery_zklock.events skips the send), and most workers do not
    serve metrics.
    """
    global _recorder
    _recorder = recorder
    for signal, receiver in _RECEIVERS:
        if recorder is None:
            signal.disconnect(receiver, dispatch_uid="zklock-metrics")
        else:
            signal.connect(receiver, weak=False, dispatch_uid="zklock-metrics")


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
    gone: list[int] = []
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return gone
    for name in names:
        if not (name.startswith("gauge_live") and name.endswith(".db")):
            continue
        pid_text = name[: -len(".db")].rsplit("_", 1)[-1]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            gone.append(int(pid_text))
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(conf: Mapping[str, Any], *, multiprocess: bool) -> tuple[str, int] | None:
    """Start recording the lock signals and serving the metrics over HTTP, per ``conf``
    (an app's ``conf``; the environment fills in what it lacks): the bound ``(addr, port)``,
    or None when ``zklock_metrics_port`` is unset.

    ``multiprocess``: the signals are sent in pool processes this process forks or spawns after
    this call (prefork); the multiprocess directory is set up and the pool processes record
    into it. Raises ConfigurationError on a bad setting, a missing prometheus-client or a
    port that cannot be bound (nothing is left started), RuntimeError if already serving.
    """
    global _recorder, _serving, _multiproc_dir
    port = metrics_port(conf)
    if port is None:
        return None
    if _serving is not None:
        raise RuntimeError("celery-zklock metrics are already served by this process")
    addr = metrics_addr(conf)
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
        if path is not None:
            _use_multiprocess_values()
            registry.register(_LiveCollector(path))
            recorder = Recorder(registry=None)
        else:
            recorder = Recorder(registry=registry)
        try:
            httpd, thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:
            raise ConfigurationError(
                f"{PORT_SETTING}: cannot serve metrics on {addr}:{port} ({exc}); give each "
                f"worker on a host a port of its own ({PORT_SETTING} / ZKLOCK_METRICS_PORT)"
            ) from exc
    except BaseException:
        if multiprocess:
            _restore_env(previous)
            if made_dir and path is not None:
                shutil.rmtree(path, ignore_errors=True)
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
    if serving.multiproc_dir is not None:
        _restore_env(serving.previous_env)
        if serving.made_dir:
            shutil.rmtree(serving.multiproc_dir, ignore_errors=True)


def _restore_env(previous: str | None) -> None:
    os.environ.pop(CHILD_ENV, None)
    if previous is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = previous


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
        if metrics_port(app.conf) is None:
            return
        serve(app.conf, multiprocess=_forks(getattr(sender, "pool_cls", None)))
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
    global _recorder, _multiproc_dir, _serving
    serving, _serving = _serving, None
    if serving is not None:  # forked: the endpoint is the main process's, not this one's
        serving.httpd.socket.close()
    if _recorder is not None:  # forked: the parent's metrics, with this process's own files
        _recorder.after_fork()
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
    if path is None:
        return
    multiprocess = _module("prometheus_client.multiprocess")
    multiprocess.mark_process_dead(pid if isinstance(pid, int) else os.getpid(), path)


def _on_worker_shutdown(**_: Any) -> None:
    stop()


worker_init.connect(_on_worker_init, weak=False, dispatch_uid="zklock-metrics")
worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="zklock-metrics")
worker_process_init.connect(_on_worker_process_init, weak=False, dispatch_uid="zklock-metrics")
worker_process_shutdown.connect(
    _on_worker_process_shutdown, weak=False, dispatch_uid="zklock-metrics"
)
worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="zklock-metrics")
