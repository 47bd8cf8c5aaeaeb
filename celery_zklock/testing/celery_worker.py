"""A real ``celery worker`` as our child process: the one launcher of the tests, the fleet and
the benchmarks.

:func:`celery_command` builds the command line of a worker for any app, with the options every
worker we launch runs with (:func:`worker_options`); :class:`CeleryWorker` runs it in its own
process group, :func:`wait_until_answering` waits until workers answer a ping, and
:meth:`CeleryWorker.stop` ends the worker with its pool processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from celery_zklock.testing.processes import (
    ChildProcess,
    StackError,
    descendants,
    group_alive,
    wait_until,
)

__all__ = [
    "CeleryWorker",
    "celery_command",
    "stop_all",
    "wait_until_answering",
    "worker_options",
]

PING_TIMEOUT = 0.5
GROUP_KILL_TIMEOUT = 5.0
"""Seconds a SIGKILL of a worker's process group is given to take every process of it."""


def worker_options(pool: str, concurrency: int, loglevel: str = "info") -> list[str]:
    """``worker`` and its options: the pool, its size, the log level, and no start-up sync or
    worker-to-worker chatter (``--without-mingle --without-gossip --without-heartbeat``), so
    that a worker answers a ping about half a second after it starts."""
    return [
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "--loglevel",
        loglevel,
    ]


def celery_command(app: str, pool: str, concurrency: int, loglevel: str = "info") -> list[str]:
    """``python -m celery -A <app>`` with :func:`worker_options`, for this interpreter."""
    return [sys.executable, "-m", "celery", "-A", app, *worker_options(pool, concurrency, loglevel)]


class CeleryWorker(ChildProcess):
    """A ``celery worker`` subprocess, leader of its own process group.

    ``command`` starts the worker (:func:`celery_command`, or another entry point that takes
    ``celery worker`` options); ``-n <nodename>`` and, if given, ``-Q <queues>`` are appended.
    ``nodename`` may use ``%h`` (this host's name), as Celery does. With ``cwd``, the worker
    also finds its modules there (it goes first on ``PYTHONPATH``). Start it with
    :meth:`spawn`, then :func:`wait_until_answering`.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        nodename: str,
        log_path: Path,
        queues: Sequence[str] = (),
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.nodename = nodename.replace("%h", socket.gethostname())
        self.queues = tuple(queues)
        environ = {**os.environ, **(env or {})}
        if cwd is not None:
            environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(cwd), environ.get("PYTHONPATH", "")) if p
            )
        super().__init__(
            f"celery worker {self.nodename}",
            [*command, "-n", nodename, *(["-Q", ",".join(queues)] if queues else [])],
            log_path=log_path,
            cwd=cwd,
            env=environ,
        )

    def process_ids(self) -> set[int]:
        """The main process and its descendants (a prefork worker's pool processes)."""
        pid = self.pid
        return set() if pid is None else {pid, *descendants(pid)}

    def log_text(self) -> str:
        """The whole log."""
        return self.log_path.read_text(errors="replace")

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process) without waiting."""
        self.send_signal(signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (a warm shutdown), SIGKILL after ``grace`` seconds; then SIGKILL whatever is
        left of its process group (pool processes). Returns once the main process and every
        process of its group are dead (a killed orphan may stay a zombie until PID 1 reaps
        it)."""
        group = self.pid
        try:
            super().stop(grace)
        finally:
            self._signal_group(group)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole process group at once; returns once the main process is gone (and
        every process of its group dead, as :meth:`stop`)."""
        self._signal_group(self.pid)
        super().kill(timeout)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the worker's group (pool processes included)."""
        self._signal_group(self.pid, sig)

    @staticmethod
    def _signal_group(group: int | None, sig: int = signal.SIGKILL) -> None:
        if group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
            if sig == signal.SIGKILL:  # delivered at the processes' next run: wait for it
                wait_until(lambda: not group_alive(group), GROUP_KILL_TIMEOUT)


def wait_until_answering(app: Any, workers: Iterable[CeleryWorker], timeout: float) -> None:
    """Return once each of ``workers`` answered a ping through ``app`` (any app on their
    broker); raise StackError, with the end of its log, if one exits first or ``timeout``
    seconds pass. A broker that does not answer (restarting) is asked again."""
    deadline = time.monotonic() + timeout
    missing = list(workers)
    problem = ""
    while missing:
        for worker in missing:
            if not worker.is_running():
                raise StackError(
                    f"{worker.name} exited with status {worker.returncode} while starting:\n"
                    f"{worker.log_tail(30)}"
                )
        try:
            replies = app.control.ping(
                destination=[w.nodename for w in missing], timeout=PING_TIMEOUT
            )
            problem = ""
        except Exception as exc:  # the broker restarting: ask again
            problem = f" (last ping failed: {exc!r})"
            replies = []
        answered = {name for reply in replies for name in reply}
        missing = [w for w in missing if w.nodename not in answered]
        if missing and time.monotonic() >= deadline:
            tails = "\n".join(f"--- {w.nodename} ---\n{w.log_tail(30)}" for w in missing)
            raise StackError(
                f"workers did not answer a ping within {timeout:.0f} s{problem}:\n{tails}"
            )
        if problem and missing:
            time.sleep(PING_TIMEOUT)  # a failed ping returns at once: pace the retries


def stop_all(workers: Sequence[CeleryWorker], grace: float = 10.0) -> None:
    """Stop ``workers`` within one ``grace`` period (their warm shutdowns overlap); raise the
    first error after trying every one."""
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
