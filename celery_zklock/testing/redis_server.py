"""A throw-away Redis server for tests and demos: a child of ours, on 127.0.0.1.

By default it keeps nothing on disk. ``appendonly=True`` makes it persistent (an append-only
file in its private directory, fsynced as ``appendfsync`` says: with ``"always"`` every write
is on disk before Redis answers, so a crash loses nothing acknowledged), and
:meth:`RedisServer.restart` kills and restarts it on the same port and directory, which is how
a broker restart is tested.
``bind`` adds addresses to listen on besides 127.0.0.1 (e.g. a veth address reachable from a
network namespace); they must exist when the server starts.

Ready means: our child is alive, answers ``PING`` with ``+PONG``, and the socket listening on its
port is the child's own (a Redis that another program runs on that port is never taken for ours).
A start whose port was taken is retried with a new port. ``redis-server`` is found through the
``executable`` argument or ``PATH``; if missing, :class:`MissingDependency` names the package.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from celery_zklock.testing.processes import (
    ChildProcess,
    MissingDependency,
    StackError,
    free_port,
    listener_is_owned_by,
    make_temp_dir,
    remove_temp_dir,
    tail,
)
from celery_zklock.validate import positive_int

__all__ = ["APPENDFSYNC_POLICIES", "RedisServer"]

APPENDFSYNC_POLICIES = ("always", "everysec", "no")
_BIND_FAILURE_RE = re.compile(r"Address already in use|Could not create server TCP", re.I)


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A Redis server on a free 127.0.0.1 port with a private directory, removed on stop.

    ``start`` returns once it is ready (see the module docstring); ``stop`` returns once the
    process is gone. Usable as a context manager. ``port_picker`` replaces :func:`free_port`
    (tests use it to force a taken port); ``start_attempts`` is how many ports a start tries.
    ``appendonly``/``appendfsync`` choose persistence and ``bind`` extra listen addresses (see
    the module docstring). Raises ValueError naming a bad option.
    """

    def __init__(
        self,
        *,
        executable: str | None = None,
        port_picker: Callable[[], int] | None = None,
        start_attempts: int = 3,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        bind: Sequence[str] = (),
    ) -> None:
        positive_int("start_attempts", start_attempts)
        if appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(
                f"appendfsync must be one of {', '.join(APPENDFSYNC_POLICIES)}, got {appendfsync!r}"
            )
        if isinstance(bind, str):
            raise ValueError("bind must be a sequence of addresses, not one string")
        self._appendonly = appendonly
        self._appendfsync = appendfsync
        self._bind = ["127.0.0.1", *(a for a in bind if a != "127.0.0.1")]
        self._executable = executable
        self._pick_port = port_picker or free_port
        self._start_attempts = start_attempts
        self._child: ChildProcess | None = None
        self._port: int | None = None
        self._directory: Path | None = None
        self.last_log_tail = ""

    def __repr__(self) -> str:
        return f"<RedisServer port={self._port} pid={self.pid}>"

    def _find_executable(self) -> str:
        name = self._executable or "redis-server"
        found = shutil.which(name)
        if found is None:
            raise MissingDependency(
                f"{name!r} was not found on PATH: install it with `apt-get install -y redis-server`"
            )
        return found

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start Redis and wait until it answers PING; return self.

        Raises MissingDependency (redis-server not installed), or StackError (already running,
        exited, not ready within ``timeout`` seconds, or every attempt found its port taken;
        the message ends with the server's log).
        """
        if self._child is not None:
            raise StackError(f"{self!r} is already started; call stop() first")
        executable = self._find_executable()
        deadline = time.monotonic() + timeout
        failures: list[str] = []
        for _ in range(self._start_attempts):
            port = self._pick_port()
            directory = make_temp_dir("zklock-redis-")
            child = self._child_for(executable, port, directory)
            try:
                child.start()
                outcome = self._wait_ready(child, port, deadline)
            except BaseException:
                self._discard(child, directory)
                raise
            if outcome is None:
                self._child, self._port, self._directory = child, port, directory
                return self
            failures.append(outcome)
            self._discard(child, directory)
            if time.monotonic() >= deadline:
                break
        raise StackError(
            f"Redis could not start: its port was taken by another process in {len(failures)} "
            "attempt(s), each with a new free port.\n" + "\n".join(failures)
        )

    def _child_for(self, executable: str, port: int, directory: Path) -> ChildProcess:
        settings = {
            "port": str(port),
            "bind": " ".join(self._bind),
            "dir": str(directory),
            "save": "",
            "appendonly": "yes" if self._appendonly else "no",
            "appendfsync": self._appendfsync,
            "daemonize": "no",
            "protected-mode": "no",
            "logfile": "",  # stdout, which goes to redis.log
        }
        return ChildProcess(
            f"Redis (port {port})",
            [executable, *(arg for k, v in settings.items() for arg in (f"--{k}", v))],
            log_path=directory / "redis.log",
            cwd=directory,
        )

    def restart(self, timeout: float = 10.0, *, sig: int = signal.SIGKILL) -> float:
        """Stop the server with ``sig`` (default SIGKILL: a crash), start it again on the same
        port and directory, and wait until it is ready; return the seconds it was down.

        Without ``appendonly`` the data is gone afterwards; with it, Redis reloads the
        append-only file. Raises StackError if it is not running, does not die within
        ``timeout`` seconds, or does not come back (e.g. another program took the port).
        """
        child, directory, port = self._child, self._directory, self._port
        if child is None or directory is None or port is None or not child.is_running():
            raise StackError(f"{self!r} is not running: nothing to restart")
        down_since = time.monotonic()
        child.send_signal(sig)
        if not child.wait(timeout):
            child.kill()
        replacement = self._child_for(self._find_executable(), port, directory)
        replacement.start()
        self._child = replacement
        try:
            outcome = self._wait_ready(replacement, port, time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        if outcome is not None:
            self.stop()
            raise StackError(f"Redis could not restart on port {port}: {outcome}")
        return time.monotonic() - down_since

    def _wait_ready(self, child: ChildProcess, port: int, deadline: float) -> str | None:
        """None once ready; a reason to retry with another port; raises StackError otherwise."""
        while True:
            pid = child.pid
            if pid is None:
                log = tail(child.log_path)
                message = (
                    f"Redis (port {port}) exited with status {child.returncode} while starting."
                    f"\n--- last lines of {child.log_path} ---\n{log}"
                )
                if _BIND_FAILURE_RE.search(log):
                    return message
                raise StackError(message)
            if _ping(port):
                if listener_is_owned_by(pid, port):
                    return None
                if child.is_running():
                    return f"port {port} answers PING but its listener belongs to another process"
            if time.monotonic() >= deadline:
                raise StackError(
                    f"Redis (pid {pid}, port {port}) did not answer PING before the deadline."
                    f"\n--- last lines of {child.log_path} ---\n{tail(child.log_path)}"
                )
            time.sleep(0.01)

    def _discard(self, child: ChildProcess, directory: Path) -> None:
        child.stop(grace=3.0)
        self.last_log_tail = tail(child.log_path)
        remove_temp_dir(directory)

    def stop(self) -> None:
        """Stop Redis and remove its directory; returns once the process is gone. Idempotent."""
        child, directory = self._child, self._directory
        self._child = self._directory = None
        self._port = None
        if child is not None and directory is not None:
            self._discard(child, directory)

    @property
    def port(self) -> int:
        """The port (raises StackError before start)."""
        if self._port is None:
            raise StackError("the Redis server is not started: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (raises StackError before start)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def directory(self) -> Path | None:
        """The server's private directory while it runs (removed on stop), else None."""
        return self._directory

    @property
    def pid(self) -> int | None:
        """The process id while it runs, else None."""
        return self._child.pid if self._child is not None else None

    def is_running(self) -> bool:
        """True while the process runs."""
        return self._child is not None and self._child.is_running()

    def __enter__(self) -> RedisServer:
        return self if self._child is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
