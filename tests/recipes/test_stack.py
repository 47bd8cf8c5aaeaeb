"""The local stack (celery_zklock.testing) against real ZooKeeper and Redis processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

from celery_zklock.testing import (
    MissingDependency,
    RedisServer,
    StackError,
    ZooKeeperEnsemble,
    ZooKeeperServer,
    free_port,
)
from celery_zklock.testing import zookeeper as zookeeper_module
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import (
    listener_is_owned_by,
    live_children,
    pause_process,
    thread_states,
    wait_until,
)
from celery_zklock.zk import four_letter

REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------- helpers


def process_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (no such process, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def connected_client(hosts: str) -> KazooClient:
    client = KazooClient(hosts=hosts)
    client.start(timeout=10)
    return client


def close(client: KazooClient) -> None:
    client.stop()
    client.close()


def forced_ports(first: int) -> Callable[[], int]:
    """A port picker that returns ``first`` once, then real free ports."""
    ports = iter([first])
    return lambda: next(ports, None) or free_port()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 on which this test process listens (and never answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


class FakeServer:
    """Listens on a port in this process and answers every connection with ``reply``."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.answered = 0
        self._closing = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self._closing:
                conn.close()
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(64)
                    conn.sendall(self.reply)
                    self.answered += 1
                except OSError:
                    pass

    def close(self) -> None:
        self._closing = True
        with socket.create_connection(("127.0.0.1", self.port)):
            pass  # wakes accept() up
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_zookeeper() -> Iterator[FakeServer]:
    server = FakeServer(b"Zookeeper version: 3.8.0-fake\nMode: standalone\nNode count: 5\n")
    yield server
    server.close()


# -------------------------------------------------------------------------------- standalone


def test_standalone_server_serves_kazoo_and_leaves_nothing_behind() -> None:
    with ZooKeeperServer() as zk:
        pid, directory = zk.pid, zk.node.directory
        assert pid is not None
        assert zk.hosts == f"127.0.0.1:{zk.port}"
        assert listener_is_owned_by(pid, zk.port)
        assert "Mode: standalone" in (four_letter.ask("127.0.0.1", zk.port, "srvr") or "")
        client = connected_client(zk.hosts)
        try:
            client.create("/stack-test", b"hello")
            assert client.get("/stack-test")[0] == b"hello"
        finally:
            close(client)
        with pytest.raises(StackError, match="already started"):
            zk.start()
        # ZooKeeper's own log goes to a file in the server's directory.
        assert "binding to port" in (directory / "zookeeper.log").read_text()
    assert process_gone(pid)
    assert not directory.exists()
    assert zk.pid is None
    zk.stop()  # idempotent
    with pytest.raises(StackError, match="not started"):
        _ = zk.hosts


def test_options_reach_the_server(zk_stack_factory: StackFactory) -> None:
    zk = zk_stack_factory.server(
        tick_time_ms=100,
        max_session_timeout_ms=5_000,
        container_check_interval_ms=150,
        container_max_per_minute=12_345,
        force_sync=False,
        extra_jvm_flags=["-Dzklock.test.marker=yes"],
    )
    conf = four_letter.ask("127.0.0.1", zk.port, "conf") or ""
    assert "tickTime=100" in conf
    assert "maxSessionTimeout=5000" in conf
    assert "maxClientCnxns=0" in conf  # tests open hundreds of clients from one address
    cfg = (zk.node.directory / "zoo.cfg").read_text()
    assert "forceSync=no" in cfg.splitlines()
    cmdline = Path(f"/proc/{zk.pid}/cmdline").read_bytes().split(b"\0")
    for flag in (
        b"-Dznode.container.checkIntervalMs=150",
        b"-Dznode.container.maxPerMinute=12345",
        b"-Dzklock.test.marker=yes",
        b"-Xmx64m",
    ):
        assert flag in cmdline


def test_the_suites_servers_write_their_log_without_fsync(zk_stack_factory: StackFactory) -> None:
    """tests/conftest.py starts every ZooKeeper with ``-Dzookeeper.forceSync=no``: a request
    never waits behind an fsync of the disk the rest of the suite keeps busy (up to 1.36 s
    measured, past what a T = 4 s lease allows). ``mntr`` counts the fsyncs of the log."""
    zk = zk_stack_factory.server()
    client = KazooClient(hosts=zk.hosts)
    client.start(timeout=15)
    try:
        for n in range(3):
            client.create(f"/fsync-{n}", b"x")  # each a transaction written to the log
    finally:
        client.stop()
        client.close()
    mntr = (four_letter.ask("127.0.0.1", zk.port, "mntr") or "").splitlines()
    assert "zk_cnt_fsynctime\t0" in mntr, [line for line in mntr if "fsync" in line]


def test_invalid_options_are_rejected_with_the_option_named() -> None:
    with pytest.raises(ValueError, match="max_session_timeout_ms"):
        ZooKeeperServer(tick_time_ms=1000, max_session_timeout_ms=1000)
    with pytest.raises(ValueError, match="size >= 2"):
        ZooKeeperEnsemble(size=1)


# ----------------------------------------------------------------------------------- ensemble


def set_with_deadline(client: KazooClient, path: str, value: bytes, timeout: float) -> float:
    """Set ``path`` to ``value``, retrying while the ensemble fails over; return seconds taken."""
    start = time.monotonic()
    deadline = start + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            client.set_async(path, value).get(timeout=1.0)
            return time.monotonic() - start
        except (KazooException, KazooTimeoutError) as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"no write succeeded within {timeout} s; last error: {last!r}")


@pytest.mark.ensemble
def test_ensemble_elects_fails_over_and_takes_a_restarted_node_back() -> None:
    with ZooKeeperEnsemble(3) as ens:
        pids = [node.pid for node in ens.nodes]
        directories = [node.directory for node in ens.nodes]
        assert [node.myid for node in ens.nodes] == [1, 2, 3]
        assert ens.hosts == ",".join(f"127.0.0.1:{node.port}" for node in ens.nodes)
        old_leader = ens.leader()
        assert "Mode: leader" in (ens.node(old_leader).srvr() or "")
        followers = [n for n in ens.nodes if n.myid != old_leader]
        assert all("Mode: follower" in (n.srvr() or "") for n in followers)

        client = connected_client(ens.hosts)
        try:
            client.create("/failover", b"before")
            old_pid = ens.node(old_leader).pid
            assert old_pid is not None
            ens.kill(old_leader)
            assert process_gone(old_pid)
            assert not ens.node(old_leader).is_running()
            set_with_deadline(client, "/failover", b"after", timeout=15.0)
            new_leader = ens.leader()
            assert new_leader != old_leader
            assert "Mode: leader" in (ens.node(new_leader).srvr() or "")

            ens.restart(old_leader)
            restarted = ens.node(old_leader)
            assert restarted.pid not in (None, old_pid)
            assert "Mode: follower" in (restarted.srvr() or "")
            ens.wait_serving(timeout=10)
        finally:
            close(client)
        # The restarted node kept its data and caught up with the write made without it.
        only_restarted = connected_client(f"127.0.0.1:{restarted.port}")
        try:
            only_restarted.sync("/failover")
            assert only_restarted.get("/failover")[0] == b"after"
        finally:
            close(only_restarted)
        pids.append(restarted.pid)
    assert all(pid is not None and process_gone(pid) for pid in pids)
    assert not any(directory.exists() for directory in directories)


# ----------------------------------------------------------------------------------- pause


def test_a_paused_process_runs_no_thread_once_the_pause_returns() -> None:
    """Before: tests paused a server with a bare ``os.kill(pid, SIGSTOP)``, which returns
    before the stop is complete; a thread still running answered a request sent right after
    (a deduplicated call that had to meet a paused server found it answering, CI of stop 52).
    Threads that never sleep are the ones a bare kill leaves running longest."""
    spin = textwrap.dedent("""
        import threading, time
        def spin():
            while True:
                pass
        for _ in range(4):
            threading.Thread(target=spin, daemon=True).start()
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        assert wait_until(lambda: len(os.listdir(f"/proc/{child.pid}/task")) == 5, 10)
        for _ in range(20):
            pause_process(child.pid)
            states = thread_states(child.pid)
            assert set(states) <= {"T"}, states
            os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------- port not ours


def test_listener_ownership_is_checked_against_the_process(taken_port: int) -> None:
    assert listener_is_owned_by(os.getpid(), taken_port)
    assert not listener_is_owned_by(os.getppid(), taken_port)
    assert not listener_is_owned_by(os.getpid(), free_port())  # nobody listens there


def test_a_port_taken_by_a_listener_is_never_ours(taken_port: int) -> None:
    always_taken = ZooKeeperServer(port_picker=lambda: taken_port, start_attempts=2)
    with pytest.raises(StackError, match=str(taken_port)) as info:
        always_taken.start(timeout=20)
    assert "Address already in use" in str(info.value)  # the log tail is in the message
    assert always_taken.pid is None

    with ZooKeeperServer(port_picker=forced_ports(taken_port)) as zk:
        assert zk.port != taken_port
        assert zk.pid is not None and listener_is_owned_by(zk.pid, zk.port)


def test_a_fake_server_answering_srvr_is_not_taken_for_ours(fake_zookeeper: FakeServer) -> None:
    answer = four_letter.ask("127.0.0.1", fake_zookeeper.port, "srvr")
    assert "Mode: standalone" in (answer or "")  # it does look ready
    answered_before = fake_zookeeper.answered
    with pytest.raises(StackError):
        ZooKeeperServer(port_picker=lambda: fake_zookeeper.port, start_attempts=1).start()
    assert fake_zookeeper.answered > answered_before  # readiness asked it, and rejected it

    with ZooKeeperServer(port_picker=forced_ports(fake_zookeeper.port)) as zk:
        assert zk.port != fake_zookeeper.port
        assert zk.pid is not None and listener_is_owned_by(zk.pid, zk.port)
        client = connected_client(zk.hosts)
        close(client)


def test_an_ensemble_retries_when_a_client_port_is_taken(fake_zookeeper: FakeServer) -> None:
    with ZooKeeperEnsemble(3, port_picker=forced_ports(fake_zookeeper.port)) as ens:
        ports = {port for n in ens.nodes for port in (n.port, n.quorum_port, n.election_port)}
        assert fake_zookeeper.port not in ports
        assert all(n.pid is not None and listener_is_owned_by(n.pid, n.port) for n in ens.nodes)


def test_a_fake_redis_is_not_taken_for_ours() -> None:
    fake = FakeServer(b"+PONG\r\n")
    try:
        # Refused either by the readiness probe (it asked the fake and saw it was not ours) or
        # because redis-server could not bind: which comes first depends on the machine's load.
        with pytest.raises(StackError):
            RedisServer(port_picker=lambda: fake.port, start_attempts=1).start()
        with RedisServer(port_picker=forced_ports(fake.port)) as server:
            assert server.port != fake.port
            assert redis.Redis.from_url(server.url).ping()
    finally:
        fake.close()


# -------------------------------------------------------------------------- missing programs


def test_missing_java_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    children_before = live_children()
    with pytest.raises(MissingDependency, match="apt-get install -y default-jre-headless"):
        ZooKeeperServer().start()
    with pytest.raises(MissingDependency, match="apt-get install -y default-jre-headless"):
        ZooKeeperEnsemble(3).start()
    assert live_children() == children_before


def test_missing_zookeeper_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(MissingDependency, match="apt-get install -y zookeeper"):
        ZooKeeperServer(zookeeper_home=tmp_path).start()
    monkeypatch.setenv("ZOOKEEPER_HOME", str(tmp_path))
    with pytest.raises(MissingDependency, match=r"ZOOKEEPER_HOME.*apt-get install -y zookeeper"):
        ZooKeeperEnsemble(3).start()
    monkeypatch.delenv("ZOOKEEPER_HOME")
    monkeypatch.setattr(zookeeper_module, "DEBIAN_ZOOKEEPER_JAR", tmp_path / "zookeeper.jar")
    with pytest.raises(MissingDependency, match="apt-get install -y zookeeper"):
        ZooKeeperServer().start()


def test_missing_redis_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingDependency, match="apt-get install -y redis-server"):
        RedisServer().start()


def test_zookeeper_home_with_an_apache_layout_is_used(tmp_path: Path) -> None:
    # An Apache release layout: the server jar at the top, other jars in lib/.
    (tmp_path / "lib").mkdir()
    (tmp_path / "zookeeper-3.8.0.jar").symlink_to("/usr/share/java/zookeeper.jar")
    (tmp_path / "lib" / "slf4j-simple.jar").symlink_to("/usr/share/java/slf4j-simple.jar")
    with ZooKeeperServer(zookeeper_home=tmp_path) as zk:
        cmdline = Path(f"/proc/{zk.pid}/cmdline").read_bytes().split(b"\0")
        classpath = cmdline[cmdline.index(b"-cp") + 1].decode().split(os.pathsep)
        assert classpath == [
            str(tmp_path / "lib" / "slf4j-simple.jar"),
            str(tmp_path / "zookeeper-3.8.0.jar"),
        ]
        assert "Mode: standalone" in (four_letter.ask("127.0.0.1", zk.port, "srvr") or "")


# -------------------------------------------------------------------------------------- redis


def test_redis_starts_answers_and_stops() -> None:
    server = RedisServer().start()
    pid, directory = server.pid, server.directory
    assert directory is not None and directory.is_dir()
    assert pid is not None and listener_is_owned_by(pid, server.port)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(server.url)
    try:
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        client.close()
    server.stop()
    assert process_gone(pid)
    assert not directory.exists()
    assert server.pid is None


# ------------------------------------------------------------------------------------ fixtures


def test_plugin_fixtures_connect(
    zk_client: KazooClient, lock_root: str, zk_hosts: str, redis_url: str
) -> None:
    assert lock_root.startswith("/zklock-test/test_plugin_fixtures_connect-")
    assert zk_client.exists(lock_root) is None
    zk_client.create(f"{lock_root}/a/b", b"x", makepath=True)
    assert zk_client.get_children(lock_root) == ["a"]
    assert zk_client.connected
    assert zk_hosts
    assert redis.Redis.from_url(redis_url).ping()


INNER_TEST = textwrap.dedent(
    """
    import json, os, threading
    from pathlib import Path

    def test_record(zk_server, zk_client, lock_root, redis_server, zk_stack_factory, request):
        extra = zk_stack_factory.server()
        zk_client.create(lock_root + "/n", makepath=True)
        record = {
            "pids": [zk_server.pid, redis_server.pid, extra.pid],
            "dirs": [
                str(zk_server.node.directory),
                str(extra.node.directory),
                str(redis_server.directory),
            ],
            "lock_root": lock_root,
            "hosts": zk_server.hosts,
        }
        if os.environ.get("INNER_WITH_ENSEMBLE"):
            ensemble = request.getfixturevalue("zk_ensemble")
            record["pids"] += [node.pid for node in ensemble.nodes]
            record["dirs"] += [str(node.directory) for node in ensemble.nodes]
        Path(os.environ["INNER_RECORD"]).write_text(json.dumps(record))
        if os.environ.get("INNER_BLOCK"):
            threading.Event().wait(60)  # until the outer test kills us
    """
)


def run_inner_pytest(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a separate pytest session that uses the plugin's fixtures; return it and its record."""
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    record = tmp_path / "record.json"
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "INNER_RECORD": str(record),
        **env,
    }
    full_env.pop("ZKLOCK_TEST_ZK_HOSTS", None)
    full_env.pop("ZKLOCK_TEST_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "celery_zklock.testing.plugin",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, record


def assert_all_gone(record: dict[str, object]) -> None:
    pids = record["pids"]
    dirs = record["dirs"]
    assert isinstance(pids, list) and isinstance(dirs, list)
    assert all(isinstance(pid, int) for pid in pids)
    wait_for(lambda: all(process_gone(pid) for pid in pids), 10, f"pids {pids} to exit")
    wait_for(lambda: not any(Path(d).exists() for d in dirs), 10, f"{dirs} to be removed")


def test_fixtures_stop_everything_they_started(tmp_path: Path) -> None:
    proc, record_path = run_inner_pytest(tmp_path, INNER_WITH_ENSEMBLE="1")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output.decode()
    record = json.loads(record_path.read_text())
    assert len(record["pids"]) == 6
    assert_all_gone(record)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_child_outlives_a_killed_pytest(tmp_path: Path, sig: signal.Signals) -> None:
    proc, record_path = run_inner_pytest(tmp_path, INNER_BLOCK="1")
    try:
        wait_for(record_path.exists, 60, "the inner test to start its servers")
        wait_for(lambda: bool(record_path.read_text()), 5, "the record to be written")
        record = json.loads(record_path.read_text())
        assert all(not process_gone(pid) for pid in record["pids"])
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == -sig
    # SIGKILL: the kernel kills the children (PDEATHSIG); SIGTERM: our handler kills them and
    # removes their directories too.
    if sig == signal.SIGKILL:
        wait_for(lambda: all(process_gone(pid) for pid in record["pids"]), 10, "children to exit")
        for directory in record["dirs"]:  # nobody could remove them: the parent died at once
            shutil.rmtree(directory, ignore_errors=True)
    else:
        assert_all_gone(record)


def test_atexit_stops_servers_nobody_stopped(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, sys
        from celery_zklock.testing import RedisServer
        server = RedisServer().start()
        print(json.dumps({"pid": server.pid, "dir": str(server.directory)}), flush=True)
        # exits without server.stop(): the atexit hook must do it
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    record = json.loads(done.stdout)
    assert process_gone(record["pid"])  # stopped and reaped before the interpreter exited
    assert not Path(record["dir"]).exists()


def test_lock_root_cleanup_deletes_a_wide_deep_tree_and_refuses_a_missing_root(
    zk_client: KazooClient, lock_root: str
) -> None:
    """The lock_root fixture's cleanup (plugin._delete_tree): every level, many nodes each."""
    from kazoo.exceptions import NoNodeError

    from celery_zklock.testing.plugin import _delete_tree

    for i in range(40):
        zk_client.create(f"{lock_root}/k{i}/c/_c_lock-{i:010d}", b"x", makepath=True)
        zk_client.create(f"{lock_root}/k{i}/d", b"")
    _delete_tree(zk_client, lock_root)
    assert zk_client.exists(lock_root) is None
    with pytest.raises(NoNodeError):
        _delete_tree(zk_client, lock_root)
