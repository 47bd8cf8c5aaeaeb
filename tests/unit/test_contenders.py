"""The lock decision as a pure function: every queue shape up to a size, exhaustively."""

from __future__ import annotations

import itertools

import pytest
from kazoo.protocol.states import ZnodeStat

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.contenders import (
    LOCK_MODES,
    READ,
    WRITE,
    Contender,
    LimitMismatch,
    LockKind,
    decide,
    first_blocker,
    holding,
    limit_agreement,
    limit_data,
    lock_kind,
    parse_child,
    parse_limit,
    protected_prefix,
    queue_of,
    read_contender,
)

UUID = "0f8fad5b-d9cb-469f-a165-70867728950e"


@pytest.mark.parametrize(
    ("name", "kind", "seq"),
    [
        (f"_c_{UUID}-lock-0000000007", "write", 7),
        (f"_c_{UUID}-__WRIT__0000000012", "write", 12),
        (f"_c_{UUID}-__READ__0000000003", "read", 3),
        ("9f3b0c1d2e3f40516273849a5b6c7d8e__lock__0000000004", "write", 4),
        ("9f3b0c1d2e3f40516273849a5b6c7d8e__rlock__0000000005", "read", 5),
        ("something-unknown0000000009", "write", 9),
    ],
)
def test_parse_recognises_curator_kazoo_and_unknown_contenders(
    name: str, kind: str, seq: int
) -> None:
    assert parse_child(name) == Contender(seq, name, kind)  # type: ignore[arg-type]


def test_non_contender_children_are_ignored() -> None:
    assert parse_child("leases") is None
    assert queue_of(["leases", f"_c_{UUID}-lock-0000000001"]) == [
        Contender(1, f"_c_{UUID}-lock-0000000001", "write")
    ]


def test_protected_prefix_has_curator_length() -> None:
    prefix = protected_prefix(UUID)
    assert prefix == f"_c_{UUID}-"
    assert len(prefix) == 3 + 36 + 1


def test_order_is_by_integer_sequence_not_by_name() -> None:
    names = [
        "_c_ffffffff-ffff-ffff-ffff-ffffffffffff-lock-0000000002",
        "_c_00000000-0000-0000-0000-000000000000-lock-0000000010",
        "zzzz__lock__0000000001",
        "_c_aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa-__READ__0000000003",
    ]
    assert [c.seq for c in queue_of(names)] == [1, 2, 3, 10]


def _reference(kinds: tuple[str, ...], ours: int) -> tuple[bool, int | None]:
    """Obviously-correct model: who blocks us, and the nearest such node to watch."""
    blockers = [i for i in range(ours) if kinds[ours] == "write" or kinds[i] == "write"]
    if not blockers:
        return True, None
    # herd-free: exclusive waits on its immediate predecessor, a reader on the nearest writer
    return False, (ours - 1) if kinds[ours] == "write" else blockers[-1]


@pytest.mark.parametrize("size", range(1, 8))
def test_decision_matches_reference_for_every_queue(size: int) -> None:
    for kinds in itertools.product(("read", "write"), repeat=size):
        names = [
            f"_c_{UUID}-{'__READ__' if k == 'read' else '__WRIT__'}{seq:010d}"
            for seq, k in enumerate(kinds)
        ]
        queue = queue_of(reversed(names))
        for ours in range(size):
            decision = decide(queue, names[ours], kinds[ours])  # type: ignore[arg-type]
            holds, watch = _reference(kinds, ours)
            assert decision.holds is holds, (kinds, ours)
            assert decision.watch == (None if watch is None else names[watch]), (kinds, ours)


def test_at_most_one_writer_or_only_readers_hold_at_once() -> None:
    for kinds in itertools.product(("read", "write"), repeat=6):
        names = [
            f"n{k[0]}__{'rlock' if k == 'read' else 'lock'}__{i:010d}" for i, k in enumerate(kinds)
        ]
        queue = queue_of(names)
        holders = [
            kinds[i]
            for i in range(6)
            if decide(queue, names[i], kinds[i]).holds  # type: ignore[arg-type]
        ]
        assert holders, kinds  # somebody always holds: no deadlock
        assert holders == ["write"] or set(holders) == {"read"}, (kinds, holders)


def test_missing_own_node_is_reported() -> None:
    with pytest.raises(LookupError, match="not among the children"):
        decide(queue_of([f"_c_{UUID}-lock-0000000001"]), "gone-lock-0000000000", "write")


# -- the semaphore ("lease") predicate ------------------------------------------------------------


def _lease_reference(ours: int, limit: int) -> tuple[bool, int | None]:
    """Model: fewer than ``limit`` contenders ahead holds; else watch the limit-th nearest one."""
    ahead = list(range(ours))
    if len(ahead) < limit:
        return True, None
    return False, ahead[-limit]


def _mixed_names(kinds: tuple[str, ...]) -> list[str]:
    marker = {"mutex": "lock-", "read": "__READ__", "write": "__WRIT__", "kazoo": "__lock__"}
    return [f"_c_{UUID}-{marker[k]}{seq:010d}" for seq, k in enumerate(kinds)]


@pytest.mark.parametrize("size", range(1, 7))
def test_lease_decision_matches_reference_for_every_queue_and_limit(size: int) -> None:
    """Every queue of every contender kind, every limit up to past its size, every position."""
    for kinds in itertools.product(("mutex", "read", "write", "kazoo"), repeat=size):
        names = _mixed_names(kinds)
        queue = queue_of(reversed(names))
        for limit in range(1, size + 2):
            for ours in range(size):
                decision = decide(queue, names[ours], "lease", limit)
                holds, watch = _lease_reference(ours, limit)
                assert decision.holds is holds, (kinds, limit, ours)
                assert decision.watch == (None if watch is None else names[watch])


@pytest.mark.parametrize("size", range(0, 10))
def test_lease_holders_are_the_first_n_and_waiters_watch_distinct_nodes_ahead(size: int) -> None:
    names = [f"_c_{UUID}-lock-{seq:010d}" for seq in range(size)]
    queue = queue_of(names)
    for limit in range(1, size + 2):
        decisions = [decide(queue, name, "lease", limit) for name in names]
        holders = [name for name, d in zip(names, decisions, strict=True) if d.holds]
        assert holders == names[:limit]  # never more than limit, and in queue order
        watched = [d.watch for d in decisions if not d.holds]
        assert len(watched) == len(set(watched)) == max(0, size - limit)  # one watcher each
        for name, d in zip(names, decisions, strict=True):
            if d.watch is not None:
                assert names.index(d.watch) == names.index(name) - limit  # N places ahead


@pytest.mark.parametrize("size", range(1, 8))
def test_lease_with_limit_one_is_the_exclusive_predicate(size: int) -> None:
    names = [f"_c_{UUID}-lock-{seq:010d}" for seq in range(size)]
    queue = queue_of(names)
    for name in names:
        assert decide(queue, name, "lease", 1) == decide(queue, name, "write")


def _release_every_order(size: int, limit: int) -> dict[str, int]:
    """The protocol as queue.py runs it, over every order in which holders release: a waiter
    acts only when the node it watches goes. Checks the invariants on every state reached."""
    names = [f"_c_{UUID}-lock-{seq:010d}" for seq in range(size)]
    seen = {"states": 0, "idle": 0, "max_watchers": 0}

    def look(alive: list[str], name: str) -> str | None:
        decision = decide(queue_of(alive), name, "lease", limit)
        return None if decision.holds else decision.watch

    def visit(alive: list[str], holders: frozenset[str], watching: dict[str, str]) -> None:
        seen["states"] += 1
        assert len(holders) <= limit  # safety: never more than N know they hold
        assert all(decide(queue_of(alive), h, "lease", limit).holds for h in holders)
        assert holders or not alive  # liveness: someone holds while anyone waits
        if len(holders) < min(limit, len(alive)):
            seen["idle"] += 1
        targets = list(watching.values())
        if targets:
            seen["max_watchers"] = max(seen["max_watchers"], max(map(targets.count, targets)))
        for gone in sorted(holders):
            rest = [n for n in alive if n != gone]
            now_holding, now_watching = set(holders - {gone}), dict(watching)
            for waiter in [w for w, t in watching.items() if t == gone]:
                target = look(rest, waiter)
                if target is None:
                    del now_watching[waiter]
                    now_holding.add(waiter)
                else:
                    now_watching[waiter] = target
            visit(rest, frozenset(now_holding), now_watching)

    first = {name: look(names, name) for name in names}
    holding = frozenset(n for n, t in first.items() if t is None)
    visit(names, holding, {n: t for n, t in first.items() if t is not None})
    return seen


@pytest.mark.parametrize("size", range(1, 7))
def test_lease_protocol_is_safe_and_live_for_every_release_order(size: int) -> None:
    for limit in range(1, size + 1):
        seen = _release_every_order(size, limit)
        assert seen["states"] > size
        # herd-bounded: a node is watched by at most limit waiters (1 while releases follow
        # the queue order, see the next test)
        assert seen["max_watchers"] <= limit


def test_lease_out_of_order_release_leaves_a_slot_idle_until_the_watched_lease_goes() -> None:
    """The documented price of one watch per waiter (Curator v1 has it too): N=2, a and b hold,
    c watches a, d watches b. b goes first: d wakes, is third, and now watches a as c does; c
    may hold but sleeps until a goes. Exhaustively over every order, some states are idle for
    N >= 2 and none for N = 1."""
    a, b, c, d = (f"_c_{UUID}-lock-{seq:010d}" for seq in range(4))
    assert decide(queue_of([a, b, c, d]), c, "lease", 2).watch == a
    assert decide(queue_of([a, b, c, d]), d, "lease", 2).watch == b
    after = queue_of([a, c, d])
    assert decide(after, c, "lease", 2).holds  # entitled, but only d was woken
    assert decide(after, d, "lease", 2).watch == a
    assert _release_every_order(4, 2)["idle"] > 0
    assert _release_every_order(4, 1)["idle"] == 0


@pytest.mark.parametrize("limit", [None, 0, -1, True, 1.0, "3"])
def test_lease_needs_a_whole_limit_and_other_kinds_none(limit: object) -> None:
    queue = queue_of([f"_c_{UUID}-lock-0000000001"])
    with pytest.raises(ValueError, match="max_leases must be a whole number >= 1"):
        decide(queue, queue[0].name, "lease", limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_leases must be a whole number >= 1"):
        lock_kind("semaphore", limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only a 'lease' lock kind has a limit"):
        decide(queue, queue[0].name, "write", 2)
    with pytest.raises(ValueError, match="only a 'lease' lock kind has a limit"):
        LockKind("lock-", "read", 1)


def test_semaphore_kind_writes_curator_semaphore_v1_nodes() -> None:
    kind = lock_kind("semaphore", 3)
    assert (kind.marker, kind.kind, kind.limit) == ("lock-", "lease", 3)
    name = f"{protected_prefix(UUID)}{kind.marker}0000000005"
    assert parse_child(name) == Contender(5, name, "write")  # a mutex's name: N tells them apart


def test_each_mode_has_one_kind_and_shows_as_itself() -> None:
    assert LOCK_MODES == ("exclusive", "shared", "semaphore")
    assert (lock_kind("exclusive"), lock_kind("shared")) == (WRITE, READ)
    for mode in LOCK_MODES:
        kind = lock_kind(mode, 2 if mode == "semaphore" else None)
        assert Contender(1, "n", kind.kind).mode == mode


@pytest.mark.parametrize("size", range(0, 8))
def test_first_blocker_is_the_node_a_new_acquire_would_watch(size: int) -> None:
    for kinds in itertools.product(("read", "write"), repeat=size):
        names = _mixed_names(kinds)
        queue = queue_of(names)
        for kind in [READ, WRITE, *(lock_kind("semaphore", n) for n in range(1, size + 2))]:
            marker = {"read": "__READ__", "write": "__WRIT__", "lease": "lock-"}[kind.kind]
            newcomer = f"_c_{UUID}-{marker}{size:010d}"
            decision = decide(queue_of([*names, newcomer]), newcomer, kind.kind, kind.limit)
            blocker = first_blocker(queue, kind)
            if decision.holds:
                assert blocker is None, (kinds, kind)
            elif kind.kind == "lease":
                assert blocker is not None and blocker.name == decision.watch
            else:  # the first node in its way (the holder), not the one it watches
                assert blocker is not None and blocker.name == next(
                    c.name for c in queue if kind.kind == "write" or c.kind == "write"
                )


@pytest.mark.parametrize("size", range(0, 8))
def test_holding_is_each_contenders_own_decision(size: int) -> None:
    """Who holds, as operators and ``preempt`` see it, is what each contender decides for
    itself: asking for its own kind, or for a lease of a semaphore's limit."""
    for kinds in itertools.product(("read", "write"), repeat=size):
        names = _mixed_names(kinds)
        queue = queue_of(names)
        for limit in (None, *range(1, size + 2)):
            expected = [
                c for c in queue if decide(queue, c.name, "lease" if limit else c.kind, limit).holds
            ]
            assert holding(queue, limit) == expected, (kinds, limit)


def test_limit_data_round_trip_and_junk() -> None:
    for limit in (1, 2, 3, 10, 2**31 - 1):
        assert limit_data(limit) == f"max_leases={limit}".encode()
        assert parse_limit(limit_data(limit)) == limit
    for junk in (None, b"", b"max_leases=", b"max_leases=0", b"max_leases=03", b"max_leases=-1",
                 b"max_leases=2 ", b"10.0.0.1", b"{}"):  # fmt: skip
        assert parse_limit(junk) is None, junk


def test_limit_agreement_claims_empty_agrees_on_equal_names_both_on_mismatch() -> None:
    path = "/app/locks/exports"
    assert limit_agreement(path, b"", 3) == "claim"
    assert limit_agreement(path, None, 3) == "claim"
    assert limit_agreement(path, b"max_leases=3", 3) == "agreed"
    with pytest.raises(LimitMismatch) as caught:
        limit_agreement(path, b"max_leases=5", 3)
    assert (caught.value.path, caught.value.ours, caught.value.stored) == (path, 3, 5)
    message = str(caught.value)
    assert "max_leases=3" in message and "max_leases=5" in message and path in message
    assert isinstance(caught.value, ConfigurationError)
    with pytest.raises(LimitMismatch, match="not a semaphore limit") as junk:
        limit_agreement(path, b"10.0.0.1", 3)
    assert junk.value.stored is None


def test_a_contender_read_with_its_identity_keeps_its_place_and_equality() -> None:
    """What is read from a node rides on the one contender record without changing the queue:
    equality, order and the decision see only sequence, name and kind."""
    names = [f"_c_{UUID}-lock-{seq:010d}" for seq in (3, 1, 2)]
    bare = queue_of(names)
    read = [
        read_contender(
            c,
            b'{"task_id":"t-%d","retries":%d}' % (c.seq, c.seq),
            ZnodeStat(100 + c.seq, 0, 5000, 0, 0, 0, 0, 0x7, 0, 0, 0),
        )
        for c in bare
    ]
    assert [(c.token, c.created, c.session) for c in read] == [(101, 5.0, 7), (102, 5.0, 7),
                                                              (103, 5.0, 7)]  # fmt: skip
    assert read == bare and sorted(reversed(read)) == read
    assert [(c.task_id, c.retries) for c in read] == [("t-1", 1), ("t-2", 2), ("t-3", 3)]
    assert [(c.task_id, c.retries) for c in bare] == [(None, 0)] * 3
    assert decide(read, names[0], "write") == decide(bare, names[0], "write")
    assert hash(read[0]) == hash(bare[0])
