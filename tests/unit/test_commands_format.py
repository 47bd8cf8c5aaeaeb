"""The pure parts of `celery zklock`: who holds from the node names, the table and JSON of
`locks`, and doctor's verdicts. No server (node identities: tests/unit/test_identity.py)."""

from __future__ import annotations

import json

import pytest
from kazoo.protocol.states import ZnodeStat
from kazoo.security import ACL, Id

from celery_zklock.locks.contenders import Contender, parse_child, read_contender
from celery_zklock.locks.holders import LockState, breakable, lock_state
from celery_zklock.ops.commands import checks
from celery_zklock.ops.commands.render import (
    duration,
    locks_document,
    locks_table,
    name_and_key,
    table,
)
from celery_zklock.ops.holders import KeyState
from celery_zklock.task.latest import Record
from celery_zklock.zk.settings import CREATOR_ACL, ClientConfig

NOW = 1_700_000_100.0
IDENTITY = {"task_id": "t-1", "task": "app.sync", "retries": 2, "worker": "w1@h", "pid": 4242}


def stat(czxid: int, created: float, owner: int = 0x1000) -> ZnodeStat:
    return ZnodeStat(
        czxid, czxid, int(created * 1000), int(created * 1000), 0, 0, 0, owner, 0, 0, 0
    )


def node(name: str, token: int, data: object = None, created: float = NOW - 10) -> Contender:
    raw = b"" if data is None else data if isinstance(data, bytes) else json.dumps(data).encode()
    contender = parse_child(name)
    assert contender is not None
    return read_contender(contender, raw, stat(token, created))


def uuid(n: int) -> str:
    return f"_c_{n:08x}-0000-4000-8000-000000000000-"


# -- who holds, from the node names ------------------------------------------------------------


def test_exclusive_queue_holder_is_the_lowest_sequence_not_the_lowest_name() -> None:
    state = lock_state(
        "/r/sync/k",
        [
            node(f"{uuid(1)}__WRIT__0000000012", 212, {"task_id": "late"}),
            node(f"{uuid(9)}__WRIT__0000000003", 203, {"task_id": "first"}, created=NOW - 30),
            node(f"{uuid(5)}lock-0000000007", 207, {"task_id": "second"}),
        ],
    )
    assert [e.identity.task_id for e in state.holders] == ["first"]
    assert [e.identity.task_id for e in state.waiters] == ["second", "late"]
    assert state.mode == "exclusive"
    (holder,) = state.holder_records(NOW)
    assert holder.task_id == "first" and holder.token == 203
    assert holder.held_for == pytest.approx(30.0)
    assert holder.node == f"/r/sync/k/{uuid(9)}__WRIT__0000000003"


def test_shared_queue_readers_ahead_of_the_first_writer_hold_together() -> None:
    state = lock_state(
        "/r/report/k",
        [
            node(f"{uuid(1)}__READ__0000000001", 101),
            node(f"{uuid(2)}__READ__0000000002", 102),
            node(f"{uuid(3)}__WRIT__0000000003", 103),
            node(f"{uuid(4)}__READ__0000000004", 104),
            node("5f3a__rlock__0000000005", 105),  # kazoo's ReadLock: respected too
        ],
    )
    assert [e.seq for e in state.holders] == [1, 2]
    assert [(e.seq, e.mode) for e in state.waiters] == [
        (3, "exclusive"), (4, "shared"), (5, "shared"),
    ]  # fmt: skip
    assert state.mode == "shared"


def test_a_semaphore_is_told_by_the_limit_in_the_lock_node_first_n_hold() -> None:
    nodes = [node(f"{uuid(n)}lock-{n:010d}", 300 + n) for n in (4, 1, 3, 2)]
    state = lock_state("/r/limited/k", nodes, b"max_leases=2")
    assert state.limit == 2 and state.mode == "semaphore"
    assert [e.seq for e in state.holders] == [1, 2] and [e.seq for e in state.waiters] == [3, 4]
    assert {e.mode for e in state.entries} == {"semaphore"}
    assert "semaphore/2" in locks_table([state], NOW)
    assert locks_document("/r", [state], NOW)["locks"][0]["limit"] == 2
    # The same nodes under a node without a limit are a mutex's.
    assert [e.seq for e in lock_state("/r/limited/k", nodes, b"").holders] == [1]


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        (f"{uuid(1)}__WRIT__0000000001", IDENTITY, True),  # a task run
        (f"{uuid(1)}lock-0000000001", None, True),  # a celery_zklock recipe lease without data
        (f"{uuid(1)}lock-0000000001", b"10.0.0.7", False),  # Curator: its IP
        ("9f3c__lock__0000000001", None, False),  # kazoo's Lock: never watches its data
    ],
)
def test_which_holders_can_hear_a_break_request(name: str, data: object, expected: bool) -> None:
    (entry,) = lock_state("/r/x/k", [node(name, 1, data)]).entries
    assert breakable(entry.name, entry.identity) is expected
    document = locks_document("/r", [lock_state("/r/x/k", [node(name, 1, data)])], NOW)
    assert document["locks"][0]["holders"][0]["celery_zklock"] is expected


def test_an_empty_lock_has_no_mode_and_no_holder() -> None:
    state = lock_state("/r/x/k", [])
    assert state.mode is None and state.holder_records(NOW) == ()


# -- the table and the JSON --------------------------------------------------------------------


def two_locks() -> list[LockState]:
    broken = {**IDENTITY, "broken": {"by": "alice@ops", "at": NOW - 1}}
    return [
        lock_state(
            "/zklock/sync/account_id=1~aa",
            [
                node(f"{uuid(1)}__WRIT__0000000001", 11, IDENTITY, created=NOW - 65),
                node(f"{uuid(2)}__WRIT__0000000002", 12, {**IDENTITY, "task_id": "t-2"}),
            ],
        ),
        lock_state(
            "/zklock/report/id=7~bb",
            [
                node(f"{uuid(3)}__READ__0000000004", 21, broken, created=NOW - 2),
                node(f"{uuid(4)}__READ__0000000005", 22, b"10.1.2.3", created=NOW - 1),
            ],
        ),
    ]


def test_table_one_row_per_node_path_on_the_first_row_of_each_lock() -> None:
    lines = locks_table(two_locks(), NOW).splitlines()
    header, rows = lines[0].split(), lines[1:]
    assert header[:3] == ["LOCK", "MODE", "ROLE"] and header[-1] == "NOTE"
    assert len(rows) == 4
    assert rows[0].startswith("/zklock/sync/account_id=1~aa")
    assert rows[1].startswith(" ") and "waiter 1" in rows[1] and "t-2" in rows[1]
    assert "holder" in rows[0] and "1m05s" in rows[0] and "w1@h" in rows[0] and "4242" in rows[0]
    assert rows[2].startswith("/zklock/report/id=7~bb") and "shared" in rows[2]
    assert rows[2].endswith("break requested by alice@ops")
    assert rows[3].endswith("not celery-zklock") and "holder" in rows[3]
    # Columns line up: every row's MODE starts where the header's does.
    column = lines[0].index("MODE")
    assert all(row[column:].split()[0] in ("exclusive", "shared") for row in rows)


def test_table_without_notes_has_no_note_column() -> None:
    header = locks_table(two_locks()[:1], NOW).splitlines()[0]
    assert "NOTE" not in header
    assert locks_table([], NOW) == "no locks held"


def test_table_cuts_trailing_blanks() -> None:
    assert table([["A", "B"], ["long cell", ""]]) == "A          B\nlong cell"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0.0s"), (12.34, "12.3s"), (65, "1m05s"), (7380, "2h03m"), (273_600, "3d04h")],
)
def test_durations(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_json_document_is_stable() -> None:
    document = locks_document("/zklock", two_locks(), NOW)
    assert json.loads(json.dumps(document)) == document
    assert set(document) == {"schema", "root", "time", "locks"} and document["schema"] == 1
    sync, report = document["locks"]
    assert set(sync) == {
        "path", "name", "key", "mode", "limit", "admissions", "debounce", "waiting_call",
        "holders", "waiters",
    }  # fmt: skip
    assert sync["limit"] is None and sync["debounce"] is None and sync["waiting_call"] is None
    assert (sync["name"], sync["key"], sync["mode"]) == ("sync", "account_id=1~aa", "exclusive")
    (holder,) = sync["holders"]
    assert set(holder) == {
        "node", "seq", "mode", "task_id", "task", "worker", "pid", "retries", "token",
        "session", "created", "held_for", "broken", "celery_zklock",
    }  # fmt: skip
    assert holder["held_for"] == 65.0 and holder["token"] == 11 and holder["session"] == "0x1000"
    assert holder["node"] == f"/zklock/sync/account_id=1~aa/{uuid(1)}__WRIT__0000000001"
    (waiter,) = sync["waiters"]
    assert waiter["position"] == 1 and waiter["waiting_for"] == 10.0 and "held_for" not in waiter
    assert [h["celery_zklock"] for h in report["holders"]] == [True, False]
    assert report["holders"][0]["broken"]["by"] == "alice@ops"
    assert report["holders"][1]["task_id"] is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/zklock/sync/k~1", ("sync", "k~1")),
        ("/other/sync/k", (None, None)),
        ("/zklock/sync", (None, None)),
        ("/zklock/a/b/c", (None, None)),
    ],
)
def test_name_and_key(path: str, expected: tuple[str | None, str | None]) -> None:
    assert name_and_key("/zklock", path) == expected


# -- doctor's verdicts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "negotiated", "status"),
    [(10, 10, "PASS"), (10, 4, "FAIL"), (4, 6, "WARN"), (0.5, 0.5, "FAIL"), (10, None, "WARN")],
)
def test_session_timeout_verdicts(requested: float, negotiated: float | None, status: str) -> None:
    check = checks.session_timeout_check(requested, negotiated)
    assert check.status == status
    if status == "FAIL" and requested > 1:
        assert "capped it at 4s" in check.detail and "maxSessionTimeout" in check.detail


SRVR = """Zookeeper version: 3.8.4-9316c2a7a97e1666d8f4593f34dd6fc36ecc436c, built on 2024
Latency min/avg/max: 0/0.1/3
Mode: follower
Node count: 12
"""
CONF = """clientPort=2181
tickTime={tick}
minSessionTimeout=4000
maxSessionTimeout=40000
initLimit=10
syncLimit={sync}
"""
REFUSED = "conf is not executed because it is not in the whitelist.\n"


def test_server_check_reads_version_and_mode() -> None:
    check = checks.server_check("zk1:2181", SRVR)
    assert (check.status, check.detail) == ("PASS", "ZooKeeper 3.8.4, mode follower")
    assert checks.server_check("zk1:2181", REFUSED.replace("conf", "srvr")).status == "WARN"
    assert checks.server_check("zk1:2181", None).status == "WARN"


def test_lease_safety_needs_the_session_timeout_at_two_ticks() -> None:
    safe = checks.lease_safety_checks("zk1", 4.0, CONF.format(tick=2000, sync=5))
    assert [c.status for c in safe] == ["PASS", "INFO"]
    assert "longer than the session timeout 4s" in safe[1].detail  # 5 x 2 s = 10 s
    unsafe = checks.lease_safety_checks("zk1", 4.0, CONF.format(tick=3000, sync=1))
    assert unsafe[0].status == "FAIL" and "zklock_session_timeout >= 6" in unsafe[0].detail
    assert "within the session timeout" in unsafe[1].detail  # 1 x 3 s = 3 s
    assert [c.status for c in checks.lease_safety_checks("zk1", 4.0, REFUSED)] == ["WARN"]
    assert [c.status for c in checks.lease_safety_checks("zk1", 4.0, None)] == ["WARN"]
    standalone = checks.lease_safety_checks("zk1", 4.0, "tickTime=200\n")
    assert [c.status for c in standalone] == ["PASS", "INFO"] and "standalone" in standalone[
        1
    ].detail


def test_connection_limit_is_set_against_one_workers_sessions() -> None:
    """ZooKeeper refuses connections past maxClientCnxns per client address (60 by default);
    a prefork worker of concurrency N opens N + 1 sessions."""
    conf = CONF.format(tick=2000, sync=5) + "maxClientCnxns={limit}\n"
    fits = checks.connection_limit_check("zk1", conf.format(limit=60), 9)
    assert fits is not None and fits.status == "PASS" and "6 such workers fit" in fits.detail
    tight = checks.connection_limit_check("zk1", conf.format(limit=60), 33)
    assert tight is not None and tight.status == "WARN"
    over = checks.connection_limit_check("zk1", conf.format(limit=60), 65)
    assert over is not None and over.status == "FAIL" and "raise maxClientCnxns" in over.detail
    unlimited = checks.connection_limit_check("zk1", conf.format(limit=0), 65)
    assert unlimited is not None and unlimited.status == "PASS"
    assert checks.connection_limit_check("zk1", REFUSED, 9) is None
    assert checks.connection_limit_check("zk1", CONF.format(tick=2000, sync=5), 9) is None


def test_acl_report_names_identities_without_secrets() -> None:
    config = ClientConfig(
        hosts="zk:2181",
        auth=(("digest", "alice:s3cret"),),
        sasl=(("mechanism", "DIGEST-MD5"), ("password", "pw"), ("username", "bob")),
        acl=CREATOR_ACL,
    )
    check = checks.acl_check(
        config, [ACL(31, Id("digest", "alice:hash")), ACL(1, Id("world", "anyone"))]
    )
    assert check.status == "PASS"
    assert "zklock_acl=creator" in check.detail
    assert "digest:alice:hash=ALL, world:anyone=READ" in check.detail
    assert "digest:alice" in check.detail and "sasl DIGEST-MD5 as bob" in check.detail
    assert "s3cret" not in check.detail and "pw" not in check.detail
    assert "open" in checks.acl_check(ClientConfig(hosts="zk:2181"), []).detail


def test_report_fails_on_any_fail() -> None:
    found = [checks.Check("PASS", "a", "x"), checks.Check("WARN", "b", "y")]
    assert not checks.failed(found) and checks.report(found).endswith("ok (0 FAIL, 1 WARN)")
    found.append(checks.Check("FAIL", "c", "z"))
    assert checks.failed(found) and "FAIL  c: z" in checks.report(found)


def keyed(state: LockState, window: Record | None, waiting: Record | None) -> KeyState:
    return KeyState(**vars(state), debounce=window, waiting=waiting)


def test_a_keys_debounce_window_and_queued_call_are_shown() -> None:
    """``locks`` with a key's records (tests/task/test_debounce.py and test_replace.py read
    them from ZooKeeper): the debounce window's latest call and when the window ends, and the
    ``replace`` key's waiting call, in the table and in the JSON document."""
    ms = int(NOW * 1000)
    window = Record("t-9", 9, at=ms - 400, first=ms - 1500, mtime=ms - 400, version=3,
                    quiet=1.0, cap=30.0)  # fmt: skip
    waiting = Record("t-5", 5, at=ms - 2000, first=ms - 2000, mtime=ms - 2000, version=1)
    sync, idle = two_locks()[0], lock_state("/zklock/refresh/view=v~cc", [])
    states = [keyed(sync, None, waiting), keyed(idle, window, None)]
    rows = locks_table(states, NOW).splitlines()[1:]
    assert len(rows) == 4
    assert rows[2].split()[:4] == ["replace", "queued", "call", "2.0s"] and "t-5" in rows[2]
    assert rows[3].startswith("/zklock/refresh/view=v~cc") and "debounce" in rows[3]
    assert "latest call" in rows[3] and "t-9" in rows[3] and "1.5s" in rows[3]
    assert rows[3].endswith("window ends in 0.6s")
    document = locks_document("/zklock", states, NOW)
    first, second = document["locks"]
    assert first["waiting_call"] == {"task_id": "t-5", "since": NOW - 2.0}
    assert second["debounce"] == {
        "task_id": "t-9", "first": NOW - 1.5, "last": NOW - 0.4, "ends": NOW + 0.6,
    }  # fmt: skip
    assert second["holders"] == [] and second["mode"] is None
