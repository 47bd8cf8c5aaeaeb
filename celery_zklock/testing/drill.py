"""The outage drill of the local stack: ``celery-zklock stack outage SECONDS`` asks a running
``celery-zklock stack up`` to SIGKILL its ZooKeeper (every member of an ensemble), wait that long,
and start it again on the same ports and data; and what ``stack up`` says when its ZooKeeper dies
without a drill.

The processes are ``stack up``'s children, so ``stack up`` does the drill itself: it listens on a
Unix socket, ``stack-<pid>.sock`` in :func:`control_dir` (private to the user), and the drill
command sends it one JSON line, ``{"outage": SECONDS}``. ``stack up`` answers with one JSON line
per step, :class:`Step`: ``killed`` (when, which pids), ``restarting``, ``serving`` (when, how
long ZooKeeper was down), or ``error``. It prints each step too, and it always brings ZooKeeper
back, also when the drill command goes away mid-drill; Ctrl-C of ``stack up`` during a drill
stops everything as usual.

:class:`DeathWatch` is ``stack up``'s watch over its ZooKeeper outside drills: each process that
exits is named once (pid, port, how it ended, the end of its log).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from celery_zklock.testing.processes import StackError, pid_alive
from celery_zklock.testing.zookeeper import ZooKeeperEnsemble, ZooKeeperNode, ZooKeeperServer

__all__ = [
    "DeathWatch",
    "Step",
    "control_dir",
    "control_socket",
    "find_stack",
    "request_outage",
    "serve_drill",
]

ZooKeeper = ZooKeeperServer | ZooKeeperEnsemble
REQUEST_TIMEOUT: Final = 5.0
"""Seconds ``stack up`` waits for a drill command's request line."""
RESTART_TIMEOUT: Final = 60.0
"""Seconds a drill waits for ZooKeeper to serve again."""
MAX_SECONDS: Final = 24 * 3600.0


@dataclass(frozen=True)
class Step:
    """One step of a drill, as ``stack up`` reports it: ``event`` is ``killed``, ``restarting``,
    ``serving`` or ``error``; ``at`` is wall-clock time (seconds since the epoch)."""

    event: str
    at: float
    pids: list[int] = field(default_factory=list)
    hosts: str = ""
    down: float | None = None
    """Seconds from the kill to serving again (``serving`` only)."""
    message: str = ""

    def describe(self) -> str:
        """One line for people, starting with the local time of day to the millisecond."""
        clock = (
            time.strftime("%H:%M:%S", time.localtime(self.at)) + f".{int(self.at % 1 * 1000):03d}"
        )
        if self.event == "killed":
            what = f"ZooKeeper {self.hosts} killed (SIGKILL; pids {self.pids})"
        elif self.event == "restarting":
            what = "starting ZooKeeper again on the same ports and data"
        elif self.event == "serving":
            what = f"ZooKeeper {self.hosts} serves again (pids {self.pids}): down {self.down:.2f} s"
        else:
            what = f"drill failed: {self.message}"
        return f"{clock} {what}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> Step:
        return cls(**json.loads(line))


def control_dir() -> Path:
    """Where ``stack up`` puts its control socket: ``$XDG_RUNTIME_DIR`` or the temporary
    directory, ``celery-zklock-<uid>`` (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"celery-zklock-{os.getuid()}"


def _socket_path(pid: int) -> Path:
    return control_dir() / f"stack-{pid}.sock"


@contextlib.contextmanager
def control_socket() -> Iterator[socket.socket]:
    """This process's listening control socket (non-blocking), removed on the way out."""
    directory = control_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = _socket_path(os.getpid())
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(4)
        listener.setblocking(False)
        yield listener
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def find_stack(pid: int | None) -> Path:
    """The control socket of the running ``stack up`` with ``pid``, or of the only one running.

    Raises StackError naming what was found when there is none, or several and no ``pid``."""
    if pid is not None:
        path = _socket_path(pid)
        if not path.exists() or not pid_alive(pid):
            raise StackError(f"no `celery-zklock stack up` with pid {pid} runs ({path} is absent)")
        return path
    running = []
    for path in sorted(control_dir().glob("stack-*.sock")):
        number = path.stem.removeprefix("stack-")
        if number.isdigit() and pid_alive(int(number)):
            running.append(int(number))
    if not running:
        raise StackError(
            f"no `celery-zklock stack up` runs (no control socket in {control_dir()}): start one"
        )
    if len(running) > 1:
        raise StackError(
            f"several `celery-zklock stack up` run (pids {running}): choose one with --stack PID"
        )
    return _socket_path(running[0])


def request_outage(path: Path, seconds: float, timeout: float) -> Iterator[Step]:
    """Ask the ``stack up`` behind ``path`` for an outage of ``seconds``; yield its steps as they
    come, up to ``serving`` or ``error``. Raises StackError if it stops answering for
    ``timeout`` seconds beyond the outage itself."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(seconds + timeout)
        try:
            conn.connect(str(path))
            conn.sendall((json.dumps({"outage": seconds}) + "\n").encode())
            for line in conn.makefile("r", encoding="utf-8"):
                step = Step.from_json(line)
                yield step
                if step.event in ("serving", "error"):
                    return
        except OSError as exc:  # socket.timeout too
            raise StackError(
                f"`celery-zklock stack up` at {path} stopped answering: {exc}"
            ) from exc
    raise StackError(f"`celery-zklock stack up` at {path} ended the drill without an answer")


def _read_request(conn: socket.socket) -> float:
    conn.settimeout(REQUEST_TIMEOUT)
    raw = b""
    while not raw.endswith(b"\n") and len(raw) < 4096:
        chunk = conn.recv(4096)
        if not chunk:
            break
        raw += chunk
    try:
        seconds = float(json.loads(raw)["outage"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f'a drill request is one JSON line {{"outage": SECONDS}}, got {raw[:200]!r}'
        ) from exc
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(
            f"an outage lasts more than 0 and at most {MAX_SECONDS:g} seconds, got {seconds:g}"
        )
    return seconds


def _nodes(zookeeper: ZooKeeper) -> list[ZooKeeperNode]:
    return zookeeper.nodes if isinstance(zookeeper, ZooKeeperEnsemble) else [zookeeper.node]


def serve_drill(
    listener: socket.socket,
    zookeeper: ZooKeeper,
    wait: Callable[[float], bool],
    say: Callable[[str], None],
) -> bool:
    """Run the drill of the one drill command waiting on ``listener``, if any: kill, ``wait``
    the outage (True from it: stop requested, return at once), restart; report each step to
    the command (if it is still there) and through ``say``. Returns False if ``stack up``
    should stop: a stop was requested, or ZooKeeper did not come back."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    with conn:

        def report(step: Step) -> None:
            say(f"celery-zklock stack: {step.describe()}")
            with contextlib.suppress(OSError):  # the drill command may be gone: drill on
                conn.sendall((step.to_json() + "\n").encode())

        try:
            seconds = _read_request(conn)
        except (OSError, ValueError) as exc:
            report(Step("error", time.time(), message=str(exc)))
            return True
        hosts = zookeeper.hosts
        pids = [pid for pid in (node.pid for node in _nodes(zookeeper)) if pid is not None]
        killed, killed_at = time.monotonic(), time.time()
        for node in _nodes(zookeeper):
            node.send_signal(signal.SIGKILL)
        for node in _nodes(zookeeper):
            node.wait(10.0)
        report(Step("killed", killed_at, pids=pids, hosts=hosts))
        if wait(max(0.0, killed + seconds - time.monotonic())):
            report(Step("error", time.time(), message="stack up was asked to stop"))
            return False
        report(Step("restarting", time.time()))
        try:
            if isinstance(zookeeper, ZooKeeperEnsemble):
                zookeeper.restart_stopped(RESTART_TIMEOUT)
            else:
                zookeeper.restart(RESTART_TIMEOUT)
        except StackError as exc:
            report(Step("error", time.time(), message=f"ZooKeeper did not come back: {exc}"))
            return False
        pids = [pid for pid in (node.pid for node in _nodes(zookeeper)) if pid is not None]
        report(Step("serving", time.time(), pids=pids, hosts=hosts, down=time.monotonic() - killed))
    return True


class DeathWatch:
    """``stack up``'s watch over its ZooKeeper processes: :meth:`check` names each one that
    exited since the last check, once (outside a drill every exit is unexpected)."""

    def __init__(self, zookeeper: ZooKeeper) -> None:
        self.zookeeper = zookeeper
        self._reported: set[int] = set()
        self._pids = {node.myid: node.pid for node in _nodes(zookeeper)}

    def check(self) -> list[str]:
        """One line per ZooKeeper process that exited since the last check."""
        lines = []
        for node in _nodes(self.zookeeper):
            if node.is_running():  # polls: a dead child's pid stays set until reaped
                self._reported.discard(node.myid)
                self._pids[node.myid] = node.pid
                continue
            if node.myid in self._reported:
                continue
            self._reported.add(node.myid)
            member = f"node {node.myid} " if self.ensemble else ""
            lines.append(
                f"ZooKeeper {member}(pid {self._pids.get(node.myid)}, port {node.port}) exited "
                f"unexpectedly ({_ended(node.returncode)}); its log ends:\n"
                + _indent(node.log_tail(5))
            )
        return lines

    @property
    def ensemble(self) -> bool:
        return isinstance(self.zookeeper, ZooKeeperEnsemble)

    def all_gone(self) -> bool:
        return not any(node.is_running() for node in _nodes(self.zookeeper))


def _ended(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.rstrip().splitlines())
