"""Secured ensembles at the task level, in real `celery worker` processes on a real ZooKeeper:
lock nodes only their creator may change (``zklock_acl="creator"``), a worker that refuses to
start without the credentials that needs, and the application's own client
(``zklock_client_factory``)."""

from __future__ import annotations

import posixpath
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import Permissions

from celery_zklock import LockLost
from celery_zklock.testing import ZooKeeperServer
from tests.lockutil import expire_session_id
from tests.taskapp import read_records
from tests.workerproc import ROOT, held_session, workers

ALICE = "alice:alice-secret"
BOB = "bob:bob-secret"


@pytest.fixture
def bob(zk_hosts: str) -> Iterator[KazooClient]:
    client = KazooClient(hosts=zk_hosts, auth_data=[("digest", BOB)])
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def test_creator_acl_keeps_other_identities_off_a_holders_node(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient, bob: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    env = {**env, "ZKLOCK_ACL": "creator", "ZKLOCK_AUTH": f"digest:{ALICE}"}
    key = f"acl-{uuid.uuid4().hex[:8]}"
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        holder = long_hold.apply_async((key, 6.0), queue=worker.queue)
        node = held_session(tmp, holder.id)["node"]
        # Anyone may read who holds what (zk_client is not authenticated at all).
        data, _ = zk_client.get(node)
        acls, _ = zk_client.get_acls(node)
        assert {(a.id.scheme, a.perms) for a in acls} == {("digest", Permissions.ALL), ("world", 1)}
        assert acls[0].id.id.startswith("alice:") or acls[1].id.id.startswith("alice:")
        # Neither another identity nor an unauthenticated client may take it away.
        for other in (bob, zk_client):
            with pytest.raises(NoAuthError):
                other.delete(node)
            with pytest.raises(NoAuthError):
                other.set(node, b"mine now")
            with pytest.raises(NoAuthError):  # nor queue on the lock's parent
                other.create(posixpath.join(posixpath.dirname(node), "intruder"))
        assert zk_client.get(node)[0] == data  # the holder keeps its lock, untouched
        assert holder.get(timeout=30) == "finished"  # locked and released normally
        assert zk_client.exists(node) is None
        # The next run of the key locks again (the parent's ACL admits its creator's identity).
        again = long_hold.apply_async((key, 0.1), queue=worker.queue)
        assert again.get(timeout=30) == "finished"


def test_a_worker_refuses_to_start_with_creator_acl_and_no_credentials(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    _, env, _ = taskenv
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.taskapp", "worker", "--pool", "solo",
         "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "warning"],
        cwd=ROOT, env={**env, "ZKLOCK_ACL": "creator", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "celery-zklock: zklock_acl='creator' needs credentials" in done.stderr


def test_the_client_factory_builds_each_process_client_and_loss_still_revokes(
    taskenv: tuple[Celery, dict[str, str], Path], zk_hosts: str
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    env = {**env, "ZKLOCK_CLIENT_FACTORY": "tests.taskapp:zk_factory"}
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        victim = long_hold.apply_async(("fk-a", 60.0), queue=worker.queue)
        victim_record = held_session(tmp, victim.id)
        # While the victim holds a pool process, two more runs go to the other one.
        others = [long_hold.apply_async((f"fk-{i}", 0.1), queue=worker.queue) for i in "bc"]
        assert [r.get(timeout=30) for r in others] == ["finished", "finished"]
        records = [victim_record, *(held_session(tmp, r.id) for r in others)]
        assert all(record["factory"] for record in records), "a lock used another client"
        calls = [call["pid"] for call in read_records(tmp / "factory-calls")]
        # One client per process, built in that process (after the fork): each pool
        # process's, and the main process's own for its gate (celery_zklock.worker.gate).
        assert sorted(calls) == sorted({record["pid"] for record in records} | {worker.pid})
        # The lease clock still watches the factory's client: its session's loss revokes.
        expire_session_id(
            zk_hosts, victim_record["session_id"], bytes.fromhex(victim_record["password"])
        )
        with pytest.raises(LockLost, match="lost"):
            victim.get(timeout=30, propagate=True)


def test_tasks_run_over_verified_tls_with_sasl_on_a_tls_only_server(
    taskenv: tuple[Celery, dict[str, str], Path], zk_tls_only_server: ZooKeeperServer
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import exclusive_section

    server = zk_tls_only_server
    env = {
        **env,
        "ZKLOCK_HOSTS": server.tls_hosts,
        "ZKLOCK_USE_SSL": "true",
        "ZKLOCK_SSL_CA": server.ca_file,  # hostnames checked too: the default with a CA
        "ZKLOCK_SASL_MECHANISM": "DIGEST-MD5",
        "ZKLOCK_SASL_USERNAME": "alice",
        "ZKLOCK_SASL_PASSWORD": server.sasl_users["alice"],
        "ZKLOCK_ACL": "creator",
    }
    with workers(app, "threads", 1, env, tmp) as (worker,):
        results = [
            exclusive_section.apply_async((f"tls-{i % 2}", 0.05), queue=worker.queue)
            for i in range(6)
        ]
        values = [r.get(timeout=60) for r in results]
    assert all(r.state == "SUCCESS" for r in results)
    ran = [v for v in values if "token" in v]
    assert len(ran) >= 2 and len({v["token"] for v in ran}) == len(ran)
