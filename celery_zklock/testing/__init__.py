"""The test rig that ships with the library: the local stack and what tests run on it.

ZooKeeper (standalone or ensemble), Redis, RabbitMQ and a TCP proxy that can cut or silence a
link, each on free 127.0.0.1 ports and never outliving the process that started it; a
``celery worker`` launcher (:mod:`~celery_zklock.testing.celery_worker`); the mutual-exclusion
witness and its overlap rule (:mod:`~celery_zklock.testing.witness`); pytest fixtures
(:mod:`celery_zklock.testing.plugin`).
"""

from celery_zklock.testing.celery_worker import CeleryWorker
from celery_zklock.testing.processes import MissingDependency, StackError, free_port
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.testing.rabbitmq import RabbitMQServer
from celery_zklock.testing.redis_server import RedisServer
from celery_zklock.testing.zookeeper import (
    ZooKeeperEnsemble,
    ZooKeeperNode,
    ZooKeeperOptions,
    ZooKeeperServer,
    partition_unavailable_reason,
)

__all__ = [
    "CeleryWorker",
    "MissingDependency",
    "RabbitMQServer",
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
