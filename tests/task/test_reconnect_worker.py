"""Every process of a prefork worker (its main process, whose client the gate uses, and each pool
process that ran a locked task) is connected to ZooKeeper again, in the session it had, within
one reconnect of the server's return after an outage longer than kazoo's own reconnect waits
would stay short, and says so in the worker's log with the outage's true length. A real worker,
a real server SIGKILLed and started again on the same port and data.

One reconnect: at most one wait of the reconnect schedule, or, for an attempt that met the
restarting server's first moments (a connection taken and never answered, ZOOKEEPER-5051), a
third of the session timeout and then one wait (tests/recipes/test_silent_handshake.py). With
kazoo's wait for that answer (the whole session timeout), a pool process came back 4.5 s late,
in a new session: its old one had expired."""

from __future__ import annotations

import re
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from celery import Celery

from celery_zklock.testing.plugin import StackFactory
from celery_zklock.zk.client import HANDSHAKE_WAIT_SHARE, RECONNECT_JITTER, RECONNECT_MAX_DELAY
from tests.conftest import SESSION_TIMEOUT
from tests.lockutil import wait_for
from tests.workerproc import workers

OUTAGE = 16.0
BACK_WITHIN = (
    SESSION_TIMEOUT * HANDSHAKE_WAIT_SHARE + RECONNECT_MAX_DELAY * (1 + RECONNECT_JITTER) + 0.75
)
"""Seconds after the port listens again: an unanswered handshake, one reconnect wait, and
0.75 s for a machine busy with other tests (2.7 s with the tests' 4 s sessions)."""
ANSWERS_AGAIN = re.compile(
    r"^\[(?P<at>[\d-]+ [\d:]+,\d+): WARNING/(?P<process>[\w-]+)\] celery-zklock: ZooKeeper "
    r"answers again after (?P<length>[\d.]+)s out of reach",
    re.MULTILINE,
)


def _listening_at(port: int, stop: threading.Event, found: list[float]) -> None:
    """Note the first wall-clock instant ``port`` accepts a connection (the worker's log is in
    wall-clock time)."""
    while not stop.is_set():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            time.sleep(0.005)
            continue
        found.append(time.time())
        return


@pytest.mark.fault
def test_every_worker_process_is_back_in_its_session_and_logs_the_outage_length(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import exclusive_section

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts}
    with workers(app, "prefork", 1, env, tmp, prefix="back") as (worker,):
        # Both pool processes run a locked task at once: each makes its own client.
        calls = [exclusive_section.apply_async((f"k{i}", 1.0), queue=worker.queue) for i in (1, 2)]
        pids = {call.get(timeout=30)["pid"] for call in calls}
        assert len(pids) == 2
        killed_at = time.time()
        server.kill()
        time.sleep(OUTAGE)  # the outage itself, not a wait for an event
        stop, found = threading.Event(), list[float]()
        poller = threading.Thread(target=_listening_at, args=(server.node.port, stop, found))
        poller.start()
        try:
            server.restart()
        finally:
            stop.set()
            poller.join(5)
        assert found
        answered_at = found[0]

        def back() -> list[re.Match[str]]:
            return list(ANSWERS_AGAIN.finditer(worker.log_path.read_text()))

        wait_for(lambda: len(back()) >= 3, 15, "the main and both pool processes to reconnect")
        # ...and the pool still runs locked tasks.
        assert exclusive_section.apply_async(("k3", 0.0), queue=worker.queue).get(timeout=30)
    lines = back()
    by_process = {m["process"]: m for m in lines}
    assert "Session has expired" not in worker.log_path.read_text(), "a process lost its session"
    assert len(lines) == 3 and "MainProcess" in by_process, [m.group(0) for m in lines]
    true_length = answered_at - killed_at
    for process, match in by_process.items():
        at = datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        print(f"{process}: back {at - answered_at:.2f}s after ZooKeeper, logged "
              f"{match['length']}s of a {true_length:.1f}s outage")  # fmt: skip
        assert at - answered_at <= BACK_WITHIN, process
        # The length it logs is how long it was out of reach: until it was back (kill to log
        # line), which the assert above bounds; a length off by the reconnect lag is no lie.
        seen_out = at - killed_at
        assert abs(float(match["length"]) - seen_out) <= 0.5, (process, seen_out)
