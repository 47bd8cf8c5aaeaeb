"""The settings reader, at the path earlier versions documented: moved to
:mod:`celery_zklock.zk.settings` (docs/migration.md)."""

from celery_zklock.zk.settings import (
    ClientConfig,
    GateConfig,
    Settings,
    broker_redelivery_timeout,
    client_config,
    forget_settings,
    settings_of,
)

__all__ = [
    "ClientConfig",
    "GateConfig",
    "Settings",
    "broker_redelivery_timeout",
    "client_config",
    "forget_settings",
    "settings_of",
]
