"""`celery -A tests.taskapp zklock ...` and the task's lock_path/lock_holder, on a real ZooKeeper
with real `celery worker` processes; break detection on a bare lease (no Celery) first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock import LockLost, Mutex
from celery_zklock.locks.clock import LeaseTiming
from celery_zklock.locks.contenders import queue_of
from celery_zklock.locks.holders import read_lock, request_break
from celery_zklock.locks.semaphore import Semaphore
from celery_zklock.ops.commands import operator
from celery_zklock.zk.client import close_clients
from celery_zklock.zk.settings import forget_settings
from tests.conftest import SESSION_TIMEOUT
from tests.lockutil import wait_for, watches_by_path
from tests.taskapp import read_records
from tests.workerproc import ROOT, workers

NO_GATE = {"ZKLOCK_GATE": "false"}
"""Workers without the gate (celery_zklock.worker.gate): their waiting runs are in the lock's
queue."""
IDENTITY = json.dumps({"task_id": "recipe-run", "task": "none", "worker": "here", "pid": 1})


def celery_zklock(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.taskapp zklock ARGS`` as a subprocess with the workers' environment."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.taskapp", "zklock", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def invoke(*args: str, input: str | None = None) -> Result:
    """The same command in this process (the app's settings read afresh from the env)."""
    from celery.bin.celery import celery

    from tests import taskapp

    forget_settings(taskapp.app)
    return CliRunner().invoke(celery, ["-A", "tests.taskapp", "zklock", *args], input=input)


@pytest.fixture
def cli_env(zk_hosts: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The in-process command's settings: this ZooKeeper, the workers' session timeout."""
    monkeypatch.setenv("ZKLOCK_HOSTS", zk_hosts)
    monkeypatch.setenv("ZKLOCK_SESSION_TIMEOUT", str(SESSION_TIMEOUT))
    yield
    from tests import taskapp

    forget_settings(taskapp.app)


def watched_by(hosts: str, node: str, session_id: int) -> bool:
    """True if the session ``session_id`` has a watch on ``node`` (``wchp``)."""
    return any(int(s, 16) == session_id for s in watches_by_path(hosts).get(node, []))


def children(zk: KazooClient, path: str) -> list[str]:
    try:
        return list(zk.get_children(path))
    except NoNodeError:
        return []


# -- break detection on a bare lease ---------------------------------------------------------


@pytest.fixture
def holder_client(zk_hosts: str) -> Iterator[KazooClient]:
    client = KazooClient(zk_hosts, timeout=SESSION_TIMEOUT)
    client.start(timeout=15)
    try:
        yield client
    finally:
        client.stop()
        client.close()


@pytest.mark.parametrize("watched", [False, True], ids=["before-the-watch", "watched"])
def test_a_break_request_ends_the_lease_and_the_waiter_is_granted_after_release(
    watched: bool,
    holder_client: KazooClient,
    zk_client: KazooClient,
    zk_hosts: str,
    lock_root: str,
) -> None:
    lease = Mutex(holder_client, lock_root).acquire(timeout=5, data=IDENTITY.encode())
    lost = threading.Event()
    reasons: list[str] = []
    lease.on_lost(lambda reason: (reasons.append(reason), lost.set()))
    granted = threading.Event()
    waiter_result: list[Any] = []

    def wait_turn() -> None:
        with Mutex(zk_client, lock_root).acquire(timeout=30) as waiter:
            waiter_result.append(waiter.token)
            granted.set()

    thread = threading.Thread(target=wait_turn)
    thread.start()
    wait_for(lambda: len(children(zk_client, lock_root)) == 2, 10, "the waiter to queue")
    session_id = holder_client.client_id[0]
    if watched:
        wait_for(lambda: watched_by(zk_hosts, lease.node, session_id), 10, "the break watch")
    else:
        assert not watched_by(zk_hosts, lease.node, session_id)
    sent = time.monotonic()
    assert request_break(zk_client, lease.node, "alice@ops", "why").status == "requested"
    assert lost.wait(LeaseTiming(SESSION_TIMEOUT).renew_interval * 2 + 1)
    detected = time.monotonic() - sent
    print(f"break detected after {detected * 1000:.1f} ms ({'watched' if watched else 'tick'})")
    if watched:
        assert detected < 0.5
    assert reasons == ["broken by operator alice@ops: why"] and lease.lost
    with pytest.raises(LockLost, match="broken by operator alice@ops"):
        lease.check()
    # Told, not released: the node stays and the waiter waits until the holder lets go.
    assert zk_client.exists(lease.node) is not None and not granted.is_set()
    lease.release()
    thread.join(10)
    assert granted.is_set() and waiter_result[0] > lease.token


def test_read_lock_shows_a_semaphores_holders_and_a_lease_of_it_can_be_broken(
    holder_client: KazooClient, zk_client: KazooClient, zk_hosts: str, lock_root: str
) -> None:
    leases = [
        Semaphore(client, lock_root, max_leases=2).acquire(timeout=5, data=IDENTITY.encode())
        for client in (holder_client, zk_client)
    ]
    third = KazooClient(zk_hosts, timeout=SESSION_TIMEOUT)
    third.start(timeout=15)
    waiter = threading.Thread(
        target=lambda: Semaphore(third, lock_root, max_leases=2).acquire(timeout=30).release()
    )
    waiter.start()
    wait_for(lambda: len(children(zk_client, lock_root)) == 3, 10, "the waiter to queue")
    state = read_lock(zk_client, lock_root)
    assert (state.mode, state.limit) == ("semaphore", 2)
    assert [f"{lock_root}/{e.name}" for e in state.holders] == [lease.node for lease in leases]
    assert len(state.waiters) == 1
    assert request_break(zk_client, leases[0].node, "alice@ops", None).status == "requested"
    wait_for(lambda: leases[0].lost, 5, "the broken lease to count as lost")
    assert leases[0].lost_reason == "broken by operator alice@ops" and not leases[1].lost
    for lease in leases:
        lease.release()
    waiter.join(10)
    third.stop()
    third.close()
    assert not waiter.is_alive()


def test_a_watched_lease_whose_node_is_deleted_counts_as_lost_at_once(
    holder_client: KazooClient, zk_client: KazooClient, zk_hosts: str, lock_root: str
) -> None:
    """What ``break --force`` does to a holder that is still alive: it learns at once."""
    lease = Mutex(holder_client, lock_root).acquire(timeout=5, data=IDENTITY.encode())
    session_id = holder_client.client_id[0]
    wait_for(lambda: watched_by(zk_hosts, lease.node, session_id), 10, "the break watch")
    lost = threading.Event()
    lease.on_lost(lambda _: lost.set())
    zk_client.delete(lease.node)
    assert lost.wait(1.0)
    assert lease.lost_reason == "the lock node was deleted by someone else while it was held"
    lease.release()


def test_a_lease_released_within_a_renewal_interval_reads_nothing_for_breaks(
    holder_client: KazooClient, lock_root: str
) -> None:
    reads: list[str] = []
    original = holder_client.get_async

    def counting(path: str, watch: Any = None) -> Any:
        reads.append(path)
        return original(path, watch=watch)

    holder_client.get_async = counting  # type: ignore[method-assign]
    interval = LeaseTiming(SESSION_TIMEOUT).renew_interval
    for _ in range(5):
        with Mutex(holder_client, lock_root).acquire(timeout=5):
            pass
    assert reads == []
    with Mutex(holder_client, lock_root).acquire(timeout=5) as lease:
        wait_for(lambda: lease.node in reads, interval * 2 + 1, "the break read")
        time.sleep(interval * 2)  # more ticks: still one read
    assert reads == [lease.node]


# -- the commands on a bare lease ------------------------------------------------------------


def test_break_asks_first_and_refuses_what_it_cannot_break(
    cli_env: None, holder_client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    lease = Mutex(holder_client, lock_root).acquire(timeout=5, data=IDENTITY.encode())
    declined = invoke("break", lock_root, input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert "task recipe-run (none) on here pid 1" in declined.output
    assert zk_client.get(lease.node)[0] == IDENTITY.encode() and not lease.lost
    # Not a lock, a free lock, a waiter's node.
    assert "no lock here" in invoke("break", f"{lock_root}-none", "--yes").output
    waiter = Mutex(zk_client, lock_root)
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=5).release())
    thread.start()
    wait_for(lambda: len(children(zk_client, lock_root)) == 2, 10, "the waiter to queue")
    waiting = queue_of(children(zk_client, lock_root))[-1].name
    refused = invoke("break", f"{lock_root}/{waiting}", "--yes")
    assert refused.exit_code == 1 and "is waiting, not holding" in refused.output
    lease.release()
    thread.join(10)


def test_break_of_a_holder_that_does_not_let_go_needs_force(
    cli_env: None, holder_client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    # A holder that hears the break but never releases (its body ignores the interruption).
    lease = Mutex(holder_client, lock_root).acquire(timeout=5, data=IDENTITY.encode())
    stuck = invoke("break", lock_root, "--yes", "--timeout", "0.5")
    assert stuck.exit_code == 1 and "did not let go within 0.5s" in stuck.output
    assert zk_client.exists(lease.node) is not None
    forced = invoke("break", lease.node, "--yes", "--timeout", "0.2", "--force")
    assert forced.exit_code == 0, forced.output
    assert "a break was already requested by" in forced.output
    assert "DELETED by force" in forced.output and zk_client.exists(lease.node) is None
    wait_for(lambda: lease.lost, 5, "the holder to count its lease lost")
    lease.release()
    # A Curator holder (its IP as data) cannot hear a request: only --force deletes it. The
    # lock's container may have been reaped once empty: makepath makes it again.
    curator = zk_client.create(
        f"{lock_root}/_c_8a0f5a0e-1c2b-4d3e-8f40-5a6b7c8d9e0f-lock-", b"10.0.0.7",
        ephemeral=True, sequence=True, makepath=True,
    )  # fmt: skip
    deaf = invoke("break", lock_root, "--yes")
    assert deaf.exit_code == 1 and "cannot hear a break request" in deaf.output
    assert zk_client.get(curator)[0] == b"10.0.0.7"
    assert invoke("break", lock_root, "--yes", "--force").exit_code == 0
    assert zk_client.exists(curator) is None


# -- with workers ----------------------------------------------------------------------------


def entered(tmp: Path, key: str, role: str) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in read_records(tmp / f"breaks-{key}")
            if (r["event"], r["role"]) == ("enter", role)
        ),
        None,
    )


def test_locks_and_holder_name_the_running_task_and_its_waiter(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    env = {**env, **NO_GATE}  # the waiter must wait in the lock's queue, not at the gate
    from tests.taskapp import breakable

    with workers(app, "prefork", 2, env, tmp) as (first, second):
        held = breakable.apply_async(("lk", "holder", 60.0), queue=first.queue)
        wait_for(lambda: entered(tmp, "lk", "holder"), 30, "the holder to enter")
        record = entered(tmp, "lk", "holder")
        assert record is not None
        waiting = breakable.apply_async(("lk", "waiter", 0.0), queue=second.queue)
        path = breakable.lock_path("lk", "any role", 1.0)
        assert path == record["node"].rsplit("/", 1)[0]
        wait_for(lambda: len(children(zk_client, path)) == 2, 30, "the waiter to queue")

        listed = celery_zklock("locks", "--json", "--task", "tests.taskapp.breakable", env=env)
        assert listed.returncode == 0, listed.stderr
        document = json.loads(listed.stdout)
        (lock,) = [lock for lock in document["locks"] if lock["path"] == path]
        assert (lock["name"], lock["mode"]) == ("breakable", "exclusive")
        (holder,) = lock["holders"]
        assert holder["task_id"] == held.id and holder["task"] == "tests.taskapp.breakable"
        assert holder["worker"] == first.nodename and holder["pid"] == record["pid"]
        assert holder["token"] == record["token"] and holder["node"] == record["node"]
        assert 0 <= holder["held_for"] < 60
        (waiter,) = lock["waiters"]
        assert waiter["task_id"] == waiting.id and waiter["worker"] == second.nodename
        assert waiter["position"] == 1 and waiter["token"] > holder["token"]

        table = celery_zklock("locks", env=env)
        assert table.returncode == 0, table.stderr
        rows = [line for line in table.stdout.splitlines() if held.id in line or waiting.id in line]
        assert len(rows) == 2 and rows[0].startswith(path) and "holder" in rows[0]
        assert "waiter 1" in rows[1]
        print(table.stdout)

        answer = celery_zklock(
            "holder", "tests.taskapp.breakable", "--args", '["lk"]',
            "--kwargs", '{"role": "x", "seconds": 1}', env=env,
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        assert f"lock: {path}" in answer.stdout and held.id in answer.stdout

        found = breakable.lock_holder("lk", "x", 1)
        assert found is not None
        assert (found.task_id, found.worker, found.pid) == (held.id, first.nodename, record["pid"])
        assert (found.token, found.node) == (record["token"], record["node"])
        assert breakable.lock_holder("nobody-holds-this", "x", 1) is None
        close_clients()  # the one lock_holder opened in this process

        (tmp / "release-lk").touch()
        assert held.get(timeout=30)["token"] == record["token"]
        assert waiting.get(timeout=30)["token"] > record["token"]


TRIALS = 10


def break_trial(
    tmp: Path,
    env: dict[str, str],
    holder_worker: Any,
    waiter_worker: Any,
    zk_client: KazooClient,
    zk_hosts: str,
    key: str,
    late: bool,
) -> dict[str, Any]:
    """One break: a holder on ``holder_worker``, a waiter queued behind it from
    ``waiter_worker``, then ``break`` of the lock path; with ``late``, once the holder's break
    watch exists and as a subprocess, else at once (before the watch, usually) in this process.
    Checks the order from the records; returns the trial's figures."""
    from tests.taskapp import breakable

    began = time.monotonic()
    held = breakable.apply_async((key, "holder", 60.0), queue=holder_worker.queue)
    wait_for(lambda: entered(tmp, key, "holder"), 30, "the holder to enter")
    record = entered(tmp, key, "holder")
    assert record is not None
    waiting = breakable.apply_async((key, "waiter", 0.0), queue=waiter_worker.queue)
    path = record["node"].rsplit("/", 1)[0]
    wait_for(lambda: len(children(zk_client, path)) == 2, 30, "the waiter to queue")
    node, session_id = record["node"], record["session_id"]
    if late:
        wait_for(lambda: watched_by(zk_hosts, node, session_id), 10, "the holder's break watch")
    watch_at_break = watched_by(zk_hosts, node, session_id)
    args = ("break", path, "--yes", "--reason", f"trial {key}")
    if late:
        done = celery_zklock(*args, env=env)
        code, output = done.returncode, done.stdout + done.stderr
    else:
        result = invoke(*args)
        code, output = result.exit_code, result.output
    assert code == 0, output
    assert "its run ended FAILURE: LockLost" in output
    with pytest.raises(LockLost, match=f"broken by operator .*: trial {key}"):
        held.get(timeout=30, propagate=True)
    assert waiting.get(timeout=30)["token"] > record["token"]
    records = read_records(tmp / f"breaks-{key}")
    assert [(r["role"], r["event"]) for r in records] == [
        ("holder", "enter"), ("holder", "exit"), ("waiter", "enter"), ("waiter", "exit"),
    ]  # fmt: skip
    assert records[1]["error"] == "LockLost"
    lost = [r for r in read_records(tmp / "lost-events") if r["task_id"] == held.id]
    assert len(lost) == 1 and lost[0]["time"] < records[2]["time"]
    released = re.search(r"released after ([0-9.]+)s", output)
    assert released is not None, output
    return {
        "key": key,
        "watched": watch_at_break,
        "written_to_node_gone_s": float(released.group(1)),
        "lost_event_minus_holder_exit_ms": round((lost[0]["time"] - records[1]["time"]) * 1000, 1),
        "holder_exit_to_waiter_enter_ms": round(
            (records[2]["time"] - records[1]["time"]) * 1000, 1
        ),
        "trial_s": round(time.monotonic() - began, 2),
    }


def test_break_ends_the_holder_lock_lost_before_the_waiter_is_granted(
    taskenv: tuple[Celery, dict[str, str], Path],
    zk_client: KazooClient,
    zk_hosts: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """10 of 10: the holder's run is interrupted and ends LockLost, and only after its exit
    (and its lost event) does the waiter enter. Half the breaks are written at once (before the
    holder's break watch exists, seen at its first tick), half once the watch exists (seen
    through it); those run the command as a subprocess, the others in this process."""
    app, env, tmp = taskenv
    env = {**env, **NO_GATE}  # the waiter must wait in the lock's queue, not at the gate
    with workers(app, "prefork", 2, env, tmp) as (first, second):
        figures = [
            break_trial(tmp, env, first, second, zk_client, zk_hosts, f"t{i}", i % 2 == 1)
            for i in range(TRIALS)
        ]
        worker_log = first.log_path.read_text()
    for figure in figures:
        print(figure)
    assert len(figures) == TRIALS
    assert any(f["watched"] for f in figures) and not all(f["watched"] for f in figures)
    # Who ran it, in the command's log (the in-process runs) and the holder's lost event.
    requested = [r.getMessage() for r in caplog.records if r.name == "celery_zklock.commands"]
    assert sum("zklock break requested" in m for m in requested) == TRIALS // 2
    assert all(f"by={operator()}" in m for m in requested if "requested" in m)
    lost_lines = [line for line in worker_log.splitlines() if "event=lost" in line]
    assert len(lost_lines) == TRIALS
    assert all(f"reason=broken by operator {operator()}: trial" in line for line in lost_lines)
    assert all(" code=broken " in line for line in lost_lines)


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_break_in_threads_and_gevent_pools(
    pool: str, taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient, zk_hosts: str
) -> None:
    """One break of each kind where the body runs in a thread or a greenlet (and, under
    gevent, the lease clock's renewer is a greenlet too)."""
    app, env, tmp = taskenv
    env = {**env, **NO_GATE}  # the waiter must wait in the lock's queue, not at the gate
    with workers(app, pool, 2, env, tmp) as (first, second):
        for late in (False, True):
            print(break_trial(tmp, env, first, second, zk_client, zk_hosts, f"{pool}{late}", late))


# -- doctor ----------------------------------------------------------------------------------


def test_doctor_passes_on_a_server_that_grants_the_session_timeout(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    _, env, _ = taskenv
    done = celery_zklock("doctor", env=env)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for check in ("connect", "session timeout", "server", "lease safety", "containers", "acl",
                  "connections per address"):  # fmt: skip
        assert any(line.startswith("PASS") and f"  {check}" in line for line in lines), check
    assert not any(line.startswith("FAIL") for line in lines)


def test_doctor_fails_on_a_server_that_caps_the_session_timeout(zk_stack_factory: Any) -> None:
    server = zk_stack_factory.server(max_session_timeout_ms=2000)
    env = {"ZKLOCK_HOSTS": server.hosts, "ZKLOCK_SESSION_TIMEOUT": "4"}
    done = celery_zklock("doctor", env=env)
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  session timeout: the server capped it at 2s" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("doctor: not safe")


def test_doctor_over_tls_with_sasl_and_creator_acl(zk_secure_server: Any) -> None:
    server = zk_secure_server
    env = {
        "ZKLOCK_HOSTS": server.tls_hosts,
        "ZKLOCK_SESSION_TIMEOUT": "10",
        "ZKLOCK_USE_SSL": "true",
        "ZKLOCK_SSL_CA": str(server.ca_file),
        "ZKLOCK_SASL_MECHANISM": "DIGEST-MD5",
        "ZKLOCK_SASL_USERNAME": "alice",
        "ZKLOCK_SASL_PASSWORD": server.sasl_users["alice"],
        "ZKLOCK_ACL": "creator",
    }
    done = celery_zklock("doctor", env=env)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  server localhost:" in done.stdout  # srvr answered over TLS
    assert "zklock_acl=creator -> sasl:alice=ALL, world:anyone=READ" in done.stdout
    assert "identities: sasl DIGEST-MD5 as alice" in done.stdout
    assert server.sasl_users["alice"] not in done.stdout


@pytest.mark.parametrize("name", ["..", "."])
def test_locks_with_a_lock_name_that_is_no_znode_name_is_a_usage_error(
    cli_env: None, name: str
) -> None:
    result = invoke("locks", "--task", name)
    assert result.exit_code == 2, (result.exception, result.output)
    assert "a lock name is one znode path segment" in result.output


# -- usage: what each command refuses and prints -----------------------------------------------


def test_break_prints_each_step_once(
    zk_hosts: str, holder_client: KazooClient, zk_client: KazooClient
) -> None:
    """The command's own lines, not each again from its log records (Python's last resort
    printed those to stderr when no logging is configured, as in a terminal)."""
    path = "/taskapp/break-once/k"
    lease = Mutex(holder_client, path).acquire(timeout=5, data=IDENTITY.encode())
    lost = threading.Event()
    lease.on_lost(lambda _: lost.set())
    releaser = threading.Thread(target=lambda: (lost.wait(30), lease.release()))
    releaser.start()
    try:
        done = celery_zklock(
            "break", path, "--yes", "--reason", "once", env={"ZKLOCK_HOSTS": zk_hosts}
        )
    finally:
        lost.set()
        releaser.join(10)
    output = done.stdout + done.stderr
    print(output)
    assert done.returncode == 0, output
    assert output.count("released after") == 1, output
    assert output.count(lease.node) == 1, output  # the "released after" line names it
    assert "zklock break requested" not in output
    assert zk_client.exists(lease.node) is None


def test_locks_of_an_unknown_task_is_a_usage_error_naming_it(
    cli_env: None, zk_client: KazooClient
) -> None:
    unknown = invoke("locks", "--task", "tests.taskapp.brekable")
    assert unknown.exit_code == 2, unknown.output
    assert "'tests.taskapp.brekable' is not a task of this app" in unknown.output
    assert "tests.taskapp.breakable" in unknown.output  # the locked tasks are listed
    assert "no locks held" not in unknown.output
    plain = invoke("locks", "--task", "celery.backend_cleanup")
    assert plain.exit_code == 2 and "is not a ZkLockTask" in plain.output
    # A task, the lock name one of the app's tasks uses, a lock name that exists under the
    # root (another app's or a recipe's): each is known, and nothing is held there.
    zk_client.ensure_path("/taskapp/recipe-lock")
    for name in ("tests.taskapp.breakable", "breakable", "recipe-lock"):
        known = invoke("locks", "--task", name)
        assert known.exit_code == 0, (name, known.output)
        assert "no locks held" in known.output


def test_holder_refuses_arguments_that_are_not_the_calls(cli_env: None) -> None:
    extra = invoke("holder", "tests.taskapp.breakable", "acct-42")
    assert extra.exit_code == 2 and "unexpected extra argument (acct-42)" in extra.output
    too_many = invoke("holder", "tests.taskapp.breakable", "--args", '["a", "b", 1, 2]')
    assert too_many.exit_code == 2 and "too many positional arguments" in too_many.output
    unknown = invoke(
        "holder",
        "tests.taskapp.breakable",
        "--kwargs",
        '{"key": "a", "role": "r", "seconds": 1, "x": 1}',
    )
    assert unknown.exit_code == 2 and "unexpected keyword argument 'x'" in unknown.output


def test_holder_and_lock_holder_take_just_the_key_arguments(
    cli_env: None, holder_client: KazooClient
) -> None:
    """``breakable(key, role, seconds)`` with ``lock_key=["key"]``: who holds key "lk" is asked
    with "lk" alone; a call that leaves out the key's own argument is told which."""
    from tests.taskapp import app, breakable

    forget_settings(app)
    path = breakable.lock_path("lk")
    assert path == breakable.lock_path("lk", "any role", 1.0)
    lease = Mutex(holder_client, path).acquire(timeout=5, data=IDENTITY.encode())
    try:
        found = breakable.lock_holder("lk")
        assert found is not None and (found.task_id, found.node) == ("recipe-run", lease.node)
        close_clients()  # the one lock_holder opened in this process
        answer = invoke("holder", "tests.taskapp.breakable", "--args", '["lk"]')
        assert answer.exit_code == 0, answer.output
        assert f"lock: {path}" in answer.output and "recipe-run" in answer.output
        missing = invoke("holder", "tests.taskapp.breakable", "--kwargs", '{"role": "x"}')
        assert missing.exit_code == 2
        assert "missing the lock key's argument 'key'" in missing.output
    finally:
        lease.release()
