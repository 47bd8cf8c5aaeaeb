"""celery-zklock's app settings, read one way: ``app.conf.zklock_*``, else the ``ZKLOCK_*``
environment variable of the same name in upper case, else the one default kept here.

Every module that needs a setting (the task layer, the gate, metrics, beat, the commands) takes
it from its app's one :class:`Settings` object (:func:`settings_of`), whose parts read each name
through :func:`setting`; each setting's default is one constant of this module, and
``docs/settings.md`` lists them. Every setting's name is in one registry,
:mod:`celery_zklock.zk.known`: :func:`setting` reads only names listed there, and names each
``zklock_*``/``ZKLOCK_*`` name that is not one (a typo, ignored otherwise) with the setting it
most likely means, once per process.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.parse
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final

from kazoo.security import ACL, CREATOR_ALL_ACL, READ_ACL_UNSAFE

from celery_zklock.errors import ConfigurationError
from celery_zklock.zk import known
from celery_zklock.zk.known import SASL_KEYS
from celery_zklock.zk.validate import forbidden_in_znode, seconds, short_repr, znode_path

DEFAULT_ROOT: Final = "/zklock"
"""``zklock_root``."""
DEFAULT_SESSION_TIMEOUT: Final = 10.0
"""``zklock_session_timeout``, seconds."""
DEFAULT_CONNECT_TIMEOUT: Final = 5.0
"""``zklock_connect_timeout``, seconds a process waits for ZooKeeper on first use."""
DEFAULT_BEAT_SCHEDULER: Final = "celery.beat:PersistentScheduler"
"""``zklock_beat_scheduler``: the scheduler class the elected beat runs."""
DEFAULT_METRICS_ADDR: Final = "0.0.0.0"
"""``zklock_metrics_addr``: the address the metrics endpoint binds."""
DEFAULT_DEDUPE_TIMEOUT: Final = 3.0
"""``zklock_dedupe_timeout``: seconds a deduplicated ``apply_async`` waits for ZooKeeper."""
CREATOR_ACL: tuple[ACL, ...] = (*CREATOR_ALL_ACL, *READ_ACL_UNSAFE)
"""``zklock_acl="creator"``: the authenticated identity that created a node may do anything
with it; anyone may read it (operators see who holds what)."""


def setting(conf: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The value of setting ``name`` (``zklock_*``): ``conf[name]`` unless None, else the
    environment variable ``NAME`` (text), else ``default``.

    ``name`` must be in the registry (:data:`celery_zklock.zk.known.APP_SETTINGS`, else
    ValueError: a reader of a setting nobody registered is a bug of ours). Each read also warns
    of the names in ``conf`` and the environment that look like settings and are none
    (:func:`celery_zklock.zk.known.warn_unknown`: each once per process), so a typo is named
    when the settings are first read, whichever reader reads first."""
    if name not in known.APP_SETTINGS:
        raise ValueError(f"{name!r} is not in celery_zklock.zk.known.APP_SETTINGS: register it")
    known.warn_unknown(conf)
    value = conf.get(name)
    if value is None:
        value = os.environ.get(name.upper(), default)
    return value


def text_setting(conf: Mapping[str, Any], name: str) -> str | None:
    """:func:`setting` as text, None when unset or empty."""
    value = setting(conf, name)
    return None if value is None or str(value) == "" else str(value)


@dataclass(frozen=True)
class ClientConfig:
    """Everything that identifies a ZooKeeper connection; equal configs share one client."""

    hosts: str
    session_timeout: float = DEFAULT_SESSION_TIMEOUT
    handler: str = "threading"
    auth: tuple[tuple[str, str], ...] = ()
    """``(scheme, credential)`` pairs sent after connecting (``("digest", "alice:secret")``)."""
    sasl: tuple[tuple[str, str], ...] = ()
    """kazoo's ``sasl_options`` as sorted pairs (``mechanism``, ``username``, ...)."""
    acl: tuple[ACL, ...] = ()
    """The ACL of every node the locks create (empty: kazoo's default, open to all)."""
    use_ssl: bool = False
    certfile: str | None = None
    keyfile: str | None = None
    keyfile_password: str | None = None
    ca: str | None = None
    verify_certs: bool = True
    check_hostname: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    factory: str | None = None
    """``"module:callable"`` returning the KazooClient to use instead of building one."""
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` naming the bad setting."""
        if not self.factory and (not self.hosts or not self.hosts.strip()):
            raise ConfigurationError(f"ZooKeeper hosts are empty: {NO_HOSTS_ADVICE}")
        if not self.factory:
            host_ports(self.hosts)
        seconds("zklock_session_timeout", self.session_timeout)
        seconds("zklock_connect_timeout", self.connect_timeout)
        if self.handler not in ("threading", "gevent"):
            raise ConfigurationError(
                f"kazoo handler must be 'threading' or 'gevent', got {self.handler!r}"
            )
        if self.acl == CREATOR_ACL and not (self.auth or self.sasl):
            raise ConfigurationError(
                "zklock_acl='creator' needs credentials: only an authenticated identity can be "
                "a node's creator; set zklock_auth (e.g. [('digest', 'alice:secret')], env "
                "ZKLOCK_AUTH=digest:alice:secret) or zklock_sasl (env ZKLOCK_SASL_*)"
            )
        if self.check_hostname and not self.verify_certs:
            raise ConfigurationError(
                "zklock_ssl_check_hostname needs zklock_ssl_verify: a hostname is only checked "
                "in a verified certificate"
            )
        if self.use_ssl and self.verify_certs and not self.ca:
            raise ConfigurationError(
                "zklock_use_ssl with zklock_ssl_verify needs zklock_ssl_ca (env ZKLOCK_SSL_CA): "
                "the PEM file of the CA that signed the servers' certificates"
            )
        if self.factory is not None and ":" not in self.factory:
            raise ConfigurationError(
                f"zklock_client_factory must be 'module:callable', got {self.factory!r}"
            )


NO_HOSTS_ADVICE: Final = (
    "set app.conf.zklock_hosts or the ZKLOCK_HOSTS environment variable, e.g. "
    "'zk1:2181,zk2:2181,zk3:2181'"
)
DEFAULT_PORT: Final = 2181
"""The port of a ``zklock_hosts`` entry that names none."""
HOSTS_FORMAT: Final = "host:port[,host:port...][/chroot]"
"""The format of ``zklock_hosts``, as error messages give it."""
_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def host_ports(hosts: str) -> list[tuple[str, int]]:
    """``(host, port)`` of every entry of a ZooKeeper connection string
    ``host[:port][,host[:port]...][/chroot]`` (port :data:`DEFAULT_PORT` when an entry has none,
    an IPv6 address in brackets), read as kazoo reads it.

    Raises :class:`ConfigurationError` naming ``zklock_hosts`` and the entry: a URL scheme
    (``zk://127.0.0.1:2181``: a connection string has none), an empty entry, a port that is
    not a number from 1 to 65535, a chroot that is not a znode path. kazoo would raise a bare
    ``ValueError`` at connect time for these, which reads as ZooKeeper being down.
    """
    scheme = _SCHEME.search(hosts)
    if scheme is not None:
        raise ConfigurationError(
            f"zklock_hosts (env ZKLOCK_HOSTS) {short_repr(hosts)}: a ZooKeeper connection "
            f"string has no scheme ({scheme.group()}); give {HOSTS_FORMAT}, here "
            f"{short_repr(_SCHEME.sub('', hosts))}"
        )
    text, slash, chroot = hosts.partition("/")
    if slash and chroot:
        znode_path("zklock_hosts' chroot", f"/{chroot}")
    found = []
    for entry in text.split(","):
        parts = urllib.parse.urlsplit(f"zk://{entry.strip()}")
        try:
            port = parts.port
        except ValueError:
            port = 0
        problem = None
        if not parts.hostname:
            problem = "it names no host"
        elif port == 0:
            problem = "its port is not a number from 1 to 65535"
        elif parts.query or parts.fragment or "@" in parts.netloc or " " in parts.hostname:
            problem = "it is not host[:port]"
        if problem is not None:
            raise ConfigurationError(
                f"zklock_hosts (env ZKLOCK_HOSTS) {short_repr(hosts)}: the entry "
                f"{short_repr(entry.strip())} is not valid ({problem}); give {HOSTS_FORMAT}, "
                "e.g. 'zk1:2181,zk2:2181,zk3:2181'"
            )
        assert parts.hostname is not None
        found.append((parts.hostname, port or DEFAULT_PORT))
    return found


def client_config(conf: Mapping[str, Any], *, handler: str = "threading") -> ClientConfig:
    """The ZooKeeper connection settings of an app.

    Every setting is read from ``app.conf`` and, when unset there, from the environment variable
    of the same name in upper case (``zklock_hosts`` -> ``ZKLOCK_HOSTS``); the table in the
    README's "Settings" section lists each with its default. The environment's forms: numbers
    and paths as text, flags as ``true``/``false`` (also ``1``/``0``, ``yes``/``no``),
    ``ZKLOCK_AUTH`` as ``scheme:credential`` pairs separated by commas
    (``digest:alice:secret``), ``ZKLOCK_ACL`` as ``open`` or ``creator``, and SASL as
    ``ZKLOCK_SASL_MECHANISM``, ``ZKLOCK_SASL_USERNAME``, ``ZKLOCK_SASL_PASSWORD`` (and
    ``ZKLOCK_SASL_SERVICE``, ``ZKLOCK_SASL_PRINCIPAL`` for GSSAPI).

    Raises ConfigurationError naming the bad setting.
    """
    verify = _flag(conf, "zklock_ssl_verify", True)
    use_ssl = _flag(conf, "zklock_use_ssl", False)
    config = ClientConfig(
        hosts=str(setting(conf, "zklock_hosts", "")).strip(),
        session_timeout=_seconds(conf, "zklock_session_timeout", DEFAULT_SESSION_TIMEOUT),
        connect_timeout=_seconds(conf, "zklock_connect_timeout", DEFAULT_CONNECT_TIMEOUT),
        handler=handler,
        auth=_auth(conf),
        sasl=_sasl(conf),
        acl=_acl(conf),
        use_ssl=use_ssl,
        certfile=_path(conf, "zklock_ssl_certfile"),
        keyfile=_path(conf, "zklock_ssl_keyfile"),
        keyfile_password=text_setting(conf, "zklock_ssl_keyfile_password"),
        ca=_path(conf, "zklock_ssl_ca"),
        verify_certs=verify,
        check_hostname=_flag(conf, "zklock_ssl_check_hostname", use_ssl and verify),
        factory=text_setting(conf, "zklock_client_factory"),
    )
    if not config.factory and not config.hosts:
        typos = [u for u in known.unknown_settings(conf) if u.means("zklock_hosts")]
        if typos:  # "empty" alone hides the cause: say which name was meant as the hosts
            said = "; ".join(u.describe() for u in typos)
            raise ConfigurationError(f"ZooKeeper hosts are empty ({said}): {NO_HOSTS_ADVICE}")
    config.validate()
    return config


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _flag(conf: Mapping[str, Any], name: str, default: bool) -> bool:
    value = setting(conf, name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ConfigurationError(f"{name} must be true or false, got {value!r}")


def _seconds(conf: Mapping[str, Any], name: str, default: float) -> float:
    return seconds(name, setting(conf, name, default), text=True)


def _path(conf: Mapping[str, Any], name: str) -> str | None:
    path = text_setting(conf, name)
    if path is not None and not os.path.isfile(path):
        raise ConfigurationError(f"{name}: no such file {path!r}")
    return path


def _auth(conf: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    value = conf.get("zklock_auth")
    if value is None:
        text = os.environ.get("ZKLOCK_AUTH", "")
        pairs = [entry.strip().partition(":") for entry in text.split(",") if entry.strip()]
        bad = [scheme for scheme, sep, cred in pairs if not (scheme and sep and cred)]
        if bad:
            raise ConfigurationError(
                f"ZKLOCK_AUTH must be scheme:credential pairs separated by commas "
                f"(e.g. digest:alice:secret), got {text!r}"
            )
        return tuple((scheme, cred) for scheme, _, cred in pairs)
    try:
        return tuple((str(scheme), str(cred)) for scheme, cred in value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"zklock_auth must be a list of (scheme, credential) pairs, e.g. "
            f"[('digest', 'alice:secret')], got {value!r}"
        ) from None


def _sasl(conf: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    value = conf.get("zklock_sasl")
    if value is None:  # one variable per key, ZKLOCK_SASL_<KEY>; an empty one is unset
        from_env = ((key, os.environ.get(f"ZKLOCK_SASL_{key.upper()}")) for key in SASL_KEYS)
        value = {key: text for key, text in from_env if text}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"zklock_sasl must be a dict such as {{'mechanism': 'DIGEST-MD5', 'username': "
            f"'alice', 'password': '...'}}, got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(SASL_KEYS))
    if unknown:
        raise ConfigurationError(f"zklock_sasl: unknown keys {unknown}; known: {SASL_KEYS}")
    if value and "mechanism" not in value:
        raise ConfigurationError("zklock_sasl needs a mechanism: DIGEST-MD5 or GSSAPI")
    return tuple(sorted((str(k), str(v)) for k, v in value.items()))


def _acl(conf: Mapping[str, Any]) -> tuple[ACL, ...]:
    value = setting(conf, "zklock_acl", "open")
    if isinstance(value, str):
        name = value.strip().lower()
        if name == "open":
            return ()
        if name == "creator":
            return CREATOR_ACL
        raise ConfigurationError(
            f"zklock_acl must be 'open', 'creator' or a list of kazoo ACLs, got {value!r}"
        )
    try:
        acl = tuple(value)
    except TypeError:
        acl = ()
    if not acl or not all(isinstance(entry, ACL) for entry in acl):
        raise ConfigurationError(
            "zklock_acl must be 'open', 'creator' or a non-empty list of kazoo.security.ACL "
            f"(e.g. [make_digest_acl('alice', 'secret', all=True)]), got {value!r}"
        )
    return acl


class Settings:
    """An app's celery-zklock settings (:func:`settings_of`): each reader takes its part. A part
    is read when first asked for and kept, as Celery reads a task's config once; an invalid
    setting raises ConfigurationError naming it and is read again at the next ask. So a producer
    never reads the worker's parts, and a bad beat setting stops only the beat."""

    def __init__(self, app: Any) -> None:
        self._app = weakref.proxy(app)  # kept per app, in a dict weakly keyed by the app

    @cached_property
    def root(self) -> str:
        """``zklock_root`` (env ``ZKLOCK_ROOT``): the znode under which task locks live."""
        return znode_path("zklock_root", setting(self._app.conf, "zklock_root", DEFAULT_ROOT))

    @cached_property
    def client(self) -> ClientConfig:
        """The ZooKeeper connection (:func:`client_config`; gevent's handler if gevent patched)."""
        return client_config(self._app.conf, handler="gevent" if _gevent_patched() else "threading")

    @cached_property
    def dedupe_timeout(self) -> float:
        """``zklock_dedupe_timeout``: seconds a deduplicated ``apply_async`` waits for ZooKeeper."""
        return _seconds(self._app.conf, "zklock_dedupe_timeout", DEFAULT_DEDUPE_TIMEOUT)

    @cached_property
    def redelivery_timeout(self) -> float:
        """Seconds after which the app's broker hands out again a message received and not
        yet acknowledged (:func:`broker_redelivery_timeout`)."""
        return broker_redelivery_timeout(self._app.conf)

    @cached_property
    def gate(self) -> GateConfig:
        """The worker gate's part, and the outage budget of every locked call."""
        conf = self._app.conf
        max_held = setting(conf, "zklock_gate_max_held", DEFAULT_GATE_MAX_HELD)
        try:
            max_held = int(max_held)
            if max_held < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"zklock_gate_max_held must be a whole number >= 0, got {max_held!r}"
            ) from None
        explicit = setting(conf, "zklock_gate_max_hold")
        if explicit is not None:
            max_hold = seconds("zklock_gate_max_hold", explicit, text=True)
        else:
            max_hold = 0.8 * self.redelivery_timeout
        budget = _seconds(conf, "zklock_outage_budget", DEFAULT_OUTAGE_BUDGET)
        enabled = _flag(conf, "zklock_gate", True)
        return GateConfig(enabled, max_held, max_hold, min(budget, max_hold), budget)

    @cached_property
    def metrics_port(self) -> int | None:
        """``zklock_metrics_port`` (env ``ZKLOCK_METRICS_PORT``): the port of the worker's
        metrics endpoint, or None (off) when unset or empty; ConfigurationError unless it is a
        port number (1-65535)."""
        value = setting(self._app.conf, "zklock_metrics_port")
        if value is None or str(value).strip() == "":
            return None
        try:
            port = int(str(value).strip())
        except ValueError:
            port = -1
        if isinstance(value, bool) or not 1 <= port <= 65535:
            raise ConfigurationError(
                f"zklock_metrics_port must be a port number (1-65535), got {value!r}"
            )
        return port

    @cached_property
    def metrics_addr(self) -> str:
        """``zklock_metrics_addr`` (env ``ZKLOCK_METRICS_ADDR``): the address the endpoint binds."""
        value = setting(self._app.conf, "zklock_metrics_addr")
        return ("" if value is None else str(value).strip()) or DEFAULT_METRICS_ADDR

    @cached_property
    def beat(self) -> BeatSettings:
        """The elected beat's part: ``zklock_beat_name`` (default the app's main name: one znode
        name), ``zklock_beat_scheduler`` (default :data:`DEFAULT_BEAT_SCHEDULER`, not
        ``LeaderScheduler`` itself) and the lock root."""
        name = text_setting(self._app.conf, "zklock_beat_name")
        if name is None:
            main = getattr(self._app, "main", None)
            if not main or main == "__main__":
                raise ConfigurationError(
                    "zklock_beat_name is not set and the app has no main name: set "
                    "app.conf.zklock_beat_name (env ZKLOCK_BEAT_NAME) to name the beat group"
                )
            name = str(main)
        bad = next((char for char in name if char == "/" or forbidden_in_znode(char)), None)
        if name in (".", "..") or bad is not None:
            problem = "'.' or '..'" if bad is None else f"the character U+{ord(bad):04X}"
            raise ConfigurationError(
                f"zklock_beat_name must be one znode name, got {name!r} ({problem})"
            )
        scheduler = text_setting(self._app.conf, "zklock_beat_scheduler") or DEFAULT_BEAT_SCHEDULER
        if scheduler.replace(":", ".").rsplit(".", 1)[-1] == "LeaderScheduler":
            raise ConfigurationError(
                f"zklock_beat_scheduler names {scheduler!r}: it must name the scheduler the "
                "leader runs (e.g. celery.beat:PersistentScheduler), not LeaderScheduler itself"
            )
        return BeatSettings(self.root, name, scheduler)


_settings: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()


def settings_of(app: Any, *, connection: bool = True) -> Settings:
    """The one settings object of ``app``, kept for the app's life, its connection part read
    (``root``, ``client``, ``dedupe_timeout``: ConfigurationError naming a bad one) unless
    ``connection=False`` (the metrics endpoint, served without ZooKeeper settings too). A worker
    reads them afresh as it starts; a test that changes them after calls :func:`forget_settings`.
    """
    settings = _settings.get(app) or _settings.setdefault(app, Settings(app))  # one wins a race
    if connection:  # read now, so that a bad one raises here, at the first call
        _ = settings.root, settings.client, settings.dedupe_timeout
    return settings


def forget_settings(app: Any) -> None:
    """Read ``app``'s settings again at their next use (a worker's start, a test's change)."""
    _settings.pop(app, None)


def _gevent_patched() -> bool:
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("socket"))


DEFAULT_OUTAGE_BUDGET: Final = 600.0
"""``zklock_outage_budget``: seconds a locked call rides an unreachable ZooKeeper out."""
DEFAULT_GATE_MAX_HELD: Final = 1000
"""``zklock_gate_max_held``: messages a worker's gate holds while it keeps fetching more."""
DEFAULT_BROKER_TIMEOUT: Final = {"redis": 3600.0, "amqp": 1800.0}
"""Seconds after which a broker hands an unacknowledged message out again (Redis and SQS:
``visibility_timeout``, 1 h unless set; RabbitMQ: the server's ``consumer_timeout``, 30 min by
default, which it does not tell its clients), by transport family."""
_VISIBILITY_TRANSPORTS: Final = frozenset({"redis", "rediss", "sentinel", "sqs"})


@dataclass(frozen=True)
class GateConfig:
    """:attr:`Settings.gate`, of :mod:`celery_zklock.worker.gate`: ``enabled`` (``zklock_gate``,
    on unless False), ``max_held`` (``zklock_gate_max_held``: past it a busy call waits in the
    broker, sent again with a short ETA, rather than hold a prefetch slot)
    and ``max_hold``: the longest a message is held before it goes to the pool whatever its
    ``lock_timeout`` (``zklock_gate_max_hold``; default 80% of the broker's redelivery timeout,
    so that a held message is never handed out again while it waits); ``outage_budget``, how
    long a locked call rides an unreachable ZooKeeper out before ``lock_on_unavailable``
    applies: ``zklock_outage_budget`` (default 600 s, ``asked_outage_budget``), at most
    ``max_hold`` (a held message goes back to the broker then)."""

    enabled: bool
    max_held: int
    max_hold: float
    outage_budget: float = 600.0
    asked_outage_budget: float = 600.0


@dataclass(frozen=True)
class BeatSettings:
    """:attr:`Settings.beat`: where a beat group elects its leader and keeps its schedule."""

    root: str
    """``zklock_root``."""
    name: str
    """``zklock_beat_name``: beats with the same root and name form one group, one leader."""
    scheduler: str
    """``zklock_beat_scheduler``: the scheduler class each leader runs."""

    @property
    def election(self) -> str:
        """The lock every beat of the group contends for."""
        return f"{self.root}/beat/{self.name}/leader"

    @property
    def state(self) -> str:
        """The node holding the schedule's state (``celery_zklock.beat.state``)."""
        return f"{self.root}/beat/{self.name}/schedule"


def broker_redelivery_timeout(conf: Mapping[str, Any]) -> float:
    """Seconds after which the app's broker hands out again a message received and not yet
    acknowledged: the ``visibility_timeout`` transport option of Redis and SQS (1 h by
    default), else RabbitMQ's default ``consumer_timeout`` (30 min)."""
    url = str(conf.get("broker_url") or "")
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in _VISIBILITY_TRANSPORTS:
        options = conf.get("broker_transport_options") or {}
        return float(options.get("visibility_timeout", DEFAULT_BROKER_TIMEOUT["redis"]))
    return DEFAULT_BROKER_TIMEOUT["amqp"]
