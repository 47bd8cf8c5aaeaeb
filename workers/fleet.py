"""The fleet launcher: N ``python -m workers`` processes with chosen pools, as our children.

Each worker runs the same entry point and reads the same ``ZKLOCK_*`` settings as the compose
``worker`` service (:mod:`workers.__main__`, :mod:`workers.settings`); its node name is
``<label>-<run_id>@<host>`` and its output goes to ``<log_dir>/worker-<label>.log`` (appended
across restarts). A worker given a :class:`~workers.netns.Namespace` runs inside it, with its
Redis and ZooKeeper addresses rewritten to the host's ends of the namespace's links.

:class:`Fleet` starts the workers, waits until each answers a ``celery inspect ping``
(:meth:`Fleet.wait_ready`), tells which worker a process id belongs to (the worker itself or
one of its pool processes, :meth:`Fleet.find`), restarts a worker that died
(:meth:`Fleet.restart`, :meth:`Fleet.revive`), adds and removes workers during a run
(:meth:`Fleet.add`, :meth:`Fleet.remove`: a fault's own workers, e.g. one pinned to a chosen
ZooKeeper member), and stops them all (:meth:`Fleet.stop`: SIGTERM for a warm shutdown, SIGKILL
of each worker's whole process group after a grace period).
Workers are children of the thread that starts them and die with it (see
:mod:`celery_zklock.testing.processes`): start and restart them from the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Final

from celery import Celery

from celery_zklock.testing import StackError
from celery_zklock.testing.processes import ChildProcess, tail
from workers.__main__ import worker_command
from workers.netns import Namespace
from workers.settings import Settings

__all__ = ["Fleet", "FleetWorker", "WorkerSpec", "descendants", "pid_alive"]

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
STOP_GRACE: Final = 10.0
PING_TIMEOUT: Final = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a fleet: its pool, concurrency, and optionally a namespace to run in.

    ``zk_hosts`` replaces the fleet's ZooKeeper connection string for this worker (e.g. one
    member only). ``queues``, if given, are the only queues it consumes besides its own
    ``worker_direct`` queue (``-Q``): a worker that must not take the run's workload.
    """

    label: str
    pool: str
    concurrency: int
    netns: Namespace | None = None
    zk_hosts: str | None = None
    queues: tuple[str, ...] = ()


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every live process (zombies left out), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if state not in ("Z", "X"):
                parents[int(entry)] = int(parent)
    return parents


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class FleetWorker:
    """One ``python -m workers`` subprocess (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, settings: Settings, run_id: str, log_dir: Path) -> None:
        self.spec = spec
        self.label = spec.label
        self.node_prefix = f"{spec.label}-{run_id}@"
        self.nodename = f"{self.node_prefix}{socket.gethostname()}"
        settings = replace(settings, pool=spec.pool, concurrency=spec.concurrency)
        if spec.zk_hosts is not None:
            settings = replace(settings, zk_hosts=spec.zk_hosts)
        if spec.netns is not None:
            settings = replace(
                settings,
                zk_hosts=spec.netns.rehost(settings.zk_hosts),
                broker_url=spec.netns.rehost(settings.broker_url),
                result_backend=spec.netns.rehost(settings.result_backend),
                record_url=spec.netns.rehost(settings.record_url),
            )
        self.settings = settings
        self.log_path = log_dir / f"worker-{spec.label}.log"
        self.restarts = 0
        self._child: ChildProcess | None = None

    def __repr__(self) -> str:
        spec = self.spec
        return f"<FleetWorker {self.label} {spec.pool} x{spec.concurrency} pid={self.pid}>"

    @property
    def netns(self) -> Namespace | None:
        return self.spec.netns

    def describe(self) -> str:
        where = f" in netns {self.netns.name}" if self.netns is not None else ""
        return f"{self.nodename} ({self.spec.pool} x{self.spec.concurrency}, pid {self.pid}{where})"

    def start(self) -> None:
        """Start the worker process (it is ready later: see :meth:`Fleet.wait_ready`)."""
        if self.is_running():
            raise StackError(f"worker {self.label} is already running (pid {self.pid})")
        extra = ["-n", f"{self.node_prefix}%h"]
        if self.spec.queues:
            extra += ["-Q", ",".join(self.spec.queues)]
        argv = worker_command(extra)
        if self.netns is not None:
            argv = self.netns.argv(argv)
        self._child = ChildProcess(
            f"worker {self.label}",
            argv,
            log_path=self.log_path,
            cwd=REPO_ROOT,
            env={**os.environ, **self.settings.to_env()},
        )
        self._child.start()

    @property
    def pid(self) -> int | None:
        """The worker's main process id while it runs, else None."""
        return self._child.pid if self._child is not None else None

    @property
    def returncode(self) -> int | None:
        return self._child.returncode if self._child is not None else None

    def is_running(self) -> bool:
        return self._child is not None and self._child.is_running()

    def process_ids(self) -> set[int]:
        """The main process and its descendants (a prefork worker's pool processes)."""
        pid = self.pid
        return set() if pid is None else {pid, *descendants(pid)}

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting."""
        if self._child is not None:
            self._child.send_signal(signal.SIGTERM)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM, SIGKILL after ``grace`` s; then SIGKILL the rest of its process group.

        Returns once the main process is gone. The worker leads its own process group, so its
        pool processes go with the group.
        """
        child = self._child
        if child is None:
            return
        pgid = child.pid
        try:
            child.stop(grace=grace)
        finally:
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole process group at once; returns once the main process is gone."""
        child = self._child
        if child is None:
            return
        pgid = child.pid
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        child.kill(timeout=timeout)


class Fleet:
    """Workers for ``specs`` with ``settings`` (pool and concurrency per spec).

    ``app`` (any app on the same broker, e.g. :func:`workers.app.create_app` with these
    settings) is used to ping the workers. Usable as a context manager: stops on exit.
    """

    def __init__(
        self,
        app: Celery,
        settings: Settings,
        specs: Sequence[WorkerSpec],
        run_id: str,
        log_dir: Path,
    ) -> None:
        labels = [spec.label for spec in specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"worker labels must be unique, got {labels}")
        self.app = app
        self.settings = settings
        self.run_id = run_id
        self.workers = [FleetWorker(spec, settings, run_id, log_dir) for spec in specs]
        self.log_dir = log_dir
        self.unexpected_exits: list[tuple[str, int | None, float]] = []
        """``(label, exit status, time)`` of each worker that :meth:`revive` found dead."""
        self._stopped = False

    def __iter__(self) -> Iterator[FleetWorker]:
        return iter(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def start(self, timeout: float = 60.0) -> Fleet:
        """Start every worker and wait until all answer a ping; return self.

        Raises StackError (with the end of the log) if one exits or time runs out.
        """
        for worker in self.workers:
            worker.start()
        self.wait_ready(self.workers, timeout)
        return self

    def wait_ready(self, workers: Iterable[FleetWorker], timeout: float) -> None:
        """Return once each of ``workers`` answered a ping; raise StackError if one exits first
        or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        missing = list(workers)
        problem = ""
        while missing:
            for worker in missing:
                if not worker.is_running():
                    raise StackError(
                        f"worker {worker.label} exited with status {worker.returncode} while "
                        f"starting:\n{worker.log_tail()}"
                    )
            try:
                replies = self.app.control.ping(
                    destination=[w.nodename for w in missing], timeout=PING_TIMEOUT
                )
                problem = ""
            except Exception as exc:  # the broker restarting: ask again
                problem = f" (last ping failed: {exc!r})"
                replies = []
            answered = {name for reply in replies for name in reply}
            missing = [w for w in missing if w.nodename not in answered]
            if missing and time.monotonic() >= deadline:
                tails = "\n".join(f"--- {w.label} ---\n{w.log_tail()}" for w in missing)
                raise StackError(
                    f"workers did not answer a ping within {timeout:.0f} s{problem}:\n{tails}"
                )
            if problem and missing:
                time.sleep(PING_TIMEOUT)  # a failed ping returns at once: pace the retries

    def find(self, pid: int) -> FleetWorker | None:
        """The worker whose main process or pool process ``pid`` is, or None."""
        for worker in self.workers:
            if worker.pid == pid:
                return worker
        for worker in self.workers:
            if pid in worker.process_ids():
                return worker
        return None

    def by_nodename(self, nodename: str) -> FleetWorker | None:
        """The worker with that Celery node name (``hostname`` in the section records)."""
        return next((w for w in self.workers if w.nodename == nodename), None)

    def restart(self, worker: FleetWorker, timeout: float = 60.0) -> None:
        """Kill what is left of ``worker``, start it again and wait until it answers a ping."""
        worker.kill()
        worker.restarts += 1
        worker.start()
        self.wait_ready([worker], timeout)

    def revive(
        self, timeout: float = 60.0, on_dead: Callable[[FleetWorker], None] | None = None
    ) -> list[FleetWorker]:
        """Restart every worker that exited on its own (not stopped by us); return them.

        What is left of each one's process group is killed first; then ``on_dead(worker)`` is
        called (every process of the old worker is gone by then), then the worker restarts.
        Each such exit is listed in :attr:`unexpected_exits`.
        """
        if self._stopped:
            return []
        dead = [w for w in self.workers if not w.is_running()]
        for worker in dead:
            self.unexpected_exits.append((worker.label, worker.returncode, time.time()))
            worker.kill()
            if on_dead is not None:
                on_dead(worker)
            worker.restarts += 1
            worker.start()
        if dead:
            self.wait_ready(dead, timeout)
        return dead

    def add(self, specs: Sequence[WorkerSpec], timeout: float = 60.0) -> list[FleetWorker]:
        """Start workers for ``specs`` (labels unused so far) and wait until each answers a
        ping; they belong to the fleet from then on (until :meth:`remove`). If one does not
        start, every one of them is stopped again and StackError raised."""
        taken = {w.label for w in self.workers}
        labels = [spec.label for spec in specs]
        if taken & set(labels) or len(set(labels)) != len(labels):
            raise ValueError(f"worker labels must be unique, got {labels} besides {sorted(taken)}")
        added = [FleetWorker(spec, self.settings, self.run_id, self.log_dir) for spec in specs]
        try:
            for worker in added:
                worker.start()
            self.wait_ready(added, timeout)
        except BaseException:
            _stop_all(added, STOP_GRACE)
            raise
        self.workers += added
        return added

    def remove(self, workers: Sequence[FleetWorker], grace: float = STOP_GRACE) -> None:
        """Take ``workers`` out of the fleet and stop them (warm shutdowns in parallel)."""
        self.workers = [w for w in self.workers if all(w is not gone for gone in workers)]
        _stop_all(workers, grace)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker within one ``grace`` period (warm shutdowns run in parallel)."""
        self._stopped = True
        _stop_all(self.workers, grace)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _stop_all(workers: Sequence[FleetWorker], grace: float) -> None:
    """Stop ``workers`` within one ``grace`` period; raise the first error after trying all."""
    for worker in workers:
        worker.request_stop()
    deadline = time.monotonic() + grace
    errors: list[Exception] = []
    for worker in workers:
        try:
            worker.stop(grace=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # stop the others anyway, then report
            errors.append(exc)
    if errors:
        raise errors[0]
