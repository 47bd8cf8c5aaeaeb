"""Each task test starts on a broker without the messages of the tests before it: the session's
Redis is shared by every test of a pytest process, and most task tests consume q0 and q1."""

from __future__ import annotations

import pytest
from kombu import Connection


def test_a_task_test_starts_without_the_messages_an_earlier_test_left(
    redis_url: str, request: pytest.FixtureRequest
) -> None:
    # What an earlier test leaves: a message nobody consumed, and one delivered to a worker that
    # died before acknowledging it (a later consumer with a short visibility timeout restores it).
    options = {"visibility_timeout": 1}
    with Connection(redis_url, transport_options=options) as conn:
        queue = conn.SimpleQueue("q0")
        qos = conn.default_channel.qos
        # The tests before this one on this process may have left some too.
        left_before = conn.default_channel.client.hlen(qos.unacked_key)
        queue.put({"left": "unacknowledged"})
        queue.put({"left": "queued"})
        assert queue.get(timeout=10).payload == {"left": "unacknowledged"}  # and never will be
        assert conn.default_channel.client.hlen(qos.unacked_key) == left_before + 1

        request.getfixturevalue("taskenv")

        assert conn.default_channel.client.hlen(qos.unacked_key) == 0
        qos.restore_visible(num=100, interval=1)  # a later consumer's sweep: nothing to restore
        with pytest.raises(queue.Empty):
            queue.get(timeout=2)
        # The queue a client declared before still routes what it sends now.
        queue.put({"sent": "after"})
        message = queue.get(timeout=10)
        assert message.payload == {"sent": "after"}
        message.ack()
        queue.close()
    # Nor does the channel that got the unacknowledged one put it back when it closes.
    with Connection(redis_url) as conn, conn.SimpleQueue("q0") as queue, pytest.raises(queue.Empty):
        queue.get(timeout=1)
