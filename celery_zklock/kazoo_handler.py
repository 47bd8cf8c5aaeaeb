"""The kazoo handler, at the path earlier versions documented: moved to
:mod:`celery_zklock.zk.handler` (docs/migration.md)."""

from celery_zklock.zk.handler import DirectSocketConnection, PollingThreadingHandler

__all__ = ["DirectSocketConnection", "PollingThreadingHandler"]
