"""The lease clock's numbers (pure) and kazoo's private hooks; the negotiated timeout from a real
server is in tests/recipes/test_negotiated_timeout.py."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler

from celery_zklock import ConfigurationError
from celery_zklock.locks.clock import MIN_SESSION_TIMEOUT, LeaseTiming
from celery_zklock.zk import adapter

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
