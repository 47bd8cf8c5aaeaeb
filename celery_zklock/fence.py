"""A fenced resource in Redis: keyed values that refuse writes carrying an outdated fencing token.

A lock alone cannot keep a stale holder from writing. A process paused past its session timeout
(a GC pause, SIGSTOP, a swapped-out VM) runs no code while paused, so it cannot know that its
ZooKeeper session expired and that someone else holds the lock now; when it resumes, its next
write may land after the new holder's. Fencing closes that window on the resource side: every
write carries the writer's token (:attr:`celery_zklock.Lease.token`, the ``czxid`` of its lock
node, which rises with every grant), and the resource refuses a token lower than one it already
accepted.

:class:`RedisFence` is that resource for values kept in Redis, and a model for your own: the
check and the write happen in one Lua script, so no other command runs between them.

Guarantees, per key of one fence:

- a write with a token lower than the last accepted token is refused, and nothing changes except
  the refusal count;
- a write with a token equal to or higher than the last accepted one (or the first write) is
  accepted: the value and the token are stored together, atomically;
- the last accepted token never decreases, whatever the interleaving of concurrent writers.

Not guaranteed:

- that an accepted writer still holds the lock. A stale holder writing before the new holder's
  first write is accepted: the fence orders writes, it does not know about the lock. The new
  holder's write then overrides it, and every later stale write is refused.
- anything about writes that bypass the fence (other keys, other Redis commands).
- anything if Redis loses the key: after a restart without persistence or a failover to a replica
  that missed the last write, the fence starts again from nothing and accepts any token.
- a useful order between shared (read-side) holders: they hold the lock together with different
  tokens, so the lower one's write after the higher one's is refused although both hold the lock.
  Fence the writes of exclusive holders.

A refused write means a newer holder already wrote: do not retry it with the same token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

try:
    import redis as _redis  # noqa: F401  (RedisFence takes a redis-py client: say so at import)
except ImportError as exc:
    raise ImportError(
        "celery_zklock.RedisFence needs the redis client, which is not installed: "
        "pip install celery-zklock[redis]"
    ) from exc

__all__ = ["FenceOutcome", "FenceStats", "RedisFence"]

# KEYS: tokens hash, values hash, counters hash. ARGV: key, token (decimal digits), value.
# Tokens are 64-bit czxids but Lua numbers are doubles (exact only below 2**53), so the tokens
# are compared as decimal strings without leading zeros: shorter is lower, equal length compares
# bytewise.
_FENCE_LUA: Final = """
local last = redis.call('HGET', KEYS[1], ARGV[1])
if last then
  if #ARGV[2] < #last or (#ARGV[2] == #last and ARGV[2] < last) then
    redis.call('HINCRBY', KEYS[3], 'refused', 1)
    return {0, last}
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'accepted', 1)
return {1, last or ''}
"""


@dataclass(frozen=True)
class FenceOutcome:
    """One fenced write: ``accepted``, and the key's last accepted token before it.

    ``previous_token`` is None for the first write of a key. On a refusal it is the token that
    outranked this one.
    """

    accepted: bool
    previous_token: int | None


@dataclass(frozen=True)
class FenceStats:
    """Writes accepted and refused by one fence (all keys) since it was created or cleared."""

    accepted: int
    refused: int


class RedisFence:
    """Keyed string values in Redis that accept a write only with a token >= the key's last one.

    ``redis`` is a ``redis.Redis`` (or cluster) client; ``namespace`` separates fences. All Redis
    keys of one namespace share the hash tag ``{namespace}``, so the script also runs on Redis
    Cluster. Tokens are integers >= 0 of any size. Safe to share between threads as far as the
    client is; like the client, do not carry it across a fork.

    Usage in a locked task::

        fence = RedisFence(redis_client, "accounts")
        outcome = fence.write(f"balance:{account_id}", self.lock.token, json.dumps(balance))
        if not outcome.accepted:
            ...  # a newer holder wrote: this run lost its lock; do not retry the write
    """

    def __init__(self, redis: Any, namespace: str) -> None:
        if not namespace or any(c in namespace for c in "{}"):
            raise ValueError(f"namespace must be non-empty without braces, got {namespace!r}")
        self.namespace = namespace
        self._redis = redis
        prefix = f"zklock:fence:{{{namespace}}}"
        self._tokens_key = f"{prefix}:tokens"
        self._values_key = f"{prefix}:values"
        self._counters_key = f"{prefix}:counters"
        self._script = redis.register_script(_FENCE_LUA)

    def write(self, key: str, token: int, value: str) -> FenceOutcome:
        """Store ``value`` under ``key`` unless ``token`` is lower than the last accepted token.

        Atomic in Redis: the comparison, the write of value and token, and the count of the
        outcome happen in one script. Raises ValueError if ``token`` is not an integer >= 0.
        """
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"a fencing token is an integer >= 0, got {token!r}")
        accepted, previous = self._script(
            keys=[self._tokens_key, self._values_key, self._counters_key],
            args=[key, str(token), value],
        )
        previous_text = _text(previous)
        return FenceOutcome(int(accepted) == 1, int(previous_text) if previous_text else None)

    def last_token(self, key: str) -> int | None:
        """The last accepted token for ``key``, or None if nothing was accepted."""
        raw = self._redis.hget(self._tokens_key, key)
        return int(_text(raw)) if raw is not None else None

    def value(self, key: str) -> str | None:
        """The value of the last accepted write for ``key``, or None."""
        raw = self._redis.hget(self._values_key, key)
        return _text(raw) if raw is not None else None

    def stats(self) -> FenceStats:
        """How many writes this fence accepted and refused, over all keys."""
        counters = {_text(k): int(v) for k, v in self._redis.hgetall(self._counters_key).items()}
        return FenceStats(counters.get("accepted", 0), counters.get("refused", 0))

    def clear(self) -> None:
        """Forget every key, value and count of this namespace (the tokens start over)."""
        self._redis.delete(self._tokens_key, self._values_key, self._counters_key)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
