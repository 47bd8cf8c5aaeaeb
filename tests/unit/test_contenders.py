"""The lock decision as a pure function: every queue shape up to a size, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from celery_zklock.locks.contenders import (
    Contender,
    decide,
    parse_child,
    protected_prefix,
    queue_of,
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
