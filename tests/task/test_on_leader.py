"""``on_leader`` on real ``celery worker`` processes (tests.leaderapp, prefork, concurrency 1):
the function runs in exactly one worker's main process; SIGKILL of that worker starts it in
the other (the takeover time is printed against the acceptance figure, a session timeout plus
2 s); a warm shutdown of the leading worker sets ``stop``, and the function has returned before
the next worker starts it.

The function logs to one file appended by every worker (O_APPEND: one total order):
``start <pid>``, ``stopped <pid>`` once it saw ``stop``, ``return <pid>`` after a cleanup of
LEADERAPP_CLEANUP seconds.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock.testing.celery_worker import celery_command, stop_all, wait_until_answering
from celery_zklock.testing.processes import pause_process
from celery_zklock.worker.leader import LEADERS, Candidate
from tests.conftest import SESSION_TIMEOUT
from tests.lockutil import children, wait_for, watches_by_path
from tests.support.leaders import LeaderLog, Line, line_of
from tests.workerproc import ROOT, STOP_GRACE, Worker

ELECTION = "/taskapp/leaders/sweeper"
CLEANUP = 1.0
"""Seconds the function takes to return once ``stop`` is set: a worker that let go of the
leadership before its function returned would let the next one start within them."""
WAIT_S = 60.0


class Fleet:
    """``celery worker -A tests.leaderapp`` processes, each consuming a queue of its own."""

    def __init__(self, app: Celery, env: dict[str, str], tmp: Path) -> None:
        self.app, self.env, self.tmp = app, env, tmp
        self.workers: list[Worker] = []

    def start(self, name: str) -> Worker:
        command = celery_command("tests.leaderapp", "prefork", 1)
        worker = Worker(
            command,
            nodename=f"{name}@%h",
            queues=[f"leader-{name}"],
            log_path=self.tmp / f"worker-{name}.log",
            cwd=ROOT,
            env=self.env,
        )
        worker.spawn()
        self.workers.append(worker)
        wait_until_answering(self.app, [worker], timeout=WAIT_S)
        return worker

    def by_pid(self, pid: int) -> Worker:
        return next(worker for worker in self.workers if worker.pid == pid)


@pytest.fixture
def fleet(taskenv: tuple[Celery, dict[str, str], Path]) -> Iterator[Fleet]:
    app, env, tmp = taskenv
    running = Fleet(app, {**env, "LEADERAPP_CLEANUP": str(CLEANUP)}, tmp)
    yield running
    stop_all([w for w in running.workers if w.is_running()], STOP_GRACE)


def await_standby(zk: KazooClient, hosts: str, count: int) -> str:
    """Wait until ``count`` workers take part (nodes under the election) and the ones behind the
    first watch a node ahead of them (they decided they wait); return the first node's path."""

    def ready() -> bool:
        nodes = children(zk, ELECTION)
        if len(nodes) != count:
            return False
        ordered = sorted(nodes, key=lambda name: int(name[-10:]))
        watched = watches_by_path(hosts)
        return all(f"{ELECTION}/{node}" in watched for node in ordered[:-1])

    wait_for(ready, WAIT_S, f"{count} workers in the election, the others waiting")
    return f"{ELECTION}/{min(children(zk, ELECTION), key=lambda name: int(name[-10:]))}"


def starts(log: LeaderLog) -> list[Line]:
    return [line for line in log.lines() if line.kind == "start"]


def test_on_leader_runs_in_one_worker_and_moves_on_kill_and_on_warm_shutdown(
    fleet: Fleet, zk_client: KazooClient, zk_hosts: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log = LeaderLog(fleet.tmp / "leader.log")
    fleet.start("w0")
    fleet.start("w1")
    first_node = await_standby(zk_client, zk_hosts, 2)
    first = log.wait(line_of("start"), "the function to start")
    leader = fleet.by_pid(int(first.who))  # a worker's main process, not a pool process
    assert first.unit == 0, "the function must run on a thread of its own, not the main one"
    identity = json.loads(zk_client.get(first_node)[0])
    assert identity == {"leader": "sweeper", "worker": leader.nodename, "pid": leader.pid}
    assert starts(log) == [first]  # both contend, one runs it

    # SIGKILL of the leading worker: the other starts the function.
    other = next(worker for worker in fleet.workers if worker is not leader)
    killed_at = time.monotonic()
    leader.kill()
    second = log.wait(line_of("start", str(other.pid)), "the function to start again", first.index)
    takeover = second.at - killed_at

    # A warm shutdown of the leading worker: stop set, the function returned, then the next.
    newcomer = fleet.start("w2")
    await_standby(zk_client, zk_hosts, 2)
    other.request_stop()  # SIGTERM to the main process: a warm shutdown
    third = log.wait(line_of("start", str(newcomer.pid)), "the newcomer to start it", second.index)
    kinds = [(line.kind, line.who) for line in log.lines()[second.index : third.index + 1]]
    me = str(other.pid)
    assert kinds == [("start", me), ("stopped", me), ("return", me), ("start", str(newcomer.pid))]
    other.stop(STOP_GRACE)
    assert other.returncode == 0
    tokens = [line.token or 0 for line in starts(log)]
    assert len(tokens) == 3 and tokens == sorted(set(tokens)), tokens  # fencing tokens rise

    summary = (
        f"on_leader takeover after SIGKILL of the leading worker: {takeover:.2f} s (session "
        f"timeout {SESSION_TIMEOUT:g} s; acceptance: within {SESSION_TIMEOUT + 2:g} s)"
    )
    with capsys.disabled():
        print(f"\n{summary}")


def test_a_leader_paused_past_its_session_sees_stop_set_the_moment_it_runs_again(
    fleet: Fleet, zk_client: KazooClient, zk_hosts: str
) -> None:
    """docs/leader.md: "a worker paused past its session (a stall, SIGSTOP) sees ``stop`` set
    the moment it runs again". The leading worker's main process is SIGSTOPped until the other
    worker has started the function (its session expired meanwhile), then resumed: its
    function's first look at ``stop`` finds it set (no ``unstopped`` line: the renewer's later
    verdict would come too late), it logs ``stopped``, and the other goes on leading."""
    log = LeaderLog(fleet.tmp / "leader.log")
    fleet.start("w0")
    fleet.start("w1")
    await_standby(zk_client, zk_hosts, 2)
    first = log.wait(line_of("start"), "the function to start")
    leader = fleet.by_pid(int(first.who))
    other = next(worker for worker in fleet.workers if worker is not leader)
    pause_process(leader.pid)
    try:
        second = log.wait(line_of("start", str(other.pid)), "the other to lead", first.index)
    finally:
        os.kill(leader.pid, signal.SIGCONT)
    log.wait(line_of("stopped", first.who), "the resumed leader to see stop set", second.index)
    after = [(line.kind, line.who) for line in log.lines()[first.index :]]
    assert ("unstopped", first.who) not in after, after
    assert (second.token or 0) > (first.token or 0), (first, second)
    assert ("stopped", str(other.pid)) not in after, after  # the new leader leads on


def test_a_function_that_returns_while_leading_hands_the_leadership_over(
    zk_hosts: str, zk_client: KazooClient, lock_root: str
) -> None:
    """Two candidates of one election in this process (the worker wiring without a worker):
    the first to lead returns at once, so its worker gives up the leadership, and the other
    runs the function next."""
    app = Celery("handover", set_as_current=False)
    app.conf.update(zklock_hosts=zk_hosts, zklock_root=lock_root)
    election = f"{lock_root}/{LEADERS}/job"
    calls: list[str] = []

    def job(who: str, stop: threading.Event) -> None:
        calls.append(who)
        if len(calls) == 1:  # return while leading, once the other takes part too
            wait_for(lambda: len(children(zk_client, election)) == 2, WAIT_S, "both to contend")
            return
        stop.wait(WAIT_S)

    candidates = [Candidate(app, "job", functools.partial(job, who), who) for who in ("a", "b")]
    try:
        for candidate in candidates:
            candidate.start()
        wait_for(lambda: len(calls) >= 2, WAIT_S, "the function to run a second time")
        assert calls[0] != calls[1], calls
    finally:
        for candidate in candidates:
            candidate.ask_to_stop()
        for candidate in candidates:
            candidate.join()
    assert children(zk_client, election) == []
