"""The fleet launcher: N fleet workers with chosen pools, as children of this process.

Each runs ``python -m workers worker``, the compose service's entry point, with the same
``ZKLOCK_*`` settings (:mod:`workers.settings`); one in a :class:`~workers.netns.Namespace` gets
its Redis and ZooKeeper addresses rewritten to the host's ends of the namespace's links.
:class:`Fleet` starts them and waits until each answers a ping, finds the worker a pid belongs
to, restarts, adds and removes workers during a run, and stops them all. Start and restart
them from the main thread: they die with the thread that started them
(:mod:`celery_zklock.testing.processes`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from celery import Celery

from celery_zklock.testing.celery_worker import CeleryWorker, stop_all, wait_until_answering
from celery_zklock.testing.processes import descendants, pid_alive
from workers.netns import Namespace
from workers.settings import Settings

# descendants and pid_alive live in celery_zklock.testing.processes; importable here as well.
__all__ = ["Fleet", "FleetWorker", "WorkerSpec", "descendants", "pid_alive", "worker_command"]


def worker_command(extra: Sequence[str] = (), *, python: str | None = None) -> list[str]:
    """The command line that starts a fleet worker as a subprocess.

    ``python`` defaults to this interpreter. The worker reads its settings from the
    subprocess's environment (``Settings.to_env()`` gives them); ``extra`` is appended to the
    ``celery worker`` arguments. The subprocess must find ``workers``: run it with the
    repository root as its working directory or on ``PYTHONPATH``.
    """
    return [python or sys.executable, "-m", "workers", "worker", *extra]


REPO_ROOT: Final = Path(__file__).resolve().parent.parent
STOP_GRACE: Final = 10.0


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


class FleetWorker(CeleryWorker):
    """One fleet worker: ``python -m workers worker`` with ``spec``'s pool and the fleet's
    settings (rewritten for its namespace, if any), node name ``<label>-<run_id>@<host>``."""

    def __init__(self, spec: WorkerSpec, settings: Settings, run_id: str, log_dir: Path) -> None:
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
        command = worker_command()
        super().__init__(
            spec.netns.argv(command) if spec.netns is not None else command,
            nodename=f"{spec.label}-{run_id}@%h",
            queues=spec.queues,
            log_path=log_dir / f"worker-{spec.label}.log",
            cwd=REPO_ROOT,
            env=settings.to_env(),
        )
        self.spec = spec
        self.label = spec.label
        self.settings = settings
        self.restarts = 0

    def __repr__(self) -> str:
        spec = self.spec
        return f"<FleetWorker {self.label} {spec.pool} x{spec.concurrency} pid={self.pid}>"

    @property
    def netns(self) -> Namespace | None:
        return self.spec.netns

    def respawn(self, on_dead: Callable[[FleetWorker], None] | None = None) -> None:
        """Kill what is left of the worker (its whole group), call ``on_dead(self)``, start it
        again (it is ready later: see :meth:`Fleet.wait_ready`)."""
        self.kill()
        if on_dead is not None:
            on_dead(self)
        self.restarts += 1
        self.spawn()

    def describe(self) -> str:
        where = f" in netns {self.netns.name}" if self.netns is not None else ""
        return f"{self.nodename} ({self.spec.pool} x{self.spec.concurrency}, pid {self.pid}{where})"


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
            worker.spawn()
        self.wait_ready(self.workers, timeout)
        return self

    def wait_ready(self, workers: Iterable[FleetWorker], timeout: float) -> None:
        """Return once each of ``workers`` answered a ping; raise StackError if one exits first
        or ``timeout`` seconds pass."""
        wait_until_answering(self.app, workers, timeout)

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
        worker.respawn()
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
            worker.respawn(on_dead)
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
                worker.spawn()
            self.wait_ready(added, timeout)
        except BaseException:
            stop_all(added, STOP_GRACE)
            raise
        self.workers += added
        return added

    def remove(self, workers: Sequence[FleetWorker], grace: float = STOP_GRACE) -> None:
        """Take ``workers`` out of the fleet and stop them (warm shutdowns in parallel)."""
        self.workers = [w for w in self.workers if all(w is not gone for gone in workers)]
        stop_all(workers, grace)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker within one ``grace`` period (warm shutdowns run in parallel)."""
        self._stopped = True
        stop_all(self.workers, grace)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
