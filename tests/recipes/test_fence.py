"""``RedisFence`` on a real Redis: the compare-and-set contract, per key and under concurrency."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_zklock import RedisFence
from celery_zklock.fence import FenceOutcome, FenceStats


@pytest.fixture
def fence(redis_client: redis.Redis) -> Iterator[RedisFence]:
    resource = RedisFence(redis_client, f"test-{uuid.uuid4().hex}")
    try:
        yield resource
    finally:
        resource.clear()


def test_first_equal_and_rising_tokens_are_accepted(fence: RedisFence) -> None:
    assert fence.last_token("k") is None and fence.value("k") is None
    assert fence.write("k", 10, "a") == FenceOutcome(accepted=True, previous_token=None)
    assert fence.write("k", 10, "b") == FenceOutcome(accepted=True, previous_token=10)
    assert fence.write("k", 12, "c") == FenceOutcome(accepted=True, previous_token=10)
    assert (fence.last_token("k"), fence.value("k")) == (12, "c")
    assert fence.stats() == FenceStats(accepted=3, refused=0)


def test_a_lower_token_is_refused_and_changes_nothing_but_the_count(fence: RedisFence) -> None:
    fence.write("k", 20, "successor")
    assert fence.write("k", 19, "paused holder") == FenceOutcome(False, previous_token=20)
    assert fence.write("k", 0, "ancient holder") == FenceOutcome(False, previous_token=20)
    assert (fence.last_token("k"), fence.value("k")) == (20, "successor")
    assert fence.stats() == FenceStats(accepted=1, refused=2)


def test_tokens_order_as_integers_of_any_size(fence: RedisFence) -> None:
    # "9" > "10" as strings, and 2**53 + 1 == 2**53 as Lua doubles: neither may decide.
    fence.write("k", 9, "x")
    assert fence.write("k", 10, "y").accepted
    assert not fence.write("k", 9, "z").accepted
    big = 2**63 - 1
    assert fence.write("big", big, "x").accepted
    assert not fence.write("big", big - 1, "y").accepted
    assert fence.last_token("big") == big


def test_keys_and_namespaces_are_independent(fence: RedisFence, redis_client: redis.Redis) -> None:
    other = RedisFence(redis_client, f"test-{uuid.uuid4().hex}")
    try:
        fence.write("a", 100, "x")
        assert fence.write("b", 1, "y").accepted  # another key: its own last token
        assert other.write("a", 1, "z").accepted  # same key, another namespace
        assert (fence.last_token("a"), fence.last_token("b"), other.last_token("a")) == (100, 1, 1)
        assert other.stats() == FenceStats(accepted=1, refused=0)
    finally:
        other.clear()


def test_bad_tokens_and_namespaces_are_rejected_before_redis(
    fence: RedisFence, redis_client: redis.Redis
) -> None:
    for token in (-1, True, 2.0, "7", None):
        with pytest.raises(ValueError, match="fencing token"):
            fence.write("k", token, "x")  # type: ignore[arg-type]
    for namespace in ("", "a{b", "c}"):
        with pytest.raises(ValueError, match="namespace"):
            RedisFence(redis_client, namespace)
    assert fence.stats() == FenceStats(0, 0)


def test_keys_share_the_namespace_hash_tag(fence: RedisFence, redis_client: redis.Redis) -> None:
    fence.write("k", 5, "v")
    pattern = f"zklock:fence:{{{fence.namespace}}}:*"
    names = {n.decode() if isinstance(n, bytes) else n for n in redis_client.keys(pattern)}
    assert names == {
        f"zklock:fence:{{{fence.namespace}}}:{part}" for part in ("tokens", "values", "counters")
    }


def test_the_script_survives_a_flushed_script_cache(
    fence: RedisFence, redis_client: redis.Redis
) -> None:
    # A restarted Redis forgets loaded scripts; the fence must load it again, not fail.
    fence.write("k", 1, "a")
    redis_client.script_flush()
    assert fence.write("k", 2, "b") == FenceOutcome(True, previous_token=1)


def test_concurrent_writers_form_one_rising_chain(fence: RedisFence) -> None:
    """8 threads write interleaved distinct tokens; the fence's own answers must fit one order.

    Each accepted write names the token accepted just before it; sorted by token, the accepted
    writes must chain (each one's previous is the one before it), and no accepted token may be
    lower than its previous: that is linearizable compare-and-set.
    """
    writers, tokens = 8, list(range(1, 801))
    results: list[tuple[int, FenceOutcome]] = []
    results_lock = threading.Lock()
    start = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write_all(mine: list[int]) -> None:
        try:
            start.wait(timeout=30)
            for token in mine:
                outcome = fence.write("k", token, str(token))
                with results_lock:
                    results.append((token, outcome))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=write_all, args=(tokens[i::writers],)) for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(results) == len(tokens)

    accepted = sorted((t, o.previous_token) for t, o in results if o.accepted)
    for token, outcome in results:
        if outcome.accepted:
            assert outcome.previous_token is None or token >= outcome.previous_token
        else:
            assert outcome.previous_token is not None and token < outcome.previous_token
    chain = [None] + [token for token, _ in accepted[:-1]]
    assert [previous for _, previous in accepted] == chain
    assert fence.last_token("k") == max(tokens) and fence.value("k") == str(max(tokens))
    assert fence.stats() == FenceStats(len(accepted), len(tokens) - len(accepted))
