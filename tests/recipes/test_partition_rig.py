"""The partition rig of the lease-safety tests: TcpProxy's black hole, and cutting one
ZooKeeper member off from the others (ZooKeeperEnsemble.isolate) on real ZooKeeper."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.retry import KazooRetry

from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import wait_until
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.testing.zookeeper import (
    _CHAIN_PREFIX,
    ZooKeeperEnsemble,
    _pid_namespace_tag,
    partition_unavailable_reason,
)
from celery_zklock.zk import four_letter as four_letter_client
from tests.lockutil import four_letter, wait_for

# ------------------------------------------------------------------------------ black hole


@pytest.fixture
def target() -> Iterator[socket.socket]:
    """A listening socket standing for the server behind the proxy."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    yield listener
    listener.close()


def _pair(proxy: TcpProxy, target: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A client connected through ``proxy`` and the server side of its connection."""
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    server, _ = target.accept()
    server.settimeout(5)
    return client, server


def _nothing_to_read(sock: socket.socket) -> bool:
    """True if ``sock`` is open and has nothing to read (no data, no EOF, no reset)."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(5)
    return False


def test_blackhole_drops_both_ways_and_keeps_sockets_open(target: socket.socket) -> None:
    port = target.getsockname()[1]
    with TcpProxy("127.0.0.1", port) as proxy:
        client, server = _pair(proxy, target)
        client.sendall(b"ping")
        assert server.recv(16) == b"ping"
        server.sendall(b"pong")
        assert client.recv(16) == b"pong"

        proxy.blackhole = True
        assert proxy.blackhole
        client.sendall(b"x" * 100)
        server.sendall(b"y" * 100)
        wait_for(lambda: proxy.bytes_dropped >= 200, 5, "the proxy to drop 200 bytes")
        assert _nothing_to_read(server) and _nothing_to_read(client)

        # A new connection during the black hole: accepted, silent both ways.
        late_client, late_server = _pair(proxy, target)
        late_client.sendall(b"z")
        late_server.sendall(b"w")
        wait_for(lambda: proxy.bytes_dropped >= 202, 5, "the proxy to drop the late bytes")
        assert _nothing_to_read(late_server) and _nothing_to_read(late_client)

        # A side that closes is not announced to the other one while silent.
        late_client.close()
        wait_for(lambda: proxy.orphaned_connections == 1, 5, "the proxy to see the close")
        assert _nothing_to_read(late_server)
        assert _nothing_to_read(server) and _nothing_to_read(client)

        proxy.blackhole = False
        assert late_server.recv(16) == b""  # the held-open side is closed on heal
        assert proxy.orphaned_connections == 0
        # Forwarding resumes on the surviving connection; what was dropped stays dropped.
        client.sendall(b"after")
        assert server.recv(16) == b"after"
        server.sendall(b"back")
        assert client.recv(16) == b"back"
        for sock in (client, server, late_server):
            sock.close()


def test_blackhole_silences_a_zookeeper_client(zk_hosts: str, zk_client: KazooClient) -> None:
    """A kazoo client behind the black hole: its session expires on the server while its
    socket stays open (the client only sees silence)."""
    host, port = zk_hosts.split(",")[0].rsplit(":", 1)
    with TcpProxy(host, int(port)) as proxy:
        client = KazooClient(proxy.address, timeout=4.0)
        client.start(timeout=15)
        try:
            path = client.create("/rig-blackhole-", ephemeral=True, sequence=True)
            assert zk_client.exists(path) is not None
            proxy.blackhole = True
            wait_for(lambda: zk_client.exists(path) is None, 15, "the server to expire it")
            assert proxy.open_connections() >= 1
        finally:
            proxy.stop()
            client.stop()
            client.close()


# ------------------------------------------------------------------------------- isolation

needs_partition = pytest.mark.skipif(
    partition_unavailable_reason() is not None,
    reason=f"cannot cut a ZooKeeper member off here: {partition_unavailable_reason()}",
)


def _chains() -> set[str]:
    listing = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True)
    return set(re.findall(rf"^-N ({_CHAIN_PREFIX}\S+)$", listing.stdout, re.MULTILINE))


def _output_jumps(chain: str) -> int:
    listing = subprocess.run(
        ["iptables", "-S", "OUTPUT"], capture_output=True, text=True, check=True
    )
    return sum(line.endswith(f"-j {chain}") for line in listing.stdout.splitlines())


def _rules(chain: str) -> list[str]:
    listing = subprocess.run(["iptables", "-S", chain], capture_output=True, text=True, check=True)
    return [line for line in listing.stdout.splitlines() if line.startswith("-A ")]


def _mntr(port: int) -> dict[str, str]:
    return four_letter_client.parse("mntr", four_letter(f"127.0.0.1:{port}", "mntr"))


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def test_isolatable_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="isolatable myids"):
        ZooKeeperEnsemble(3, isolatable=(4,))
    ensemble = ZooKeeperEnsemble(3, isolatable=(2,))
    assert ensemble.isolatable == {2}
    assert ZooKeeperEnsemble(3, isolatable=True).isolatable == {1, 2, 3}
    with pytest.raises(ValueError, match="not isolatable"):
        ensemble.isolate(1)
    ensemble.heal(2)  # not started: nothing to heal


@needs_partition
@pytest.mark.slow
@pytest.mark.ensemble
def test_isolate_cuts_a_follower_off_and_heal_restores_it(
    zk_stack_factory: StackFactory,
) -> None:
    tick, sync = 0.5, 4  # the follower's own deadline: 2 s without its leader
    window = tick * sync
    ensemble = zk_stack_factory.ensemble(
        3, tick_time_ms=int(tick * 1000), sync_limit_ticks=sync, isolatable=True
    )
    chain = ensemble.firewall_chain
    assert chain is not None and chain in _chains() and _output_jumps(chain) == 1
    uids = {node.myid: _uid_of(node.pid or 0) for node in ensemble.nodes}
    assert len(set(uids.values())) == 3 and 0 not in uids.values()

    leader = ensemble.leader()
    follower = next(node for node in ensemble.nodes if node.myid != leader)
    leader_port = ensemble.node(leader).port
    wait_for(lambda: _mntr(leader_port).get("zk_synced_followers") == "2", 10, "2 followers")

    # Reconnect attempts at most 1 s apart: kazoo's default backoff grows to a minute over the
    # long cut, and the client would then miss the reconnect wait after the heal.
    retry = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=1.0)
    client = KazooClient(f"127.0.0.1:{follower.port}", timeout=10.0, connection_retry=retry)
    states: list[tuple[float, str]] = []
    client.add_listener(lambda state: states.append((time.monotonic(), state)))
    client.start(timeout=15)
    writer = KazooClient(f"127.0.0.1:{leader_port}", timeout=10.0)
    writer.start(timeout=15)
    try:
        client.ensure_path("/rig")
        rules_before = len(_rules(chain))
        cut_at = time.monotonic()
        ensemble.isolate(follower.myid)
        ensemble.isolate(follower.myid)  # idempotent
        assert ensemble.isolated == {follower.myid}
        # Two rules per peer port of each other member, one per peer port of the follower.
        assert len(_rules(chain)) == rules_before + 2 * 2 + 2

        # The follower keeps answering its client until its own sync limit passes.
        last_answer = cut_at
        while follower.mode() == "follower" and time.monotonic() < cut_at + window + 10:
            try:
                client.exists_async("/rig").get(timeout=0.5)
                last_answer = time.monotonic()
            except Exception:
                pass
            time.sleep(0.05)
        stopped_at = time.monotonic()
        assert follower.mode() != "follower", "the isolated follower kept serving"
        assert last_answer - cut_at >= 0.6 * window, (
            f"the follower stopped answering after {last_answer - cut_at:.2f} s, "
            f"before its sync limit ({window} s)"
        )
        assert stopped_at - cut_at <= window + 3 * tick + 1.0
        # ... then drops its clients,
        wait_for(lambda: client.state != KazooState.CONNECTED, 5, "the client to be dropped")
        # ... and the leader no longer counts it, while the other two keep a quorum.
        wait_for(
            lambda: _mntr(leader_port).get("zk_synced_followers") == "1",
            window + 5,
            "the leader to lose the follower",
        )
        assert ensemble.node(leader).mode() == "leader"
        writer.create("/rig/written-while-cut", b"1")
        # While cut off, the follower cannot rejoin (its election traffic is dropped).
        assert not wait_until(lambda: follower.mode() is not None, 3 * window)

        ensemble.heal(follower.myid)
        ensemble.heal(follower.myid)  # idempotent
        assert ensemble.isolated == set() and len(_rules(chain)) == rules_before
        wait_for(lambda: follower.mode() == "follower", 30, "the follower to rejoin")
        wait_for(lambda: _mntr(leader_port).get("zk_synced_followers") == "2", 10, "2 again")
        wait_for(lambda: client.state == KazooState.CONNECTED, 30, "the client to reconnect")
        assert client.exists("/rig/written-while-cut") is not None
        assert (KazooState.SUSPENDED) in {state for _, state in states}
    finally:
        for kazoo in (client, writer):
            kazoo.stop()
            kazoo.close()


@needs_partition
@pytest.mark.slow
@pytest.mark.ensemble
def test_isolating_a_member_leaves_a_parallel_ensembles_members_alone(
    zk_stack_factory: StackFactory,
) -> None:
    """Two suites side by side each cut members off: member k of one ensemble is isolated,
    and member k of another stays in its quorum (both mark their connections with k's bit;
    the drop rules once matched the bit alone, so one run's cut cut the other's member k)."""
    tick, sync = 1.0, 5  # as the lease-safety ensemble; slack for a loaded machine
    window = tick * sync
    cutting, bystander = (
        zk_stack_factory.ensemble(
            3, tick_time_ms=int(tick * 1000), sync_limit_ticks=sync, isolatable=True
        )
        for _ in range(2)
    )
    # A member that follows in both: neither ensemble holds an election meanwhile.
    leaders = (cutting.leader(), bystander.leader())
    kept = next(node for node in bystander.nodes if node.myid not in leaders)
    leader_port = bystander.node(leaders[1]).port
    cutting_leader_port = cutting.node(leaders[0]).port
    for port in (leader_port, cutting_leader_port):
        wait_for(lambda p=port: _mntr(p).get("zk_synced_followers") == "2", 10, "2 followers")

    cut_member = cutting.node(kept.myid)
    cutting.isolate(kept.myid)
    try:
        # The cut member leaves its own quorum after its sync limit ...
        wait_for(lambda: cut_member.mode() != "follower",
                 window + 10, "the isolated member to leave its quorum")  # fmt: skip
        wait_for(
            lambda: _mntr(cutting_leader_port).get("zk_synced_followers") == "1",
            window + 10,
            "the cutting ensemble's leader to count one follower",
        )
        # ... and the bystander's member with the same myid, given as long again, stays.
        left = wait_until(
            lambda: (
                kept.mode() != "follower" or _mntr(leader_port).get("zk_synced_followers") != "2"
            ),
            window + 4 * tick,
        )
        assert not left, (
            f"isolating member {kept.myid} of one ensemble cut off member {kept.myid} of another "
            f"(its mode: {kept.mode()}, synced followers of its leader: "
            f"{_mntr(leader_port).get('zk_synced_followers')})"
        )
    finally:
        cutting.heal(kept.myid)


@needs_partition
@pytest.mark.ensemble
def test_rules_are_gone_after_stop_even_when_the_block_fails() -> None:
    ensemble = ZooKeeperEnsemble(3, isolatable=(1, 2))
    chain: str | None = None
    with pytest.raises(RuntimeError, match="test failed"), ensemble:
        chain = ensemble.firewall_chain
        assert chain is not None and chain in _chains()
        ensemble.isolate(2)
        raise RuntimeError("test failed")
    assert chain is not None
    assert chain not in _chains() and _output_jumps(chain) == 0
    assert ensemble.firewall_chain is None and ensemble.isolated == set()
    ensemble.stop()  # idempotent


@needs_partition
@pytest.mark.ensemble
def test_chain_of_a_dead_process_is_reaped(zk_stack_factory: StackFactory) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not os.path.exists(f"/proc/{dead.pid}")
    stale = f"{_CHAIN_PREFIX}{_pid_namespace_tag()}-{dead.pid:x}-dead01"
    subprocess.run(["iptables", "-N", stale], check=True)
    subprocess.run(["iptables", "-I", "OUTPUT", "1", "-j", stale], check=True)
    try:
        ensemble = zk_stack_factory.ensemble(3, isolatable=(3,))
        assert stale not in _chains() and _output_jumps(stale) == 0
        assert ensemble.firewall_chain in _chains()
    finally:
        subprocess.run(["iptables", "-D", "OUTPUT", "-j", stale], check=False)
        subprocess.run(["iptables", "-X", stale], check=False, capture_output=True)


def test_partition_is_available_here_as_root() -> None:
    """On a machine set up by .ci/system-deps and run as root, partitions must work."""
    if os.geteuid() != 0:
        pytest.skip("not root")
    assert partition_unavailable_reason() is None
