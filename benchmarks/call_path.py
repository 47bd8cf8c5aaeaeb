"""``python -m benchmarks.call_path [-v]``: the library functions one locked task call crosses.

One exclusive, free-key call of a bound ``ZkLockTask`` (``lock_key=["account_id"]``, run eagerly
in this process against a standalone ZooKeeper this module starts), from ``ZkLockTask.__call__``
to the release, with caches warm (the second call is the one counted). Prints the calls, the
distinct functions and the modules of ``celery_zklock`` they belong to (``-v``: each function in
the order first called): the measure behind "one task, easy to follow"
(docs/how-it-fits-together.md).
"""

from __future__ import annotations

import collections
import sys
from types import FrameType
from typing import Any

from celery import Celery

from celery_zklock import ZkLockTask
from celery_zklock.testing.zookeeper import ZooKeeperServer
from celery_zklock.zk.client import close_clients


def main(argv: list[str]) -> int:
    with ZooKeeperServer() as zk:
        app = Celery("call-path", set_as_current=False)
        app.conf.zklock_hosts = zk.hosts
        app.conf.task_always_eager = True

        @app.task(bind=True, base=ZkLockTask, lock_key=["account_id"], lazy=False)  # type: ignore[untyped-decorator]
        def sync_account(self: Any, account_id: int, full: bool = False) -> int:
            return int(self.lock.token)

        sync_account(1)  # warm: client, settings, parent node
        calls: list[tuple[str, str]] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            module = frame.f_globals.get("__name__", "")
            ours = module.startswith("celery_zklock") and ".testing" not in module
            if event == "call" and ours:
                code = frame.f_code  # co_qualname: Python 3.11 and later
                calls.append((module, getattr(code, "co_qualname", code.co_name)))

        sys.setprofile(profile)
        try:
            sync_account(2)
        finally:
            sys.setprofile(None)
            close_clients()  # before its ZooKeeper stops: no reconnect warning at exit
    distinct = list(dict.fromkeys(calls))
    modules = collections.Counter(module for module, _ in distinct)
    print(f"{len(calls)} calls, {len(distinct)} distinct functions, {len(modules)} modules")
    for module, count in modules.most_common():
        print(f"  {count:3d} {module}")
    if "-v" in argv:
        for module, function in distinct:
            print(f"    {module}: {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
