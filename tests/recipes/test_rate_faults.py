"""RateLimit under faults, on real ZooKeeper: a decision whose session expired while it was
stalled does not count; every admission reported is one of at most N ``ctime``s in any
half-open window ``[t, t + period)``, read back from the server."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import RateLimit
from celery_zklock.locks import rate
from celery_zklock.locks.rate import Admission
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.zk.calls import Deadline
from tests.lockutil import expire_session, in_thread, wait_for


def most_in_any_window_ms(ctimes_ms: list[int], window_ms: int) -> int:
    """The most ``ctimes_ms`` in any half-open ``[t, t + window_ms)`` (whole milliseconds, as
    ZooKeeper stamps them: no float rounding at the edge)."""
    ordered = sorted(ctimes_ms)
    return max(
        (sum(1 for c in ordered[i:] if c < start + window_ms) for i, start in enumerate(ordered)),
        default=0,
    )


class StalledRateLimit(RateLimit):
    """A RateLimit whose first decision stops between creating its candidate and listing the
    admissions: ``stalled`` is set there, and it goes on once ``resume`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stalled = threading.Event()
        self.resume = threading.Event()

    def _nodes(self, io: Deadline) -> list[Admission]:
        if not self.stalled.is_set():
            self.stalled.set()
            assert self.resume.wait(60), "the test never resumed the stalled decision"
        return super()._nodes(io)


def test_a_decision_whose_session_expired_while_stalled_does_not_count(
    zk_client: KazooClient, other_client: KazooClient, zk_hosts: str, lock_root: str
) -> None:
    """``5/s``: five admissions, then a decider creates its candidate (the window is full: it
    must be refused) and stalls before listing; its session expires, which frees the decision
    lock; another caller decides once the first two admissions are a period old, deletes them as
    old and is admitted (the stalled candidate counts as one for it). Then the stalled decider
    lists: it must not be admitted on its stale candidate, whose ``ctime`` is in the first
    five's window. Every admission reported True is counted with its node's ``ctime`` read back
    from the server: at most 5 in any ``[t, t + 1 s)``."""
    path = f"{lock_root}/api"
    first = RateLimit(zk_client, path, "5/s")
    admitted: list[int] = []
    for _ in range(5):
        assert first.acquire(blocking=False)
        admitted.append(round(first.admitted_at * 1000))

    stalled = StalledRateLimit(other_client, path, "5/s")
    old_session = other_client.client_id[0]
    thread, outcome = in_thread(lambda: (stalled.acquire(blocking=False), stalled.admitted_at))
    assert stalled.stalled.wait(30), "the decision never reached its listing"
    expire_session(zk_hosts, other_client)
    assert first.acquire(timeout=30), "the window never admitted the other caller"
    admitted.append(round(first.admitted_at * 1000))
    # The stalled client is on a new session before its listing goes out (else the listing
    # could fail with the old session's expiry instead of meeting the stale decision).
    wait_for(
        lambda: other_client.connected and other_client.client_id[0] != old_session,
        what="the stalled client's new session",
    )
    stalled.resume.set()
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    was_admitted, admitted_at = outcome["value"]
    if was_admitted:
        admitted.append(round(admitted_at * 1000))
    shown = [c - min(admitted) for c in sorted(admitted)]
    assert most_in_any_window_ms(admitted, 1000) <= 5, shown
    # What the server has agrees with what was reported: every admission of the last period
    # is a node whose ctime is one reported (none unreported, as a stale candidate would be).
    recorded = {round(c * 1000) for c in RateLimit(zk_client, path, "5/s").admissions()}
    assert recorded <= set(admitted), (sorted(recorded), sorted(admitted))


def ttl_server(factory: StackFactory) -> str:
    """The hosts of a server of its own with TTL nodes (``zookeeper.extendedTypesEnabled``)."""
    return factory.server(extra_jvm_flags=("-Dzookeeper.extendedTypesEnabled=true",)).hosts


def test_a_decision_that_lists_after_a_ttl_admission_expired_does_not_count(
    zk_stack_factory: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTL admissions are removed by the server, not under the decision lock: a decider that
    holds its lock but lists later than LISTING_BOUND after its create could miss one that
    counted at its candidate's ``ctime``. ``1/s``, the bound lowered to 0.2 s: an admission,
    then a decider creates its candidate (it must be refused) and stalls, its lock still
    held, until the server removed the admission (its TTL, 1.2 s, passed); then it lists. It
    must not be admitted on that candidate's ``ctime``."""
    monkeypatch.setattr(rate, "LISTING_BOUND", 0.2)
    client = KazooClient(ttl_server(zk_stack_factory), timeout=10)
    client.start(timeout=15)
    try:
        path = "/rate-ttl-stall/key"
        first = RateLimit(client, path, "1/s")
        assert first.acquire(blocking=False)
        admitted = [round(first.admitted_at * 1000)]
        (node,) = [n for n in client.get_children(path) if n.startswith(rate.ADMISSION_PREFIX)]
        stalled = StalledRateLimit(client, path, "1/s")
        thread, outcome = in_thread(lambda: (stalled.acquire(blocking=False), stalled.admitted_at))
        assert stalled.stalled.wait(30), "the decision never reached its listing"
        wait_for(lambda: client.exists(f"{path}/{node}") is None, what="the TTL admission to go")
        stalled.resume.set()
        thread.join(60)
        assert not thread.is_alive()
        assert "error" not in outcome, outcome.get("error")
        was_admitted, admitted_at = outcome["value"]
        if was_admitted:
            admitted.append(round(admitted_at * 1000))
        assert most_in_any_window_ms(admitted, 1000) <= 1, admitted
    finally:
        client.stop()
        client.close()
