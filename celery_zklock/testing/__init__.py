"""The local stack: ZooKeeper (standalone or ensemble) and Redis as child processes.

For tests, demos and benchmarks. Every server runs on free 127.0.0.1 ports with a private
temporary directory, is ready only when it really serves (and the listening socket is its own),
and never outlives the process that started it. The pytest fixtures built on this live in
:mod:`celery_zklock.testing.plugin`.
"""

from celery_zklock.testing.processes import MissingDependency, StackError, free_port
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.testing.redis_server import RedisServer
from celery_zklock.testing.zookeeper import (
    ZooKeeperEnsemble,
    ZooKeeperNode,
    ZooKeeperOptions,
    ZooKeeperServer,
    partition_unavailable_reason,
)

__all__ = [
    "MissingDependency",
    "RedisServer",
    "StackError",
    "TcpProxy",
    "ZooKeeperEnsemble",
    "ZooKeeperNode",
    "ZooKeeperOptions",
    "ZooKeeperServer",
    "free_port",
    "partition_unavailable_reason",
]
