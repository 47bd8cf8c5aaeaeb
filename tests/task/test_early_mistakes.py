"""Mistakes a new user makes in the first hour, caught when they are made and named: a malformed
host list, a worker started where ZooKeeper cannot be reached, and the log of an outage (one
line per outage, not one per reconnect attempt). Real `celery worker` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_zklock import ConfigurationError
from celery_zklock.zk.settings import forget_settings
from tests.lockutil import wait_for
from tests.workerproc import ROOT, start_worker

UNREACHABLE = "127.0.0.1:1"
"""A port nothing listens on: every connection is refused at once."""
CANNOT_REACH = f"cannot reach ZooKeeper at {UNREACHABLE}"
RECONNECT_WARNINGS = ("Connection dropped", "Connection time-out", "Transition to CONNECTING")


def test_a_malformed_host_list_is_a_configuration_error_naming_the_setting(
    taskenv: tuple[Celery, dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, env, _ = taskenv
    from tests.taskapp import long_hold

    monkeypatch.setenv("ZKLOCK_HOSTS", "127.0.0.1:abc")
    forget_settings(app)
    try:
        # A call fails at once, naming the setting: no retry, no wait for an "outage".
        with pytest.raises(ConfigurationError, match=r"zklock_hosts \(env ZKLOCK_HOSTS\)"):
            long_hold.apply(("k", 0.0)).get()
    finally:
        forget_settings(app)
    # A worker refuses to start.
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.taskapp", "worker", "--pool", "solo",
         "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "warning"],
        cwd=ROOT, env={**env, "ZKLOCK_HOSTS": "127.0.0.1:abc", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "celery-zklock: zklock_hosts (env ZKLOCK_HOSTS) '127.0.0.1:abc': the entry" in (
        done.stderr
    )
    assert "its port is not a number from 1 to 65535" in done.stderr


def attempts(log: str) -> int:
    return log.count("Connecting to 127.0.0.1(127.0.0.1):1")


@pytest.mark.parametrize("gate", ["gate", "no-gate"])
def test_a_worker_that_cannot_reach_zookeeper_says_so_once(
    gate: str, taskenv: tuple[Celery, dict[str, str], Path]
) -> None:
    """One line naming the hosts and what to check, and of kazoo's reconnect warnings one for
    the whole outage, however many times the main process tries (with the gate it keeps
    trying; without, one probe at start)."""
    app, env, tmp = taskenv
    env = {**env, "ZKLOCK_HOSTS": UNREACHABLE, "ZKLOCK_CONNECT_TIMEOUT": "1"}
    if gate == "no-gate":
        env["ZKLOCK_GATE"] = "false"
    worker = start_worker(app, "prefork", f"unreach-{gate}", env, tmp, queue="q0")
    try:
        log = worker.log_path
        wait_for(lambda: CANNOT_REACH in log.read_text(), 30, "the worker to say so")
        if gate == "gate":  # the gate tries again every 5 s: one more round of attempts
            seen = attempts(log.read_text())
            wait_for(lambda: attempts(log.read_text()) > seen + 2, 30, "more attempts")
        text = log.read_text()
    finally:
        worker.stop()
    print(text[-3000:])
    (line,) = [ln for ln in text.splitlines() if CANNOT_REACH in ln]
    assert "zklock_hosts (env ZKLOCK_HOSTS)" in line and "zklock doctor" in line
    assert attempts(text) >= 3
    messages = [ln.partition("] ")[2] for ln in text.splitlines()]
    reconnect = [m for m in messages if m.startswith(RECONNECT_WARNINGS)]
    assert len(reconnect) == 1, reconnect
    assert "reconnect warnings are left out" in reconnect[0]
