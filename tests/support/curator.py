"""Run Apache Curator's own lock recipes as subprocesses that contend with our Python locks.

``tests/java/CuratorContender.java`` is compiled once (``build_curator_contender``) against the
Curator 5.4 jars Debian ships (``libcurator-recipes-java``) and started with
``start_curator_contender``, which returns once the contender is connected. A contender started
with ``gate=True`` then waits until ``release_contenders`` lets it (and the others) go, so
several contenders start contending at the same moment. A contender started with ``hold_ms=-1``
holds each lock until ``release_hold`` (or ``wait_curator_contender``) tells it to let go, so
a test can inspect a lock that is certainly held without guessing a duration. Kind ``latch``
contends with Curator's ``LeaderLatch`` (participant id: the holder prefix): each iteration is
one term as leader, from ``await`` to ``close``, recorded in the witness as
``<prefix>-<i>@<czxid>`` (the czxid of the term's node, read from ZooKeeper while it leads).
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Literal

JAVA_DIR = Path("/usr/share/java")
SOURCE = Path(__file__).resolve().parent.parent / "java" / "CuratorContender.java"
INSTALL_HINT = "apt-get install -y default-jdk-headless libcurator-recipes-java"

# What CuratorContender needs, by Debian's unversioned jar names. The jars' manifests also pull
# in their own dependencies; naming them keeps the class path explicit. slf4j-nop silences
# Curator's and ZooKeeper's logging.
_JARS = (
    "curator-client",
    "curator-framework",
    "curator-recipes",
    "zookeeper",
    "zookeeper-jute",
    "guava",
    "netty-buffer",
    "netty-codec",
    "netty-common",
    "netty-handler",
    "netty-resolver",
    "netty-transport",
    "netty-transport-native-epoll",
    "netty-transport-native-unix-common",
    "slf4j-api",
    "slf4j-nop",
)

ContenderKind = Literal["mutex", "read", "write", "latch"]


class CuratorUnavailable(RuntimeError):
    """Java or the Curator jars are missing; the message names the packages to install."""


def curator_classpath(java_dir: Path = JAVA_DIR) -> str:
    """The class path of Debian's Curator, ZooKeeper client, Guava, Netty and slf4j jars.

    Raises ``CuratorUnavailable`` naming the missing jars and the apt command that installs them.
    """
    jars = [java_dir / f"{name}.jar" for name in _JARS]
    missing = [jar.name for jar in jars if not jar.is_file()]
    if missing:
        raise CuratorUnavailable(
            f"missing {', '.join(missing)} in {java_dir}: run `{INSTALL_HINT}`"
        )
    return os.pathsep.join(str(jar) for jar in jars)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise CuratorUnavailable(f"`{name}` not found: run `{INSTALL_HINT}`")
    return path


def build_curator_contender(tmp_dir: Path) -> Path:
    """Compile CuratorContender.java into ``tmp_dir/classes`` and return that directory.

    Raises ``CuratorUnavailable`` if javac or the jars are missing, ``RuntimeError`` with
    javac's output if compilation fails.
    """
    classpath = curator_classpath()
    javac = _tool("javac")
    classes = Path(tmp_dir) / "classes"
    classes.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [javac, "-nowarn", "-d", str(classes), "-cp", classpath, str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"javac failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return classes


def start_curator_contender(
    classes: Path,
    hosts: str,
    lock_path: str,
    kind: ContenderKind,
    iterations: int,
    hold_ms: int,
    witness: str | os.PathLike[str],
    holder_prefix: str,
    *,
    gate: bool = False,
    ready_timeout: float = 30.0,
) -> subprocess.Popen[bytes]:
    """Start a contender and return once it printed ``ready`` (connected to ZooKeeper).

    Without ``gate`` it starts contending at once; with ``gate`` it waits for
    ``release_contenders``. Each section lasts ``hold_ms`` milliseconds, or until
    ``release_hold`` if ``hold_ms`` is negative. Its stderr is kept in a pipe for
    ``wait_curator_contender``.
    Raises ``RuntimeError`` (with the contender's stderr) if it exits or stays silent for
    ``ready_timeout`` seconds; the process is killed in that case.
    """
    cmd = [
        _tool("java"),
        "-Xms16m",
        "-Xmx96m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-cp",
        os.pathsep.join((str(classes), curator_classpath())),
        "CuratorContender",
        hosts,
        lock_path,
        kind,
        str(iterations),
        str(hold_ms),
        os.fspath(witness),
        holder_prefix,
    ]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if gate or hold_ms < 0 else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _await_ready(proc, ready_timeout)
    except BaseException as exc:
        proc.kill()
        _, err = proc.communicate()
        if not isinstance(exc, Exception):
            raise
        raise RuntimeError(
            f"Curator contender {holder_prefix} not ready ({exc}; exit {proc.returncode}): "
            f"{err.decode(errors='replace')}"
        ) from exc
    if hold_ms < 0 and not gate:
        _send_line(proc, b"go")
    return proc


def _await_ready(proc: subprocess.Popen[bytes], timeout: float) -> None:
    assert proc.stdout is not None
    # Raw reads on the descriptor: nothing is left in the Popen's buffered reader.
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no `ready` line")
            if not sel.select(left):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError("contender exited")
            seen += chunk
    if seen.split(b"\n", 1)[0].strip() != b"ready":
        raise RuntimeError(f"unexpected first line {seen!r}")


def _send_line(proc: subprocess.Popen[bytes], line: bytes) -> None:
    stdin: IO[bytes] | None = proc.stdin
    if stdin is None:
        raise ValueError("contender was started with neither gate=True nor hold_ms < 0")
    # Not closed here: communicate() in wait_curator_contender closes it (end of file releases
    # any hold still waiting).
    stdin.write(line + b"\n")
    stdin.flush()


def release_contenders(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Let gated contenders start contending, as close together as possible."""
    for proc in procs:
        _send_line(proc, b"go")


def release_hold(proc: subprocess.Popen[bytes]) -> None:
    """End the current section of a contender started with ``hold_ms < 0``."""
    _send_line(proc, b"release")


def wait_curator_contender(proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Wait for a contender to finish; raise ``RuntimeError`` with its stderr unless it exited 0.

    A contender still running after ``timeout`` seconds is killed and reported.
    """
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(
            f"Curator contender still running after {timeout} s: {err.decode(errors='replace')}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"Curator contender exited {proc.returncode}: {err.decode(errors='replace')}"
        )


def stop_curator_contender(proc: subprocess.Popen[bytes]) -> None:
    """Kill a contender if it still runs and reap it (for fixture teardown)."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
