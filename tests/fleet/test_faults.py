"""Each fault primitive of workers.faults does what it says, against real processes: a fleet of
real `celery worker` processes on a real ZooKeeper and two real Redis servers."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.utils import worker_direct
from kazoo.client import KazooClient, KazooState

from celery_zklock import is_skipped
from celery_zklock.locks.rate import ADMISSION_PREFIX, RATE_NODE
from celery_zklock.testing import RedisServer, ZooKeeperEnsemble, ZooKeeperServer
from celery_zklock.testing.processes import descendants, pid_alive, wait_until
from celery_zklock.testing.zookeeper import partition_unavailable_reason
from workers.app import create_app
from workers.chatter import start_chatter, stop_chatter
from workers.checker import RunReport, TaskOutcome, check_run
from workers.faults import (
    QUORUM_LOSS_MARGIN,
    UNAVAILABLE,
    FaultEnvironment,
    FaultInjector,
    OpenSections,
    expire_session,
    fault_order,
    gate_holdings,
    parse_faults,
    session_password,
)
from workers.fleet import Fleet, FleetWorker, WorkerSpec
from workers.netns import Namespace, blackhole_unavailable_reason, unavailable_reason
from workers.record import FAULT_KINDS, FaultRecord, SectionEvent, SectionRecorder
from workers.settings import Settings
from workers.tasks import TASK_FOR_MODE

SESSION_TIMEOUT = 3.0
VISIBILITY_TIMEOUT = 10.0
HOLD_MS = 6000
"""Long enough for a fault to land inside the section, shorter than the visibility timeout."""

NETNS_MISSING = unavailable_reason()
BLACKHOLE_MISSING = blackhole_unavailable_reason()
PARTITION_MISSING = partition_unavailable_reason()

# ------------------------------------------------------------------------------ plans (pure)


def test_fault_specs_parse_and_reject_what_they_cannot_mean() -> None:
    assert parse_faults("kill:3, pause:2,expire") == {"kill": 3, "pause": 2, "expire": 1}
    assert parse_faults("all:2") == {kind: 2 for kind in FAULT_KINDS}
    assert parse_faults("redis-restart:1,leader:0") == {"broker_restart": 1}
    assert parse_faults("") == {}
    for bad, message in (("nap:1", "unknown fault"), ("kill:x", "whole number")):
        with pytest.raises(ValueError, match=message):
            parse_faults(bad)


def test_faults_run_in_rounds_so_every_kind_spreads_over_the_run() -> None:
    order = fault_order({kind: 3 for kind in FAULT_KINDS}, seed=1)
    kinds = len(FAULT_KINDS)
    assert len(order) == 3 * kinds
    for start in (0, kinds, 2 * kinds):
        assert sorted(order[start : start + kinds]) == sorted(FAULT_KINDS)
    assert order == fault_order({kind: 3 for kind in FAULT_KINDS}, seed=1)
    assert fault_order({"kill": 2, "expire": 1}, seed=0).count("kill") == 2


# ----------------------------------------------------------------------- session expiry


def test_session_password_is_the_one_the_server_gave(zk_client: KazooClient) -> None:
    session_id, password = zk_client.client_id
    assert session_password(session_id) == password
    assert session_password(session_id + 1) != password


def test_expire_session_removes_the_sessions_nodes_on_the_server(
    zk_hosts: str, lock_root: str
) -> None:
    owner, observer = KazooClient(hosts=zk_hosts), KazooClient(hosts=zk_hosts)
    states: list[str] = []
    owner.add_listener(states.append)
    owner.start(timeout=15)
    observer.start(timeout=15)
    try:
        owner.ensure_path(lock_root)
        node = owner.create(f"{lock_root}/held", ephemeral=True)
        stat = observer.exists(node)
        assert stat is not None and stat.ephemeralOwner == owner.client_id[0]
        expire_session(zk_hosts, stat.ephemeralOwner)
        assert wait_until(lambda: observer.exists(node) is None, timeout=5)
        # The owner learns it on its next reconnect: the session is gone, not just its node.
        assert wait_until(lambda: "LOST" in states, timeout=10), states
    finally:
        for client in (owner, observer):
            client.stop()
            client.close()


# ------------------------------------------------------------------------------ the fleet


@dataclass
class Stack:
    zookeeper: ZooKeeperServer
    broker: RedisServer
    settings: Settings
    app: Celery
    fleet: Fleet
    records: Any
    namespace: Namespace | None

    def worker(self, label: str) -> FleetWorker:
        return next(w for w in self.fleet if w.label == label)

    def injector(self, run_id: str, **kwargs: Any) -> FaultInjector:
        env = FaultEnvironment(
            run_id=run_id,
            records=self.records,
            zk_hosts=self.settings.zk_hosts,
            session_timeout=self.settings.session_timeout,
            fleet=self.fleet,
            zookeeper=self.zookeeper,
            broker=self.broker,
        )
        return FaultInjector(env, {}, target_timeout=20.0, **kwargs)


def _started(
    cleanup: contextlib.ExitStack,
    zookeeper: ZooKeeperServer | ZooKeeperEnsemble,
    broker: RedisServer,
    records_server: RedisServer,
    main: str,
) -> tuple[Settings, Celery, redis.Redis]:
    """Start the servers (stopped by ``cleanup``); the fleet's settings, an app, a records
    client."""
    for server in (zookeeper, broker, records_server):
        cleanup.callback(server.stop)
        server.start()
    settings = Settings(
        zk_hosts=zookeeper.hosts,
        broker_url=broker.url,
        result_backend=records_server.url,
        record_url=records_server.url,
        session_timeout=SESSION_TIMEOUT,
        visibility_timeout=VISIBILITY_TIMEOUT,
    )
    app = create_app(settings, main=main)
    cleanup.callback(app.close)
    records = redis.Redis.from_url(records_server.url)
    cleanup.callback(records.close)
    return settings, app, records


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """ZooKeeper, a persistent broker Redis, a records Redis, and three workers: prefork,
    threads, and (as root) threads in a network namespace."""
    with contextlib.ExitStack() as cleanup:
        namespace = None
        if NETNS_MISSING is None:
            namespace = Namespace.create("tf")
            cleanup.callback(namespace.delete)
        bind = [namespace.redis_address] if namespace is not None else []
        zookeeper = ZooKeeperServer(
            client_address="0.0.0.0" if namespace is not None else "127.0.0.1"
        )
        broker = RedisServer(appendonly=True, appendfsync="always", bind=bind)
        settings, app, records = _started(
            cleanup, zookeeper, broker, RedisServer(bind=bind), "test-faults"
        )
        specs = [WorkerSpec("prefork", "prefork", 2), WorkerSpec("threads", "threads", 2)]
        if namespace is not None:
            specs.append(WorkerSpec("netns", "threads", 2, namespace))
        fleet = Fleet(app, settings, specs, uuid.uuid4().hex[:8], tmp_path_factory.mktemp("fleet"))
        cleanup.callback(fleet.stop)
        fleet.start()
        yield Stack(zookeeper, broker, settings, app, fleet, records, namespace)


def _send(stack: Stack, worker: FleetWorker, run_id: str, hold_ms: int = HOLD_MS) -> Any:
    """An exclusive section of ``hold_ms`` on a key of its own, run by ``worker``."""
    return stack.app.tasks[TASK_FOR_MODE["exclusive"]].apply_async(
        (run_id, f"key-{run_id}", hold_ms), queue=worker_direct(worker.nodename)
    )


def _entered(stack: Stack, run_id: str, task_id: str) -> SectionEvent:
    sections = OpenSections(stack.records, run_id)
    found: list[SectionEvent] = []

    def entered() -> bool:
        found[:] = [e for e in sections.refresh() if e.task_id == task_id]
        return bool(found)

    assert wait_until(entered, timeout=30), f"task {task_id} never entered its section"
    return found[0]


def _events(stack: Stack, run_id: str) -> list[SectionEvent]:
    return SectionRecorder(stack.records, run_id).events()


def _inject(stack: Stack, run_id: str, kind: str) -> Any:
    injector = stack.injector(run_id)
    try:
        record = injector.inject(kind)
        injector.revive()
        return record
    finally:
        injector.close()


def _failure(result: Any, timeout: float = 30) -> str:
    result.get(timeout=timeout, propagate=False)
    assert result.state == "FAILURE", (result.state, result.result)
    return type(result.result).__name__


def _process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_kill_of_a_prefork_pool_process(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("prefork")
    main = worker.pid
    result = _send(stack, worker, run_id)
    enter = _entered(stack, run_id, result.id)
    assert enter.pid in descendants(main or 0)

    record = _inject(stack, run_id, "kill")

    assert record.ran, record.detail
    assert f"pid {enter.pid}" in record.target and "pool process" in record.target
    assert not pid_alive(enter.pid)
    kinds = [(e.kind, e.pid) for e in _events(stack, run_id)]
    assert kinds.index(("killed", enter.pid)) > kinds.index(("enter", enter.pid))
    # The worker lives on and its pool replaces the process.
    assert worker.pid == main and worker.is_running()
    assert wait_until(lambda: len(descendants(main or 0)) == 2, timeout=15)
    assert enter.pid not in descendants(main or 0)


def test_kill_of_a_threads_worker_restarts_it_and_its_task_runs_again(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("threads")
    before = worker.pid
    # Held long enough for the injector to find the section still open on a loaded machine (it
    # connects a client of its own to name the holder's session), short of the 10 s bound.
    result = _send(stack, worker, run_id, hold_ms=4000)
    enter = _entered(stack, run_id, result.id)
    assert enter.pid == before  # threads: the main process runs the bodies

    record = _inject(stack, run_id, "kill")

    assert record.ran and "main process" in record.target, record
    assert before is not None and not pid_alive(before)
    after = worker.pid
    assert worker.is_running() and after is not None and after != before
    # Its message comes back after the visibility timeout and runs in the new process.
    value = result.get(timeout=VISIBILITY_TIMEOUT + 30)
    assert value["pid"] == after and value["token"] != enter.token
    kinds = [(e.kind, e.pid) for e in _events(stack, run_id)]
    assert kinds.index(("enter", before)) < kinds.index(("killed", before))
    assert kinds.index(("killed", before)) < kinds.index(("enter", after))
    assert kinds[-1] == ("exit", after)


def test_kill_held_kills_a_whole_worker_while_its_gate_holds_messages_and_loses_none(
    stack: Stack,
) -> None:
    """A holder in the prefork worker and three waiters held at its gate; ``kill_held``
    SIGKILLs the worker, main process and pool: every call completes its body exactly once
    after the restarted worker gets the messages back, without an overlap."""
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("prefork")
    before = worker.process_ids()
    section = stack.app.tasks[TASK_FOR_MODE["exclusive"]]
    queue, key = worker_direct(worker.nodename), f"key-{run_id}"
    # Long enough to be still inside its section at the kill, however slow the gate's answer
    # and the injector's search are (a CI run under load took over 3 s from enter to kill).
    holder = section.apply_async((run_id, key, 10_000), queue=queue)
    enter = _entered(stack, run_id, holder.id)
    waiters = [
        section.apply_async((run_id, key, 100), queue=queue, zklock={"timeout": 90})
        for _ in range(3)
    ]
    assert wait_until(lambda: gate_holdings(stack.app).get(worker.nodename) == 3, timeout=30)

    record = _inject(stack, run_id, "kill_held")

    assert record.ran and worker.nodename in record.target, record
    assert "while its gate held messages (3 at its last answer)" in record.detail, record
    assert "the fleet restarted it" in record.detail
    assert not any(pid_alive(pid) for pid in before) and worker.is_running()
    calls = [holder, *waiters]
    for call in calls:
        call.get(timeout=VISIBILITY_TIMEOUT + 60)
    events = _events(stack, run_id)
    kinds = [(e.kind, e.pid) for e in events]
    assert kinds.index(("enter", enter.pid)) < kinds.index(("killed", enter.pid))
    done = Counter(e.task_id for e in events if e.kind == "exit" and e.outcome == "ok")
    assert done == {call.id: 1 for call in calls}, done
    report = check_run(
        submitted={call.id: 0.0 for call in calls},
        outcomes={call.id: TaskOutcome(call.id, "SUCCESS") for call in calls},
        events=events,
        faults=[record],
        leftover_nodes=0,
    )
    assert report.violations == 0 and report.killed_sections == 1, report.summary_lines()


def test_kill_held_plants_messages_for_the_gate_when_the_workload_holds_none(
    stack: Stack,
) -> None:
    # The module's stack is shared: wait until no earlier test's message is held at a gate,
    # so that the fault has to plant its own (it found one left by another test once).
    app = stack.fleet.app
    deadline = time.monotonic() + 60
    while any(gate_holdings(app).values()):
        assert time.monotonic() < deadline, "the gates still hold earlier tests' messages"
    injector = stack.injector(uuid.uuid4().hex[:10], held_wait=0.0)
    try:
        record = injector.inject("kill_held")
    finally:
        injector.close()
    assert record.ran, record.detail
    assert "planted behind a section" in record.detail
    worker = stack.fleet.by_nodename(record.target.split(" ")[0])
    assert worker is not None and worker.is_running(), record.target


def test_pause_past_the_session_timeout_ends_the_task_with_lock_lost(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("prefork")
    result = _send(stack, worker, run_id)
    enter = _entered(stack, run_id, result.id)

    record = _inject(stack, run_id, "pause")

    assert record.ran and "SIGCONT" in record.detail, record
    assert "expired its session" in record.detail
    assert pid_alive(enter.pid) and _process_state(enter.pid) != "T"  # resumed, not killed
    assert _failure(result) == "LockLost"
    events = _events(stack, run_id)
    assert [e.outcome for e in events if e.kind == "exit"] == ["lost"]
    # The pause is on record, after the enter and before the exit: the checker excuses it.
    kinds = [(e.kind, e.pid) for e in events]
    assert kinds.index(("enter", enter.pid)) < kinds.index(("paused", enter.pid))
    assert kinds.index(("paused", enter.pid)) < kinds.index(("exit", enter.pid))


def test_stall_before_write_has_the_fence_refuse_the_stopped_holders_write(
    stack: Stack,
) -> None:
    # The only fault whose holder writes after its successor: the fence must refuse it.
    run_id = uuid.uuid4().hex[:10]

    record = _inject(stack, run_id, "stall_before_write")

    assert record.ran, record.detail
    assert "expired its session" in record.detail and "refused by the fence" in record.detail
    events = _events(stack, run_id)
    (paused,) = [e for e in events if e.kind == "paused"]
    holder = next(e for e in events if e.kind == "enter" and e.pid == paused.pid)
    successor = next(e for e in events if e.kind == "enter" and e.holder != holder.holder)
    assert successor.key == holder.key and successor.token > holder.token
    assert pid_alive(holder.pid) and _process_state(holder.pid) != "T"  # resumed
    # In list order: the holder checked its lease and announced its write, stopped (paused,
    # stamped with that `writing` time), the successor entered and wrote, then the holder's
    # write came, was refused, and its section ended with its lock lost. The injector resumes
    # the holder once the successor wrote, so the successor's exit may come before or after
    # the holder's write (CI saw both): only its place after its own write is asserted.
    order = [(e.kind, e.holder) for e in events if e.kind != "paused"]
    successor_exit = ("exit", successor.holder)
    assert order.index(successor_exit) > order.index(("write", successor.holder)), order
    order.remove(successor_exit)
    assert order == [
        ("enter", holder.holder),
        ("writing", holder.holder),
        ("enter", successor.holder),
        ("writing", successor.holder),
        ("write", successor.holder),
        ("write", holder.holder),
        ("exit", holder.holder),
    ]
    kinds = [e.kind for e in events]
    assert kinds.index("writing") < kinds.index("paused") < kinds.index("enter", 2)
    writing = next(e for e in events if e.kind == "writing" and e.holder == holder.holder)
    assert paused.time == writing.time and paused.session_timeout == SESSION_TIMEOUT
    # With the holder's own lease validity, which the successor's grant must come after.
    assert writing.valid_until is not None and paused.valid_until == writing.valid_until
    assert writing.time < writing.valid_until <= successor.time
    writes = {e.holder: e for e in events if e.kind == "write"}
    assert writes[successor.holder].accepted
    refused = writes[holder.holder]
    assert refused.accepted is False and refused.previous_token == successor.token
    exits = {e.holder: e.outcome for e in events if e.kind == "exit"}
    assert exits == {successor.holder: "ok", holder.holder: "lost"}
    assert _failure(stack.app.AsyncResult(holder.task_id)) == "LockLost"
    # The checker: one refused write, no stale write accepted, the overlap excused (revoked).
    report = check_run(submitted={}, outcomes={}, events=events, faults=[record], leftover_nodes=0)
    assert (report.writes_refused, report.stale_writes_accepted) == (1, 0)
    assert (report.violations, report.revoked_overlaps) == (0, 1)
    assert report.ok, report.summary_lines()
    (impact,) = report.fault_impacts
    assert impact.refused_writes == 1


def test_stall_before_write_of_a_threads_worker_also_sends_the_write(stack: Stack) -> None:
    # The fault picks a prefork pool process when it can; in a threads worker the lease's
    # interruption is an asynchronous exception, which must not keep the write from going out.
    run_id = uuid.uuid4().hex[:10]
    injector = stack.injector(run_id)
    try:
        with injector._planted_holder(
            stack.worker("threads"), "stall_before_write", stallable=True
        ) as target:
            record = injector._stalled(target)
        injector.revive()
    finally:
        injector.close()
    assert record.ran and "main process" in record.target, record
    events = _events(stack, run_id)
    assert "refused by the fence" in record.detail, record.detail
    report = check_run(submitted={}, outcomes={}, events=events, faults=[record], leftover_nodes=0)
    seen = (report.summary_lines(), record.detail, events)  # what a failure in CI needs
    assert (report.writes_refused, report.stale_writes_accepted, report.violations) == (1, 0, 0), (
        seen
    )
    assert report.revoked_overlaps == 1 and report.ok, seen
    assert sorted(e.outcome or "" for e in events if e.kind == "exit") == ["lost", "ok"]


def test_expire_ends_the_holders_task_with_lock_lost(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("threads")
    result = _send(stack, worker, run_id)
    enter = _entered(stack, run_id, result.id)

    record = _inject(stack, run_id, "expire")

    assert record.ran and "lock node went after" in record.detail, record
    assert "still there" not in record.detail
    assert _failure(result) == "LockLost"
    assert pid_alive(enter.pid)
    events = _events(stack, run_id)
    assert [e.outcome for e in events if e.kind == "exit"] == ["lost"]
    assert [e.kind for e in events if e.pid == enter.pid][:2] == ["enter", "expired"]


def test_rate_limited_sections_record_their_admission_on_zookeepers_clock(stack: Stack) -> None:
    """Sections sent with ``zklock={"rate": "2/m"}`` on real workers record the rate and their
    admission node's ``ctime``, as ZooKeeper has it; the checker counts those: the two admitted
    pass, and a third admission in the same period (forged from the second) is flagged."""
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("prefork")
    key = f"key-{run_id}"
    section = stack.app.tasks[TASK_FOR_MODE["exclusive"]]
    values = [
        section.apply_async(
            (run_id, key, 10),
            queue=worker_direct(worker.nodename),
            zklock={"rate": "2/m", "on_busy": "skip"},
        ).get(timeout=30)
        for _ in range(3)  # one after the other: a skip is for the rate, not a busy lock
    ]
    assert [is_skipped(v) for v in values] == [False, False, True], values
    events = _events(stack, run_id)
    enters = [e for e in events if e.kind == "enter"]
    assert len(enters) == 2 and {e.rate for e in events} == {"2/m"}, events
    client = KazooClient(hosts=stack.settings.zk_hosts)
    client.start(timeout=15)
    try:
        rate_path = f"{section.lock_path(key=key)}/{RATE_NODE}"
        names = [n for n in client.get_children(rate_path) if n.startswith(ADMISSION_PREFIX)]
        ctimes = sorted(client.get(f"{rate_path}/{name}")[1].ctime for name in names)
    finally:
        client.stop()
        client.close()
    assert sorted(e.admitted for e in enters) == ctimes  # type: ignore[type-var]
    report = check_run(submitted={}, outcomes={}, events=events, faults=[], leftover_nodes=0)
    assert (report.rate_admissions, report.rate_violations, report.unchecked) == (2, 0, 0)
    second = max(enters, key=lambda e: e.admitted or 0)
    forged = replace(second, task_id="forged", token=second.token + 1_000_000)
    report = check_run(
        submitted={},
        outcomes={},
        events=[*events, forged, replace(forged, kind="exit", outcome="ok")],
        faults=[],
        leftover_nodes=0,
    )
    assert report.rate_violations == 1 and report.violations == 1, report.summary_lines()


@pytest.mark.skipif(NETNS_MISSING is not None, reason=f"no network namespaces: {NETNS_MISSING}")
def test_partition_cuts_the_worker_off_zookeeper_then_heals(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("netns")
    result = _send(stack, worker, run_id)
    _entered(stack, run_id, result.id)

    record = _inject(stack, run_id, "partition")

    assert record.ran and "then healed" in record.detail, record
    assert stack.namespace is not None and not stack.namespace.cut_now
    assert _failure(result) == "LockLost"
    # Healed: the same worker takes a lock again (a new session) and finishes a section.
    again = _send(stack, worker, run_id, hold_ms=50)
    assert again.get(timeout=30)["pid"] == worker.pid


def _check_history(stack: Stack, run_id: str, record: FaultRecord) -> RunReport:
    """The run's recorded sections (planted ones included) checked, with ``record``."""
    return check_run(
        submitted={}, outcomes={}, events=_events(stack, run_id), faults=[record], leftover_nodes=0
    )


@pytest.mark.skipif(BLACKHOLE_MISSING is not None, reason=f"no black hole: {BLACKHOLE_MISSING}")
def test_blackhole_silences_a_threads_worker_whose_tasks_keep_sending(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("netns")

    record = _inject(stack, run_id, "blackhole")

    assert record.ran, record.detail
    assert record.target.startswith(f"{worker.nodename} pid {worker.pid} (threads main process)")
    detail = record.detail
    assert "silent (every packet dropped both ways, sockets open)" in detail, detail
    assert f"a request every {SESSION_TIMEOUT / 4:.2f} s on the holder's client" in detail
    assert "the server expired the session after" in detail and detail.endswith("then healed")
    assert "entered" in detail and "no waiter" not in detail, detail
    assert stack.namespace is not None and not stack.namespace.blackholed_now
    # The planted holder (in the silenced worker) and the waiter (elsewhere) are on record; the
    # holder must have known its lock was gone before the waiter got it.
    events = _events(stack, run_id)
    holder = next(e for e in events if e.kind == "enter" and e.pid == worker.pid)
    assert holder.key.startswith("fault-blackhole-")
    assert [e.key for e in events if e.kind == "enter"] == [holder.key, holder.key]
    report = _check_history(stack, run_id, record)
    assert report.violations == 0, report.summary_lines()
    # Healed: the same worker takes a lock again (a new session) and finishes a section.
    again = _send(stack, worker, run_id, hold_ms=50)
    assert again.get(timeout=30)["pid"] == worker.pid


def test_chatter_runs_on_the_clients_of_in_process_pools_only(stack: Stack) -> None:
    threads, prefork = stack.worker("threads"), stack.worker("prefork")
    # The threads worker's client exists once it ran a locked task.
    run_id = uuid.uuid4().hex[:10]
    _send(stack, threads, run_id, hold_ms=10).get(timeout=30)
    reply = start_chatter(stack.app, threads.nodename, interval=0.1, duration=30)
    try:
        assert reply["ok"] == "started" and reply["pool"] == "threads"
        assert isinstance(reply["session"], int) and reply["session"] > 0
    finally:
        stop_chatter(stack.app, threads.nodename)
    with pytest.raises(RuntimeError, match="runs its tasks in other processes"):
        start_chatter(stack.app, prefork.nodename, interval=0.1, duration=30)


@pytest.mark.skipif(BLACKHOLE_MISSING is not None, reason=f"no black hole: {BLACKHOLE_MISSING}")
def test_a_blackholed_namespace_link_is_silent_both_ways_until_healed() -> None:
    namespace = Namespace.create("bh")
    try:
        with socket.create_server((namespace.zookeeper_address, 0)) as server:
            port = server.getsockname()[1]
            # Inside the namespace: connect, report, then (on each line from us) send a byte and
            # try to read one; last, try a new connection.
            probe = f"""
import socket, sys
s = socket.create_connection(({namespace.zookeeper_address!r}, {port}), timeout=5)
print("connected", flush=True)
for line in sys.stdin:
    if line.strip() == "new":
        try:
            socket.create_connection(({namespace.zookeeper_address!r}, {port}), timeout=1.5)
            print("new ok", flush=True)
        except TimeoutError:
            print("new timed out", flush=True)
        except OSError as exc:
            print(f"new error {{exc.errno}}", flush=True)
        continue
    s.sendall(b"c")
    s.settimeout(float(line))
    try:
        print("got", s.recv(1).decode(), flush=True)
    except TimeoutError:
        print("got nothing", flush=True)
"""
            child = subprocess.Popen(
                namespace.argv([sys.executable, "-c", probe]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdin is not None and child.stdout is not None
            try:
                assert child.stdout.readline().strip() == "connected"
                peer, _ = server.accept()
                peer.settimeout(5)

                def ask(line: str) -> str:
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write(line + "\n")
                    child.stdin.flush()
                    return child.stdout.readline().strip()

                namespace.blackhole()
                peer.sendall(b"s")
                # The client's send raises nothing, and neither side hears the other.
                assert ask("1.0") == "got nothing"
                peer.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    peer.recv(1)
                # A new connection sees silence too: no refusal, no unreachable.
                assert ask("new") == "new timed out"
                namespace.heal()
                assert not namespace.blackholed_now
                # Healed: what was sent meanwhile arrives (the same sockets, retransmitted).
                assert ask("10") == "got s"
                peer.settimeout(10)
                assert peer.recv(2) in (b"c", b"cc")
                peer.close()
            finally:
                child.kill()
                child.wait(timeout=10)
    finally:
        namespace.delete()
    rules = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
    assert namespace.links[1][0] not in rules


@pytest.mark.ensemble
@pytest.mark.skipif(PARTITION_MISSING is not None, reason=f"no partitions: {PARTITION_MISSING}")
def test_follower_partition_cuts_off_the_follower_its_holder_is_connected_to(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run_id = uuid.uuid4().hex[:10]
    with contextlib.ExitStack() as cleanup:
        # A follower cut off from its leader serves its clients for 10 s, past the 3 s timeout.
        ensemble = ZooKeeperEnsemble(3, isolatable=True, sync_limit_ticks=50)
        settings, app, records = _started(
            cleanup, ensemble, RedisServer(), RedisServer(), "test-faults-fp"
        )
        # The fault brings its own workers: the fleet starts with none.
        fleet = Fleet(app, settings, [], run_id, tmp_path_factory.mktemp("fleet-fp"))
        cleanup.callback(fleet.stop)
        env = FaultEnvironment(
            run_id=run_id,
            records=records,
            zk_hosts=ensemble.hosts,
            session_timeout=SESSION_TIMEOUT,
            fleet=fleet,
            zookeeper=ensemble,
        )
        injector = FaultInjector(env, {}, target_timeout=20.0)
        try:
            record = injector.inject("follower_partition")
        finally:
            injector.close()
        leader = ensemble.leader()
        assert record.ran, record.detail
        assert f"cut off from the other members (leader {leader})" in record.detail
        assert "the leader expired the session after" in record.detail, record.detail
        assert "entered" in record.detail and record.detail.endswith("then healed")
        member = int(record.target.rsplit(" ", 1)[1])
        assert member != leader and ensemble.isolated == frozenset()
        assert len(fleet) == 0  # its two workers are gone again
        events = SectionRecorder(records, run_id).events()
        assert [e.kind for e in events if e.kind in ("enter", "exit")].count("enter") == 2
        report = check_run(
            submitted={}, outcomes={}, events=events, faults=[record], leftover_nodes=0
        )
        assert report.violations == 0, report.summary_lines()
        ensemble.wait_serving(timeout=30)
        assert {node.mode() for node in ensemble.nodes} == {"leader", "follower"}


@pytest.mark.skipif(NETNS_MISSING is not None, reason=f"no network namespaces: {NETNS_MISSING}")
def test_a_cut_namespace_link_drops_traffic_until_healed() -> None:
    namespace = Namespace.create("cut")
    try:
        with socket.create_server((namespace.zookeeper_address, 0)) as server:
            port = server.getsockname()[1]
            probe = (
                "import socket; socket.create_connection("
                f"({namespace.zookeeper_address!r}, {port}), timeout=1)"
            )

            def connects() -> bool:
                argv = namespace.argv([sys.executable, "-c", probe])
                return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

            assert connects()
            namespace.cut()
            assert not connects()
            namespace.heal()
            assert connects()
    finally:
        namespace.delete()
    assert (
        namespace.name
        not in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True
        ).stdout
    )


def test_a_persistent_redis_keeps_its_data_across_a_crash_restart() -> None:
    with RedisServer(appendonly=True, appendfsync="always") as persistent, RedisServer() as plain:
        for server in (persistent, plain):
            client = redis.Redis.from_url(server.url)
            client.rpush("queue", "m1", "m2")
            client.close()
            down = server.restart()  # SIGKILL, then start again on the same port
            assert down < 10
            client = redis.Redis.from_url(server.url)
            kept = client.lrange("queue", 0, -1)
            client.close()
            assert kept == ([b"m1", b"m2"] if server is persistent else [])


def test_broker_restart_under_running_and_queued_tasks_loses_nothing(stack: Stack) -> None:
    run_id, worker = uuid.uuid4().hex[:10], stack.worker("prefork")
    # Both pool processes busy, so the third message waits in the broker's list (a message a
    # worker is popping at the instant of a crash is a different story: kombu's Redis
    # transport loses it, whatever the persistence).
    running = [_send(stack, worker, f"{run_id}{i}", hold_ms=2500) for i in range(2)]
    for i, result in enumerate(running):
        _entered(stack, f"{run_id}{i}", result.id)
    queued = _send(stack, worker, run_id, hold_ms=50)

    record = _inject(stack, run_id, "broker_restart")

    assert record.ran and "down" in record.detail, record
    assert record.ended is not None and record.ended >= record.time, record
    # A worker whose broker connection broke under a running task may crash (a kombu bug) a
    # moment later: the fleet restarts it, as a load test run does, until every task is done.
    sent = [*running, queued]
    injector = stack.injector(run_id)

    def settled() -> bool:
        injector.revive()
        return all(r.ready() for r in sent)

    try:
        assert wait_until(
            settled,
            timeout=VISIBILITY_TIMEOUT + 40,
            interval=0.25,
        ), [r.state for r in sent]
    finally:
        injector.close()
    for result in sent:
        assert result.get(timeout=1)["accepted"] is True
    assert all(w.is_running() for w in stack.fleet)


@pytest.mark.ensemble
def test_leader_kill_elects_another_and_restarts_the_old_one(
    zk_ensemble: ZooKeeperEnsemble, redis_url: str
) -> None:
    records = redis.Redis.from_url(redis_url)
    old = zk_ensemble.leader()
    env = FaultEnvironment(
        run_id=uuid.uuid4().hex[:10],
        records=records,
        zk_hosts=zk_ensemble.hosts,
        session_timeout=SESSION_TIMEOUT,
        zookeeper=zk_ensemble,
    )
    injector = FaultInjector(env, {}, target_timeout=0.1)  # no load to wait for here
    try:
        record = injector.inject("leader")
    finally:
        injector.close()
        records.close()
    assert record.ran, record.detail
    assert record.target.startswith(f"ZooKeeper node {old} ")
    new = zk_ensemble.leader()
    assert new != old
    assert all(node.mode() in ("leader", "follower") for node in zk_ensemble.nodes)


@pytest.mark.ensemble
@pytest.mark.fault  # a real-time outage of 4 s, about 9 s in all
def test_quorum_loss_stops_two_members_past_the_session_timeout_then_a_leader_serves_again(
    zk_ensemble: ZooKeeperEnsemble, redis_url: str
) -> None:
    records = redis.Redis.from_url(redis_url)
    old = zk_ensemble.leader()
    session_timeout = 1.0  # the outage lasts it plus the margin: 4 s
    # Its own session outlasts the outage: it sees the connection go and come back.
    observer = KazooClient(
        hosts=zk_ensemble.hosts, timeout=30.0, connection_retry={"max_delay": 0.5, "max_tries": -1}
    )
    states: list[str] = []
    observer.add_listener(states.append)
    observer.start(timeout=15)
    env = FaultEnvironment(
        run_id=uuid.uuid4().hex[:10],
        records=records,
        zk_hosts=zk_ensemble.hosts,
        session_timeout=session_timeout,
        zookeeper=zk_ensemble,
    )
    injector = FaultInjector(env, {}, target_timeout=0.1)  # no load to wait for here
    try:
        started = time.time()
        record = injector.inject("quorum_loss")
        # The fault is over once a leader serves: a write goes through at once.
        observer.create_async("/quorum-loss-", ephemeral=True, sequence=True).get(timeout=5)
    finally:
        injector.close()
        records.close()
        observer.stop()
        observer.close()
    assert record.ran, record.detail
    down = [int(m) for m in re.findall(r"(\d+) \(pid \d+\)", record.target)]
    assert len(down) == 2 and old in down, record.target
    (left,) = {1, 2, 3} - set(down)
    # The member left stopped serving: no quorum, not merely a leader change.
    assert re.search(rf"member {left} stopped serving after [\d.]+ s \(no quorum\)", record.detail)
    kept = float(re.search(r"kept down ([\d.]+) s", record.detail)[1])  # type: ignore[index]
    assert kept >= session_timeout + QUORUM_LOSS_MARGIN, record.detail
    assert record.ended is not None and record.ended - started >= kept, record
    # Every client lost its connection, and came back.
    assert KazooState.SUSPENDED in states, states
    assert KazooState.CONNECTED in states[states.index(KazooState.SUSPENDED) :], states
    modes = [node.mode() for node in zk_ensemble.nodes]
    assert sorted(modes, key=str) == ["follower", "follower", "leader"], modes


def test_faults_that_need_local_processes_are_recorded_as_not_run(
    zk_hosts: str, redis_url: str
) -> None:
    records = redis.Redis.from_url(redis_url)
    env = FaultEnvironment(
        run_id=uuid.uuid4().hex[:10],
        records=records,
        zk_hosts=zk_hosts,
        session_timeout=SESSION_TIMEOUT,
    )
    injector = FaultInjector(env, {}, target_timeout=0.1)
    try:
        outcomes = {kind: injector.inject(kind) for kind in FAULT_KINDS if kind != "expire"}
        # expire needs only ZooKeeper, but a holder: none here.
        expire = injector.inject("expire")
    finally:
        injector.close()
        records.close()
    for kind, record in outcomes.items():
        assert not record.ran, kind
        # Nothing here can ever run them: said so, and not tried a second time.
        assert record.detail.startswith(UNAVAILABLE), (kind, record.detail)
        assert "second try" not in record.detail, kind
    assert "external run" in outcomes["kill"].detail
    assert "external run" in outcomes["blackhole"].detail
    assert "ensemble" in outcomes["leader"].detail
    assert "ensemble" in outcomes["follower_partition"].detail
    assert "ensemble" in outcomes["quorum_loss"].detail
    # No holder in time may pass: tried once more, and the record says why both did not count.
    assert not expire.ran and "was not inside a section" in expire.detail
    assert "(second try; the first: a worker was not inside a section" in expire.detail
