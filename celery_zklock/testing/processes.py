"""Child processes of the local stack and the fleet: the managed-process base, free ports,
port ownership, cleanup.

:class:`ChildProcess`, the base of every process we manage, starts its program in its own
session with ``PR_SET_PDEATHSIG=SIGKILL``: the kernel kills it when its parent dies, even of
SIGKILL. That signal comes when the *thread* that forked the child exits, so start children from
a thread that lives as long as they should (the main thread). Live children are registered: an
``atexit`` hook, and a SIGTERM handler when nobody else handles SIGTERM, stop them and remove
their temporary directories. :class:`Service` is the start/stop contract of every part of the
stack; a server counts as ready only once the socket listening on its port is its own
(:func:`listener_is_owned_by`, from ``/proc``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn, TypeVar

__all__ = [
    "ChildProcess",
    "MissingDependency",
    "PortTaken",
    "Service",
    "StackError",
    "descendants",
    "free_port",
    "listener_is_owned_by",
    "live_children",
    "make_temp_dir",
    "pid_alive",
    "port_has_listener",
    "process_state",
    "remove_temp_dir",
    "start_with_retries",
    "stop_all_children",
    "tail",
    "wait_until",
]

_A = TypeVar("_A")
_PR_SET_PDEATHSIG = 1
_TCP_LISTEN = "0A"


class StackError(RuntimeError):
    """A process of the local stack could not be started, or stopped, as asked.

    The message says which process, why, and includes the last lines of its log when there is one.
    """


class MissingDependency(StackError):
    """A program the local stack needs (java, the ZooKeeper jars, redis-server) is not installed.

    The message names the Debian package that provides it.
    """


# --------------------------------------------------------------------------------------- ports

_issued_ports: deque[int] = deque(maxlen=4096)
_ports_lock = threading.Lock()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The kernel picks the port; the same port is not handed out twice by this process in a row
    (the last 4096 are remembered). Another program can still take it before our child binds it,
    which is why servers check that the listening socket is their child's and retry otherwise.
    """
    with _ports_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _issued_ports:
                _issued_ports.append(port)
                return port
    raise StackError("free_port: the kernel kept returning ports already handed out; retry later")


# ------------------------------------------------------------------------------ port ownership

_LOOPBACK_V4 = ipaddress.IPv4Address("127.0.0.1")
_ANY_V4 = ipaddress.IPv4Address("0.0.0.0")


def _decode_proc_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """Decode the address column of /proc/net/tcp{,6}: 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _accepts_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True if a listener bound to ``address`` would accept a connection to 127.0.0.1."""
    if isinstance(address, ipaddress.IPv6Address):
        if address == ipaddress.IPv6Address("::"):
            return True  # dual-stack wildcard (unless IPV6_V6ONLY, which we cannot see here)
        mapped = address.ipv4_mapped
        if mapped is None:
            return False
        address = mapped
    return address in (_LOOPBACK_V4, _ANY_V4)


def _loopback_listener_inodes(port: int) -> set[int]:
    """Inodes of the LISTEN sockets that accept connections to 127.0.0.1:``port``."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                lines = fh.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            hex_address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            if _accepts_loopback(_decode_proc_address(hex_address)):
                inodes.add(int(fields[9]))
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` has open (empty if it is gone)."""
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError):
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def port_has_listener(port: int) -> bool:
    """True if some process listens for connections to 127.0.0.1:``port`` (per /proc/net/tcp*)."""
    return bool(_loopback_listener_inodes(port))


def listener_is_owned_by(pid: int, port: int) -> bool:
    """True if ``pid`` owns every listening socket that accepts connections to 127.0.0.1:``port``.

    False when nobody listens there, when someone else does (alone or next to ``pid``, as with
    SO_REUSEPORT), or when ``pid`` is gone. Reads /proc, so it needs Linux and permission to read
    ``/proc/<pid>/fd`` (our own children always qualify).
    """
    listeners = _loopback_listener_inodes(port)
    return bool(listeners) and listeners <= _socket_inodes(pid)


# ------------------------------------------------------------------------------ process tree


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in /proc (``R``, ``S``, ``T`` stopped, ``Z``...), or
    None when there is no such process."""
    return _state_in(f"/proc/{pid}")


def _state_in(proc_dir: str) -> str | None:
    """The state letter in ``proc_dir``'s ``stat`` (a process's or a thread's), or None."""
    try:
        with open(f"{proc_dir}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pause_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it is stopped.

    ``kill`` returns before the stop is complete: the kernel wakes one thread to take the
    signal, and that thread stops the others; until it is scheduled (milliseconds on a busy
    machine) the rest run on, so a server paused this way may still answer a request sent
    right after ``kill``. Raises ``StackError`` if a thread is still running after
    ``timeout`` seconds. SIGCONT resumes it."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        return set(thread_states(pid)) <= {"T", "t", None}  # None: a thread that ended

    if not wait_until(stopped, timeout, interval=0.001):
        raise StackError(f"process {pid} still runs a thread {timeout:g} s after SIGSTOP")


def thread_states(pid: int) -> list[str | None]:
    """The state letter of each thread of process ``pid`` (see :func:`process_state`); empty
    when there is no such process."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    return [_state_in(f"/proc/{pid}/task/{tid}") for tid in threads]


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if state not in ("Z", "X"):
                children.setdefault(int(parent), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_alive(pgid: int) -> bool:
    """Whether a live process (not a zombie) of process group ``pgid`` is left, from /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                return True
    return False


# ----------------------------------------------------------------------------------- waiting


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    interval: float = 0.02,
) -> bool:
    """Call ``predicate`` until it returns True or ``timeout`` seconds pass; return its last value.

    The predicate is called at least once, also with a zero timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval, remaining))


def tail(path: Path | str, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file, or ``""`` if it does not exist."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------- child processes


def _resolve_prctl() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl: Callable[..., int] = libc.prctl
    return prctl


def _die_with_parent(prctl: Callable[..., int], parent_pid: int) -> Callable[[], None]:
    """A preexec_fn: ask for SIGKILL when the forking thread dies; die if it already has."""

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class ChildProcess:
    """One program run as our child, at most one process at a time, output appended to
    ``log_path``: the base of every process the stack and the fleet manage.

    :meth:`spawn` starts it (again, once the last process is gone; see the module docstring
    for what keeps it from outliving us), :meth:`wait_ready` waits until it serves, :meth:`stop`
    ends it and returns once it is gone. ``directory``, if given, is a private directory made
    with :func:`make_temp_dir` that :meth:`destroy` removes (keeping the log's last lines).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        directory: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self.directory = directory
        self.last_log_tail = ""
        """The log's last lines as :meth:`destroy` found them."""
        self._destroyed = False
        self._popen: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid={self.pid}>"

    def spawn(self) -> None:
        """Spawn the program; raises StackError if it cannot be executed or is already running."""
        if self.is_running():
            raise StackError(f"{self.name} is already running (pid {self.pid}); stop it first")
        _install_cleanup_hooks()
        preexec = _die_with_parent(_resolve_prctl(), os.getpid())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.cwd,
                    env=self.env,
                    close_fds=True,
                    start_new_session=True,
                    # Not thread-safe in general; the function only calls prctl/getppid/kill.
                    preexec_fn=preexec,
                )
            except OSError as exc:
                raise StackError(f"{self.name}: cannot run {self.argv[0]!r}: {exc}") from exc
        _register(self)

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs (not yet reaped), else None."""
        if self._popen is None or self._popen.returncode is not None:
            return None
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the child is gone (negative: killed by that signal), else None."""
        if self._popen is None:
            return None
        return self._popen.poll()

    def is_running(self) -> bool:
        """True while the child has not exited."""
        return self._popen is not None and self._popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child if it is still running."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the child to exit; True if it is gone."""
        if self._popen is None:
            return True
        try:
            self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        _unregister(self)
        return True

    def stop(self, grace: float = 3.0) -> None:
        """End the child: SIGTERM, then SIGKILL after ``grace`` seconds; returns once it is gone.

        Idempotent. Raises StackError only if the process survives SIGKILL for 10 s (a process
        stuck in the kernel, in state D).
        """
        if self._popen is None:
            return
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)
            self._popen.send_signal(signal.SIGCONT)  # a stopped child handles SIGTERM only then
            if not self.wait(grace):
                self.kill()
        self._popen.wait()
        _unregister(self)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the child and wait until it is gone; raises StackError if it survives."""
        if self._popen is None:
            return
        if self._popen.poll() is None:
            self._popen.kill()
        if not self.wait(timeout):
            raise StackError(
                f"{self.name} (pid {self._popen.pid}) is still alive {timeout:.0f} s after SIGKILL"
            )

    def destroy(self, grace: float = 3.0) -> None:
        """:meth:`stop`, then remove :attr:`directory`, keeping the log's last lines. Idempotent."""
        self.stop(grace)
        if self.directory is not None and not self._destroyed:
            self.last_log_tail = self.log_tail()
            self._destroyed = True
            remove_temp_dir(self.directory)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log (once :meth:`destroy` removed it, as it found them)."""
        return self.last_log_tail if self._destroyed else tail(self.log_path, lines)

    def wait_ready(
        self,
        deadline: float,
        answer: Callable[[], _A | None],
        *,
        ports: Sequence[int],
        bind_failure: re.Pattern[str],
        listeners: Callable[[_A], Sequence[int]] | None = None,
        accept: Callable[[_A], bool] | None = None,
    ) -> _A:
        """Poll until the child serves; return its answer.

        It serves once ``answer()`` (a probe of its port) returns something ``accept`` takes,
        and every port of ``listeners(answer)`` (default: the first of ``ports``) is listened
        on by the child itself: an answer from another program on our port is never ours.
        Raises :class:`PortTaken` (try again with other ports) when one of ``ports`` turns out
        to be someone else's, or the child exited with ``bind_failure`` in its log; StackError
        with the log's end when it exits otherwise or ``deadline`` (monotonic) passes.
        """
        got: _A | None = None
        while True:
            if not self.is_running():
                self._exited(ports, bind_failure)
            pid = self.pid
            got = answer()
            if got is not None:
                own = listeners(got) if listeners is not None else ports[:1]
                if pid is None or not all(listener_is_owned_by(pid, port) for port in own):
                    if self.is_running():
                        raise PortTaken(
                            f"{self.name}: port {own[0]} answers but its listening socket "
                            "belongs to another process"
                        )
                    self._exited(ports, bind_failure)
                if accept is None or accept(got):
                    return got
            if time.monotonic() >= deadline:
                raise StackError(
                    f"{self.name} (pid {pid}) was not serving before the deadline (last "
                    f"answer: {got!r}).\n--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _exited(self, ports: Sequence[int], bind_failure: re.Pattern[str]) -> NoReturn:
        log = self.log_tail()
        message = (
            f"{self.name} exited with status {self.returncode} while starting."
            f"\n--- last lines of {self.log_path} ---\n{log}"
        )
        if bind_failure.search(log) or any(port_has_listener(port) for port in ports):
            raise PortTaken(message)
        raise StackError(message)

    def _emergency_kill(self) -> None:
        """SIGKILL and reap without Popen's locks (safe inside a signal handler)."""
        popen = self._popen
        if popen is not None and popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(popen.pid, 0)


class PortTaken(StackError):
    """A start failed because one of its ports was taken: it may be retried with other ports."""


def start_with_retries(
    what: str, attempts: int, timeout: float, attempt: Callable[[float], _A]
) -> _A:
    """Return ``attempt(deadline)``, tried up to ``attempts`` times (each with new ports) while
    it raises :class:`PortTaken`; StackError naming every failure after that."""
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    for _ in range(attempts):
        try:
            return attempt(deadline)
        except PortTaken as exc:
            failures.append(str(exc))
            if time.monotonic() >= deadline:
                break
    raise StackError(
        f"{what} could not start: its ports were taken by other processes in "
        f"{len(failures)} attempt(s), each with new free ports.\n" + "\n".join(failures)
    )


_S = TypeVar("_S", bound="Service")


class Service:
    """The contract of every part of the local stack (a server, an ensemble, a proxy).

    :meth:`start` returns the part once it serves, and raises StackError if it is started
    already; :meth:`stop` returns once everything it started is gone, and is idempotent.
    ``with`` starts it unless it is started, and stops it on the way out. A part that runs as
    one child process keeps it in ``_child`` (for :attr:`pid` and :meth:`is_running`).
    """

    what = "the service"
    """What it is, in messages."""
    _child: ChildProcess | None = None

    def start(self: _S) -> _S:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def is_started(self) -> bool:
        """True from a successful :meth:`start` until :meth:`stop`."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """Its process id while it runs (a part made of one process), else None."""
        return self._child.pid if self._child is not None else None

    def is_running(self) -> bool:
        """True while its process runs."""
        return self._child is not None and self._child.is_running()

    def _not_started(self) -> StackError:
        return StackError(f"{self.what} is not started: call start() first")

    def _refuse_restart(self) -> None:
        if self.is_started():
            raise StackError(f"{self!r} is already started; call stop() first")

    def __enter__(self: _S) -> _S:
        return self if self.is_started() else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------------- registry

_registry: dict[int, ChildProcess] = {}
_temp_dirs: set[Path] = set()
_registry_lock = threading.Lock()
_atexit_installed = False
_sigterm_installed = False


def _register(child: ChildProcess) -> None:
    with _registry_lock:
        _registry[id(child)] = child


def _unregister(child: ChildProcess) -> None:
    with _registry_lock:
        _registry.pop(id(child), None)


def live_children() -> list[ChildProcess]:
    """The children started by this process that have not been stopped or reaped yet."""
    with _registry_lock:
        return [child for child in _registry.values() if child.is_running()]


def make_temp_dir(prefix: str) -> Path:
    """Create a private temporary directory that the atexit/SIGTERM cleanup removes if its owner
    does not (see :func:`remove_temp_dir`)."""
    _install_cleanup_hooks()
    path = Path(tempfile.mkdtemp(prefix=prefix))
    with _registry_lock:
        _temp_dirs.add(path)
    return path


def remove_temp_dir(path: Path) -> None:
    """Remove a directory made by :func:`make_temp_dir` (idempotent)."""
    with _registry_lock:
        _temp_dirs.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def stop_all_children() -> None:
    """Stop every registered child (SIGTERM, then SIGKILL) and remove the registered temp dirs."""
    with _registry_lock:
        children = list(_registry.values())
    for child in children:
        with contextlib.suppress(Exception):
            child.stop(grace=2.0)
    with _registry_lock:
        directories = list(_temp_dirs)
    for directory in directories:
        remove_temp_dir(directory)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    with _registry_lock:
        children = list(_registry.values())
        _registry.clear()
        directories = list(_temp_dirs)
        _temp_dirs.clear()
    for child in children:
        child._emergency_kill()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    # Die of SIGTERM as we would have without this handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_cleanup_hooks() -> None:
    """Register the atexit hook and, if nobody handles SIGTERM, the SIGTERM handler.

    A SIGTERM handler someone else installed (Celery, our CLI, a test runner) is left alone:
    that program decides how to end, and the atexit hook and PDEATHSIG still apply. Handlers can
    only be installed from the main thread; from another thread we try again next time.
    """
    global _atexit_installed, _sigterm_installed
    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(stop_all_children)
    if not _sigterm_installed and threading.current_thread() is threading.main_thread():
        _sigterm_installed = True
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


class OneProcessService(Service):
    """A :class:`Service` that is one child process serving on one port (Redis, a RabbitMQ
    node): :meth:`_start` sets ``_child`` and ``_port``; :meth:`stop` destroys the child and
    keeps the tail of its log in ``last_log_tail``.

    A subclass says how to find its executable, make its child on a port and directory
    (``_child_for``) and tell that it serves (``_wait_ready``); its ``start`` and ``restart``
    call :meth:`_start` and :meth:`_restart` with its own default timeouts.
    """

    _port: int | None = None
    last_log_tail: str = ""
    _start_attempts: int = 1
    _server: str = "the server"
    """Its name in start and restart errors (``"Redis"``)."""

    def _find_executable(self) -> str:
        raise NotImplementedError

    def _pick_port(self) -> int:
        return free_port()

    def _child_for(self, executable: str, port: int, directory: Path) -> ChildProcess:
        raise NotImplementedError

    def _wait_ready(self, child: ChildProcess, port: int, deadline: float) -> None:
        raise NotImplementedError

    def _start(self, timeout: float) -> None:
        """Start the child on a port of :meth:`_pick_port` and a new directory, and wait until
        it serves; up to ``_start_attempts`` tries while its port turns out taken."""
        self._refuse_restart()
        executable = self._find_executable()
        prefix = f"zklock-{self._server.lower()}-"

        def attempt(deadline: float) -> tuple[ChildProcess, int]:
            port = self._pick_port()
            child = self._child_for(executable, port, make_temp_dir(prefix))
            try:
                child.spawn()
                self._wait_ready(child, port, deadline)
            except BaseException:
                self._discard(child)
                raise
            return child, port

        self._child, self._port = start_with_retries(
            self._server, self._start_attempts, timeout, attempt
        )

    def _restart(self, timeout: float, sig: int) -> float:
        """Stop the child with ``sig``, start it again on the same port and directory, and wait
        until it serves; return the seconds it was down (StackError, and stopped, when it
        does not come back)."""
        child, port = self._child, self._port
        if child is None or port is None or not child.is_running():
            raise StackError(f"{self!r} is not running: nothing to restart")
        down_since = time.monotonic()
        child.send_signal(sig)
        if not child.wait(timeout):
            child.kill()
        try:
            child.spawn()
            self._wait_ready(child, port, time.monotonic() + timeout)
        except BaseException as exc:
            self.stop()
            raise StackError(f"{self._server} could not restart on port {port}: {exc}") from exc
        return time.monotonic() - down_since

    def is_started(self) -> bool:
        return self._child is not None

    def _discard(self, child: ChildProcess) -> None:
        child.destroy()
        self.last_log_tail = child.last_log_tail

    def stop(self) -> None:
        """Stop the process and remove its directory; returns once it is gone. Idempotent."""
        child, self._child, self._port = self._child, None, None
        if child is not None:
            self._discard(child)

    @property
    def port(self) -> int:
        """The port (raises StackError before start)."""
        if self._port is None:
            raise self._not_started()
        return self._port
