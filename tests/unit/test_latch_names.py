"""Leader-latch contender names (Curator's ``LeaderLatch`` layout) parse as exclusive contenders
ordered by their sequence, beside the other kinds' nodes."""

from __future__ import annotations

from celery_zklock.locks.contenders import (
    LATCH,
    Contender,
    decide,
    parse_child,
    protected_prefix,
    queue_of,
)

UUID = "0f8fad5b-d9cb-469f-a165-70867728950e"
OTHER = "1a2b3c4d-0000-4000-8000-123456789abc"


def test_a_latch_node_is_an_exclusive_contender_with_its_sequence() -> None:
    name = f"{protected_prefix(UUID)}{LATCH.marker}0000000042"
    assert name == f"_c_{UUID}-latch-0000000042"
    assert parse_child(name) == Contender(42, name, "write")
    assert (LATCH.marker, LATCH.kind, LATCH.limit) == ("latch-", "write", None)


def test_the_first_latch_node_leads_and_the_next_watches_the_one_before() -> None:
    first, second, third = (
        f"_c_{UUID}-latch-0000000009",
        f"_c_{OTHER}-latch-0000000010",
        f"_c_{UUID}-latch-0000000011",
    )
    queue = queue_of([third, first, "not-a-contender", second])
    assert [c.name for c in queue] == [first, second, third]
    assert decide(queue, first, "write").holds
    assert decide(queue, third, "write").watch == second
