"""Every setting name celery-zklock knows, in one registry, and the check that names the others.

A misspelt setting is otherwise silently ignored: ``app.conf.zklock_session_timout = 4`` reads
as unset and the default applies. So the names are listed here once, and everything else that
looks like one of ours is named with the known name closest to it (:mod:`difflib`):

- :data:`APP_SETTINGS`: the ``zklock_*`` app settings. Each is read from ``app.conf`` (under
  any spelling Celery maps to that name: ``CELERY_ZKLOCK_HOSTS`` with
  ``config_from_object(..., namespace="CELERY")``) and, when unset there, from the environment
  variable of the same name in upper case. Every reader goes through
  :func:`celery_zklock.zk.settings.setting`, which refuses a name not listed here.
- :data:`ENVIRONMENT`: every ``ZKLOCK_*`` environment variable read anywhere: the app settings'
  fallbacks, the variables the library reads only from the environment, and those of the
  project's own tools (the local stack, the fleet's workers, compose, benchmarks), which share
  the prefix and the processes.

:func:`unknown_settings` is the check (pure); :func:`warn_unknown` logs each unknown name once
per process, as the settings are read (and at a worker's start); ``celery zklock doctor`` shows
them as check lines.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "APP_SETTINGS",
    "ENVIRONMENT",
    "SASL_KEYS",
    "Unknown",
    "closest",
    "note_said",
    "unknown_settings",
    "warn_unknown",
]

logger = logging.getLogger("celery_zklock.settings")

PREFIX: Final = "zklock_"
"""The prefix of every app setting (``ZKLOCK_`` in the environment)."""

APP_SETTINGS: Final[frozenset[str]] = frozenset(
    {
        # The connection (celery_zklock.zk.settings.client_config).
        "zklock_hosts",
        "zklock_session_timeout",
        "zklock_connect_timeout",
        "zklock_auth",
        "zklock_sasl",
        "zklock_acl",
        "zklock_use_ssl",
        "zklock_ssl_ca",
        "zklock_ssl_verify",
        "zklock_ssl_check_hostname",
        "zklock_ssl_certfile",
        "zklock_ssl_keyfile",
        "zklock_ssl_keyfile_password",
        "zklock_client_factory",
        # The lock root and the rest of an app's settings (zk.settings.Settings).
        "zklock_root",
        "zklock_dedupe_timeout",
        # The worker's gate and an outage's budget (zk.settings.Settings.gate).
        "zklock_gate",
        "zklock_gate_max_held",
        "zklock_gate_max_hold",
        "zklock_outage_budget",
        # Metrics (zk.settings.Settings.metrics_port, metrics_addr).
        "zklock_metrics_port",
        "zklock_metrics_addr",
        # The elected beat (zk.settings.Settings.beat).
        "zklock_beat_name",
        "zklock_beat_scheduler",
    }
)
"""Every ``zklock_*`` app setting."""

SASL_KEYS: Final = ("mechanism", "username", "password", "service", "principal")
"""What ``zklock_sasl`` may hold (kazoo's ``sasl_options``). In the environment it is one
variable per key, ``ZKLOCK_SASL_<KEY>``, and none for the whole dict."""

LIBRARY_ENVIRONMENT: Final[frozenset[str]] = frozenset(
    {
        "ZKLOCK_INTERRUPT_SIGNAL",  # celery_zklock.task.interrupt
        "ZKLOCK_REVOKE_SIGNAL",  # its earlier name, still read
        *(f"ZKLOCK_SASL_{key.upper()}" for key in SASL_KEYS),
    }
)
"""The variables the library reads from the environment only."""

TOOL_ENVIRONMENT: Final[frozenset[str]] = frozenset(
    {
        # celery_zklock.testing: the pytest plugin, the local stack, the worker containers.
        "ZKLOCK_TEST_ZK_HOSTS",
        "ZKLOCK_TEST_REDIS_URL",
        "ZKLOCK_ZOOKEEPER_JVM_FLAGS",
        "ZKLOCK_ZOOKEEPER_IMAGE",
        "ZKLOCK_REDIS_IMAGE",
        "ZKLOCK_WORKER_IMAGE",
        "ZKLOCK_WORKER_APP",
        # workers/ (the fleet's workers; ZKLOCK_HOSTS and the like are app settings).
        "ZKLOCK_BROKER_URL",
        "ZKLOCK_RESULT_BACKEND",
        "ZKLOCK_RECORD_URL",
        "ZKLOCK_POOL",
        "ZKLOCK_CONCURRENCY",
        "ZKLOCK_VISIBILITY_TIMEOUT",
        # compose/ (the fleet on Docker).
        "ZKLOCK_BASE_IMAGE",
        "ZKLOCK_DEBIAN_MIRROR",
        "ZKLOCK_ZOO1_PORT",
        "ZKLOCK_ZOO2_PORT",
        "ZKLOCK_ZOO3_PORT",
        "ZKLOCK_REDIS_PORT",
        "ZKLOCK_RECORDS_PORT",
        "ZKLOCK_ZOO_TICK_TIME",
        # benchmarks/.
        "ZKLOCK_BENCH_HOSTS",
        "ZKLOCK_BENCH_VARIANT",
    }
)
"""The variables of the project's own tools: not the library's, but set beside its settings
(the fleet's workers run with them), so not to be named as typos."""

ENVIRONMENT: Final[frozenset[str]] = frozenset(
    {name.upper() for name in APP_SETTINGS if name != "zklock_sasl"}
    | LIBRARY_ENVIRONMENT
    | TOOL_ENVIRONMENT
)
"""Every ``ZKLOCK_*`` environment variable read anywhere."""


@dataclass(frozen=True)
class Unknown:
    """A name that looks like a celery-zklock setting and is none: ``name`` as written, where
    (``app.conf`` or the environment), and ``meant``, the known name closest to it as the user
    would write it there (None when none is close)."""

    where: Literal["app.conf", "environment"]
    name: str
    meant: str | None

    def describe(self) -> str:
        """``unknown setting zklock_host in app.conf, ignored: did you mean zklock_hosts?``"""
        what = "environment variable" if self.where == "environment" else "setting"
        place = "" if self.where == "environment" else " in app.conf"
        hint = (
            f"did you mean {self.meant}?"
            if self.meant is not None
            else "no celery-zklock setting is close to it (docs/settings.md lists them)"
        )
        return f"unknown {what} {self.name}{place}, ignored: {hint}"

    def means(self, setting: str) -> bool:
        """Whether the closest known name is the app setting ``setting`` (under any spelling:
        ``CELERY_ZKLOCK_HOSTS``, ``ZKLOCK_HOSTS`` and ``zklock_hosts`` all mean
        ``zklock_hosts``)."""
        meant = (self.meant or "").lower()
        return meant == setting or meant.endswith(f"_{setting}")


def closest(name: str, known: Iterable[str], prefix: str = "") -> str | None:
    """The name of ``known`` closest to ``name`` (:func:`difflib.get_close_matches`), or None;
    names are compared without ``prefix``, which they all share (with it, any two names of ours
    look alike: ``zklock_frobnicate`` would mean ``zklock_root``)."""
    by_rest = {each.removeprefix(prefix): each for each in known}
    matches = difflib.get_close_matches(name.removeprefix(prefix), sorted(by_rest), n=1)
    return by_rest[matches[0]] if matches else None


def unknown_settings(
    conf: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> list[Unknown]:
    """Every key of ``conf`` and variable of ``environ`` (default: ``os.environ``) that looks
    like a celery-zklock setting (``zklock_`` or ``ZKLOCK_``, in any case, after Celery's
    namespace if ``conf`` has one) and is not one the library reads under that spelling, with
    the known name closest to it. ``app.conf.ZKLOCK_HOSTS`` is such a key: Celery does not
    read an upper-case name as its lower-case one (without a namespace)."""
    found = _conf_unknowns(conf)
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if name.upper().startswith(PREFIX.upper()) and name not in ENVIRONMENT:
            upper = name.upper()
            meant = upper if upper in ENVIRONMENT else closest(upper, ENVIRONMENT, PREFIX.upper())
            found.append(Unknown("environment", name, meant))
    return found


def _conf_unknowns(conf: Mapping[str, Any]) -> list[Unknown]:
    keys = sorted(k for k in conf if isinstance(k, str))  # loads a pending conf
    prefix = _namespace(conf)
    found = []
    for key in keys:
        prefixed = bool(prefix) and key.upper().startswith(prefix.upper())
        bare = key[len(prefix) :] if prefixed else key
        lower = bare.lower()
        if not lower.startswith(PREFIX):
            continue
        read_as = _match_case(prefix + lower, prefix) if prefixed else lower
        if lower in APP_SETTINGS and key in (lower, read_as):
            continue  # a name Celery gives us under this spelling
        meant = lower if lower in APP_SETTINGS else closest(lower, APP_SETTINGS, PREFIX)
        if meant is not None and prefix and (prefixed or key.isupper()):
            meant = _match_case(prefix + meant, prefix)  # as a Django project would write it
        found.append(Unknown("app.conf", key, meant))
    return found


def _namespace(conf: Mapping[str, Any]) -> str:
    """The namespace prefix Celery reads ``conf``'s settings under (``CELERY_``), or ``""``."""
    prefix = vars(conf).get("prefix") if hasattr(conf, "__dict__") else None
    return prefix if isinstance(prefix, str) else ""


def _match_case(text: str, like: str) -> str:
    """``text`` in upper case if ``like`` is, else in lower case (Celery's ``match_case``, by
    which ``CELERY_`` + ``zklock_hosts`` is read as ``CELERY_ZKLOCK_HOSTS``)."""
    return text.upper() if like.isupper() else text.lower()


_said: set[tuple[str, str]] = set()
_said_lock = threading.Lock()


def note_said(unknowns: Iterable[Unknown]) -> list[Unknown]:
    """Record ``unknowns`` as told to the user in this process; returns those not told before."""
    with _said_lock:
        new = [u for u in unknowns if (u.where, u.name) not in _said]
        _said.update((u.where, u.name) for u in new)
    return new


def warn_unknown(
    conf: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> list[Unknown]:
    """Log a warning (logger ``celery_zklock.settings``) for each of :func:`unknown_settings`
    not told before in this process; returns them."""
    new = note_said(unknown_settings(conf, environ))
    for unknown in new:
        logger.warning("celery-zklock: %s", unknown.describe())
    return new
