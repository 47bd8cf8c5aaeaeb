"""A throw-away RabbitMQ node on 127.0.0.1 for tests and demos, a child of ours.

Debian's ``rabbitmq-server`` run as a private node: its own node name, AMQP and distribution
ports (free ones), database and log directory, no plugins (so no management port to collide
with another node's), removed on stop. Ready means it accepts AMQP connections (a kombu
connection as ``guest``) on a listening socket that is its own.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

from celery_zklock.testing.processes import (
    ChildProcess,
    MissingDependency,
    OneProcessService,
    StackError,
    free_port,
)

__all__ = ["RabbitMQServer"]

RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
"""Debian's node start script (``/usr/sbin/rabbitmq-server`` wraps it to run as ``rabbitmq``)."""
_BIND_FAILURE_RE = re.compile(r"eaddrinuse|address already in use", re.I)


def _accepts(port: int) -> bool | None:
    from kombu.connection import Connection

    try:
        url = f"amqp://guest:guest@127.0.0.1:{port}//"
        with Connection(url, connect_timeout=1) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1)
    except Exception:
        return None
    return True


class RabbitMQServer(OneProcessService):
    """A RabbitMQ node on free 127.0.0.1 ports with a private directory, removed on stop."""

    what = "the RabbitMQ node"
    _server = "RabbitMQ"

    def __init__(self, *, start_attempts: int = 2) -> None:
        self._start_attempts = start_attempts

    def __repr__(self) -> str:
        return f"<RabbitMQServer port={self._port} pid={self.pid}>"

    def _find_executable(self) -> str:
        if RABBITMQ_SERVER.is_file():
            return str(RABBITMQ_SERVER)
        found = shutil.which("rabbitmq-server")
        if found is None:
            raise MissingDependency(
                "rabbitmq-server was not found: install it with `apt-get install -y "
                "rabbitmq-server`"
            )
        return found

    def start(self, timeout: float = 90.0) -> RabbitMQServer:
        """Start the node and wait until it accepts AMQP connections; return self.

        Raises MissingDependency (not installed) or StackError (not ready in ``timeout``
        seconds, exited; the message ends with the node's log)."""
        self._start(timeout)
        return self

    def _wait_ready(self, child: ChildProcess, port: int, deadline: float) -> None:
        child.wait_ready(
            deadline, lambda: _accepts(port), ports=[port], bind_failure=_BIND_FAILURE_RE
        )

    def _child_for(self, executable: str, port: int, directory: Path) -> ChildProcess:
        (directory / "enabled_plugins").write_text("[].\n")
        env = {
            "PATH": "/usr/lib/rabbitmq/bin:/usr/sbin:/usr/bin:/bin",
            "HOME": str(directory),  # its own Erlang cookie
            # Run the Erlang VM in place of the script (no proxy process): the listening
            # socket is then our child's own.
            "RUNNING_UNDER_SYSTEMD": "true",
            "RABBITMQ_NODENAME": f"zklock-{uuid.uuid4().hex[:8]}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid"),
            # A node beside the test suite on a shared machine: no busy-waiting schedulers.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none",
        }
        return ChildProcess(
            f"RabbitMQ (port {port})",
            [executable],
            log_path=directory / "rabbitmq.log",
            cwd=directory,
            env=env,
            directory=directory,
        )

    def restart(self, timeout: float = 60.0, *, sig: int = signal.SIGKILL) -> float:
        """Stop the node with ``sig`` (default SIGKILL: a crash), start it again with the same
        name, ports and database, and wait until it accepts AMQP connections; return the
        seconds it was down.

        Durable queues and the persistent messages they held come back (Celery's messages are
        persistent by default), delivered-but-unacknowledged ones ready again. Raises
        StackError if it is not running, does not die within ``timeout`` seconds, or does not
        come back (e.g. another program took the port)."""
        return self._restart(timeout, sig)

    def close_connections(self, reason: str = "closed by a test", timeout: float = 60.0) -> None:
        """Close every client connection of the node (``rabbitmqctl close_all_connections``):
        what a passed ``consumer_timeout`` does to a consumer's channel, or a cut its
        heartbeats notice. The messages they held unacknowledged go back to their queues."""
        self._ctl("close_all_connections", reason, timeout=timeout)

    def set_consumer_timeout(self, seconds: float, check_every: float = 60.0) -> None:
        """Set the node's ``consumer_timeout`` and how often a channel checks it (its
        ``channel_tick_interval``; 60 s is RabbitMQ's own) for the channels opened from now on:
        a channel holding a delivery unacknowledged longer is closed with ``406
        PRECONDITION_FAILED`` at its next check. ``set_consumer_timeout(1800)`` restores both
        defaults (channels opened meanwhile keep what they read when they opened)."""
        for key, value in (("consumer_timeout", seconds), ("channel_tick_interval", check_every)):
            self._ctl("eval", f"application:set_env(rabbit, {key}, {round(value * 1000)}).")

    def _ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` against the node; its output (StackError if it fails)."""
        child = self._child
        if child is None or child.env is None or not child.is_running():
            raise StackError(f"{self!r} is not running")
        command = [str(RABBITMQCTL), "-n", child.env["RABBITMQ_NODENAME"], *args]
        done = subprocess.run(
            command, env=child.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise StackError(f"rabbitmqctl {args[0]} failed: {done.stderr.strip()}")
        return done.stdout

    @property
    def url(self) -> str:
        """``amqp://guest:guest@127.0.0.1:PORT//`` (raises StackError before start)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"
