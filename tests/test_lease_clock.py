"""The lease clock's numbers (pure), the negotiated session timeout, and kazoo's private hooks."""

from __future__ import annotations

import time

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler

from celery_zklock import ConfigurationError, Mutex
from celery_zklock.locks import adapter
from celery_zklock.locks.clock import MIN_SESSION_TIMEOUT, LeaseTiming
from celery_zklock.testing.plugin import StackFactory

TIMEOUTS = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0, 20.0, 30.0, 40.0, 60.0]


@pytest.mark.parametrize("session_timeout", TIMEOUTS)
def test_a_lease_ends_a_margin_before_the_earliest_expiry(session_timeout: float) -> None:
    """For an answer to a request sent at s, the leader expires the session no earlier than
    s + T - gap - tick/2 (tick/2 <= T/4); the clock ends the lease a margin >= 0.25 s before."""
    timing = LeaseTiming(session_timeout)
    for steady in (False, True):
        sent_at = 100.0
        since = sent_at - timing.steady_after if steady else None
        gap = timing.renew_interval if steady else session_timeout / 3
        earliest_expiry = sent_at + session_timeout - gap - session_timeout / 4
        valid_until = timing.valid_until(sent_at, renewing_since=since)
        assert earliest_expiry - valid_until >= 0.25 - 1e-9
        # A fresh lease outlives at least one renewal interval.
        assert valid_until - sent_at > timing.renew_interval


def test_renewals_are_steady_only_after_they_ran_long_enough() -> None:
    timing = LeaseTiming(4.0)
    sent_at = 50.0
    idle = timing.valid_until(sent_at, renewing_since=None)
    early = timing.valid_until(sent_at, renewing_since=sent_at - timing.steady_after + 0.01)
    steady = timing.valid_until(sent_at, renewing_since=sent_at - timing.steady_after)
    assert idle == early < steady
    assert steady - sent_at == pytest.approx(4.0 * 5 / 8 - 0.4)


def test_a_too_short_session_timeout_is_refused_with_advice() -> None:
    LeaseTiming(MIN_SESSION_TIMEOUT).check()
    with pytest.raises(ConfigurationError, match="zklock_session_timeout"):
        LeaseTiming(0.4).check()


def test_dead_node_lifetime_covers_tick_rounding() -> None:
    # The server rounds expiry up to a tick (<= T/2) and applies it within a tick.
    assert LeaseTiming(4.0).dead_node_lifetime >= 4.0 + 4.0 / 2


def test_kazoo_still_has_the_private_hooks_we_use() -> None:
    client = KazooClient("127.0.0.1:1")
    owners = {"KazooClient": client, "ConnectionHandler": client._connection}
    for owner, attribute in adapter.PRIVATE_HOOKS:
        assert hasattr(owners[owner], attribute), f"kazoo lost {owner}.{attribute}"
    assert getattr(ConnectionHandler._invoke, "__wrapped__", None) is not None


def test_the_server_capped_timeout_is_known_for_a_client_started_first(
    zk_stack_factory: StackFactory, lock_root: str
) -> None:
    """Deliver 2: asked 20 s, the server caps at 4 s, client started before any lock object."""
    server = zk_stack_factory.server(max_session_timeout_ms=4000)
    client = KazooClient(server.hosts, timeout=20)
    client.start(timeout=15)
    try:
        assert Mutex(client, f"{lock_root}/k").session_timeout == 4.0
    finally:
        client.stop()
        client.close()


def test_an_unseen_handshake_is_learned_by_one_reconnect(
    zk_stack_factory: StackFactory, lock_root: str
) -> None:
    """A client whose handshake happened before the hook (simulated by forgetting it) is made
    to reconnect once, keeping its session; no lease is handed out before the timeout is known."""
    server = zk_stack_factory.server(max_session_timeout_ms=4000)
    client = KazooClient(server.hosts, timeout=20)
    client.start(timeout=15)
    try:
        del client._connection._zklock_negotiated_timeout
        assert adapter.negotiated_timeout(client) is None
        session = client.client_id
        mutex = Mutex(client, f"{lock_root}/k")
        started = time.monotonic()
        with mutex.acquire(timeout=10) as lease:
            assert lease.held
        assert adapter.negotiated_timeout(client) == 4.0
        assert client.client_id == session  # same session, one reconnect
        assert time.monotonic() - started < 10
    finally:
        client.stop()
        client.close()
