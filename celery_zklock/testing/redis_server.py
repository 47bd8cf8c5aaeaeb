"""A throw-away Redis server on 127.0.0.1 for tests and demos, a child of ours.

It keeps nothing on disk unless ``appendonly=True``; :meth:`RedisServer.restart` crashes and
restarts it on the same port and directory (a broker restart). Ready means it answers ``PING``
on a listening socket that is its own; a start whose port was taken is retried on a new one.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from celery_zklock.testing.processes import (
    ChildProcess,
    MissingDependency,
    OneProcessService,
    free_port,
)
from celery_zklock.zk.validate import positive_int

__all__ = ["APPENDFSYNC_POLICIES", "RedisServer"]

APPENDFSYNC_POLICIES = ("always", "everysec", "no")
_BIND_FAILURE_RE = re.compile(r"Address already in use|Could not create server TCP", re.I)


def _ping(port: int, timeout: float = 0.5) -> bool | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG") or None
    except OSError:
        return None


class RedisServer(OneProcessService):
    """A Redis server on a free 127.0.0.1 port with a private directory, removed on stop.

    ``port_picker`` replaces :func:`free_port` (tests use it to force a taken port);
    ``start_attempts`` is how many ports a start tries. ``appendonly`` makes it persistent
    (fsynced as ``appendfsync`` says: with ``"always"`` a crash loses nothing acknowledged);
    ``bind`` adds addresses to listen on besides 127.0.0.1 (e.g. a veth address reachable from
    a network namespace; they must exist at start). ``redis-server`` is found through
    ``executable`` or ``PATH``. Raises ValueError naming a bad option.
    """

    what = "the Redis server"
    _server = "Redis"

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
        self._port_picker = port_picker or free_port
        self._start_attempts = start_attempts

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
        self._start(timeout)
        return self

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
            directory=directory,
        )

    def restart(self, timeout: float = 10.0, *, sig: int = signal.SIGKILL) -> float:
        """Stop the server with ``sig`` (default SIGKILL: a crash), start it again on the same
        port and directory, and wait until it is ready; return the seconds it was down.

        Without ``appendonly`` the data is gone afterwards; with it, Redis reloads the
        append-only file. Raises StackError if it is not running, does not die within
        ``timeout`` seconds, or does not come back (e.g. another program took the port).
        """
        return self._restart(timeout, sig)

    def _pick_port(self) -> int:
        return self._port_picker()

    def _wait_ready(self, child: ChildProcess, port: int, deadline: float) -> None:
        child.wait_ready(deadline, lambda: _ping(port), ports=[port], bind_failure=_BIND_FAILURE_RE)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (raises StackError before start)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def directory(self) -> Path | None:
        """The server's private directory while it runs (removed on stop), else None."""
        return None if self._child is None else self._child.directory
