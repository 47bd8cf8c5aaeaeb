"""The library without the redis client installed (the `redis` extra not taken).

The subprocess hides redis (``sys.modules["redis"] = None`` makes every ``import redis`` fail, as
when it is not installed): ``import celery_zklock`` and a ZkLockTask running under a real
ZooKeeper lock must work, and only RedisFence must fail, naming the extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["redis"] = None  # as if not installed

    import celery_zklock
    from celery import Celery
    from celery_zklock import ZkLockTask, is_skipped

    app = Celery("noredis", broker="memory://", backend="cache+memory://")
    app.conf.zklock_hosts = sys.argv[1]
    app.conf.zklock_root = sys.argv[2]

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lock_on_busy="skip")
    def double(self, n):
        return n * 2, self.lock.token > 0

    result = double.apply(args=(21,)).get()
    assert list(result) == [42, True], result
    from celery_zklock import *  # noqa: F403  (works: RedisFence is not in __all__)

    try:
        from celery_zklock import RedisFence
    except ImportError as exc:
        assert "pip install celery-zklock[redis]" in str(exc), exc
        print("ok:", exc)
    else:
        raise AssertionError("RedisFence imported without redis")
    """
)


def test_the_library_works_without_redis_and_only_the_fence_asks_for_it(
    zk_hosts: str, lock_root: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, zk_hosts, lock_root],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pip install celery-zklock[redis]" in done.stdout
