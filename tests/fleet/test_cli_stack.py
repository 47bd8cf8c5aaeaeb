"""`celery-zklock stack up` as a real subprocess: it prints the environment, serves, and stops."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kazoo.client import KazooClient

from celery_zklock.testing import cli
from celery_zklock.testing import drill as drill_steps
from celery_zklock.testing.cli import build_parser, main
from celery_zklock.zk import four_letter
from celery_zklock.zk.client import new_client
from celery_zklock.zk.settings import ClientConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPORT_RE = re.compile(r"^export (ZKLOCK_HOSTS|ZKLOCK_BROKER_URL)=(\S+)$")


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (read from /proc/*/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


class StackUp:
    """``celery-zklock stack up`` running as a child, with its stdout read line by line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery_zklock.testing.cli", "stack", "up", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def exports(self, count: int, timeout: float = 60.0) -> dict[str, str]:
        """Wait for ``count`` export lines; fail with stderr if the command ends first."""
        deadline = time.monotonic() + timeout
        found: dict[str, str] = {}
        while len(found) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {count} export lines within {timeout} s") from None
            if line is None:
                self.proc.wait(5)
                assert self.proc.stderr is not None
                raise AssertionError(
                    f"stack up ended ({self.proc.returncode}): {self.proc.stderr.read()}"
                )
            match = EXPORT_RE.match(line)
            assert match, f"unexpected stdout line {line!r}"
            found[match.group(1)] = match.group(2)
        return found

    def stop(self, sig: int, timeout: float = 30.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def stack_up() -> Iterator[type[StackUp]]:
    started: list[StackUp] = []

    class Tracked(StackUp):
        def __init__(self, *args: str) -> None:
            super().__init__(*args)
            started.append(self)

    yield Tracked
    for stack in started:
        stack.close()


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(process_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.02)


def test_stack_up_prints_working_exports_and_stops_on_sigterm(
    stack_up: type[StackUp],
) -> None:
    stack = stack_up()
    exports = stack.exports(2)
    hosts, broker = exports["ZKLOCK_HOSTS"], exports["ZKLOCK_BROKER_URL"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", hosts)
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", broker)

    client = KazooClient(hosts=hosts)
    client.start(timeout=10)
    try:
        client.create("/cli-stack", b"up")
        assert client.get("/cli-stack")[0] == b"up"
    finally:
        client.stop()
        client.close()
    assert redis.Redis.from_url(broker).ping()

    children = children_of(stack.proc.pid)
    assert len(children) == 2  # one ZooKeeper, one Redis
    assert stack.stop(signal.SIGTERM) == 0
    wait_gone(children)


def test_stack_up_ensemble_without_redis_stops_on_sigint(stack_up: type[StackUp]) -> None:
    stack = stack_up("--zk-nodes", "3", "--no-redis")
    exports = stack.exports(1)
    assert set(exports) == {"ZKLOCK_HOSTS"}
    hosts = exports["ZKLOCK_HOSTS"].split(",")
    assert len(hosts) == 3

    client = KazooClient(hosts=",".join(hosts))
    client.start(timeout=10)
    try:
        client.create("/cli-ensemble", b"up")
    finally:
        client.stop()
        client.close()
    children = children_of(stack.proc.pid)
    assert len(children) == 3
    assert stack.stop(signal.SIGINT) == 0
    wait_gone(children)
    assert stack.lines.get(timeout=5) is None  # nothing else was printed to stdout


def test_stack_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["stack"], ["stack", "up", "--zk-nodes", "0"], ["nonsense"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "--zk-nodes" in capsys.readouterr().err


def test_the_library_cli_has_only_the_library_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The fleet's demo and loadtest are `python -m workers ...` (tests/fleet/test_demo.py).
    assert [command.name for command in cli.COMMANDS] == ["stack"]
    assert "stack" in build_parser().format_help()
    for argv in (["demo"], ["loadtest"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err


def drill(*args: str) -> subprocess.CompletedProcess[str]:
    """``celery-zklock stack outage ...`` as a subprocess, as an operator runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "celery_zklock.testing.cli", "stack", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("nodes", [1, 3])
def test_the_outage_drill_stops_zookeeper_and_brings_it_back_on_the_same_port_and_data(
    stack_up: type[StackUp], nodes: int
) -> None:
    stack = stack_up("--zk-nodes", str(nodes), "--no-redis")
    hosts = stack.exports(1)["ZKLOCK_HOSTS"]
    before = children_of(stack.proc.pid)
    client = new_client(ClientConfig(hosts=hosts))
    client.start(timeout=10)
    try:
        client.create("/drilled", b"kept")
        spelled = ("outage", "2") if nodes == 1 else ("drill", "--seconds", "2")
        done = drill(*spelled, "--stack", str(stack.proc.pid), "--json")
        assert done.returncode == 0, done.stderr
        steps = [drill_steps.Step.from_json(line) for line in done.stdout.splitlines()]
        assert [s.event for s in steps] == ["killed", "restarting", "serving"]
        killed, restarting, serving = steps
        assert sorted(killed.pids) == sorted(before) and not set(serving.pids) & set(before)
        assert killed.hosts == serving.hosts == hosts  # the same ports
        assert restarting.at - killed.at >= 2.0 and serving.down is not None
        assert 2.0 <= serving.down < 30
        # A fresh session reads it: the one from before may have expired meanwhile (the drill
        # took longer than its timeout in a fresh-clone CI run: SessionExpiredError).
        after = new_client(ClientConfig(hosts=hosts))
        after.start(timeout=10)
        try:
            assert after.get("/drilled")[0] == b"kept"  # the same data
        finally:
            after.stop()
            after.close()
        assert sorted(children_of(stack.proc.pid)) == sorted(serving.pids)
    finally:
        client.stop()
        client.close()
    assert stack.stop(signal.SIGTERM) == 0
    assert stack.proc.stderr is not None
    said = stack.proc.stderr.read()
    assert "exited unexpectedly" not in said and "serves again" in said


def test_stack_up_names_its_zookeeper_dying_and_stops(stack_up: type[StackUp]) -> None:
    stack = stack_up("--no-redis")
    stack.exports(1)
    (zookeeper,) = children_of(stack.proc.pid)
    os.kill(zookeeper, signal.SIGKILL)
    assert stack.proc.wait(30) == 1
    assert stack.proc.stderr is not None
    said = stack.proc.stderr.read()
    assert f"ZooKeeper (pid {zookeeper}, port" in said
    assert "exited unexpectedly (killed by SIGKILL)" in said


def test_the_drill_names_what_it_cannot_find() -> None:
    done = drill("outage", "1", "--stack", "999999999")
    assert done.returncode == 1
    assert "no `celery-zklock stack up` with pid 999999999 runs" in done.stderr
    assert drill("outage", "0").returncode == 2  # not an outage: a usage error


def test_zookeeper_comes_back_when_the_drill_command_goes_away(stack_up: type[StackUp]) -> None:
    stack = stack_up("--no-redis")
    port = int(stack.exports(1)["ZKLOCK_HOSTS"].rsplit(":", 1)[1])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "celery_zklock.testing.cli", "stack", "outage", "2"]
    command += ["--stack", str(stack.proc.pid)]
    interrupted = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert interrupted.stdout is not None
    assert "killed" in interrupted.stdout.readline()
    interrupted.kill()  # the operator's Ctrl-C, mid-outage
    interrupted.wait(10)
    interrupted.stdout.close()
    assert four_letter.ask("127.0.0.1", port, "srvr", timeout=1.0) is None  # still down
    deadline = time.monotonic() + 30
    # Serving again: a server that answers srvr but has not finished starting says it is "not
    # currently serving requests" (a fresh-clone CI run met it).
    while "Mode: standalone" not in (four_letter.ask("127.0.0.1", port, "srvr", timeout=1.0) or ""):
        assert time.monotonic() < deadline, "ZooKeeper did not come back"
        time.sleep(0.05)
    assert stack.proc.poll() is None  # stack up runs on
