"""``celery zklock doctor``: does this ZooKeeper, with this app's settings, keep the locks safe?

Each check gives one line ``PASS|WARN|FAIL|INFO <check>: <detail>``; the command exits 1 if any
check FAILs. The checks (the verdicts are pure functions, tested without a server):

- **setting names**: every ``zklock_*`` key of ``app.conf`` and ``ZKLOCK_*`` variable of the
  environment is a setting celery-zklock reads; WARN for each that is not (a typo, otherwise
  ignored), naming the setting it most likely means (:mod:`celery_zklock.zk.known`).
- **settings**: ``zklock_*`` (and ``ZKLOCK_*``) parse.
- **connect**: a client with those settings (hosts, TLS, auth, SASL) connects.
- **session timeout**: the one the server negotiated against the requested one. FAIL when the
  server capped it below the request (its ``maxSessionTimeout``): locks of a dead worker then
  live shorter than configured, and every bound computed from the setting is wrong; WARN when
  it raised it (its ``minSessionTimeout``); FAIL under 1 s, where no lease can be renewed.
- **server** (each host): version and mode from the ``srvr`` four-letter word; WARN if four-letter
  words are not whitelisted (``4lw.commands.whitelist``) or the host does not answer.
- **lease safety** (each host): the lease clock (:mod:`celery_zklock.locks.clock`) bounds a
  follower's report delay ``tickTime/2`` by ``T/4``, i.e. it needs the negotiated ``T >= 2 *
  tickTime`` (ZooKeeper's default ``minSessionTimeout``); FAIL if not, WARN if ``conf`` is not
  allowed. INFO: ``syncLimit * tickTime``, how long a follower cut off from its leader goes on
  answering, against ``T`` (the clock trusts only answers that reached the leader, so this is
  information, not a condition).
- **containers**: a container node can be created and deleted under the root, as the locks
  create their parents (ZooKeeper >= 3.5.3; an older server refuses the request). Clients see
  no mark of a container in its stat, so the check is that the server accepts the request.
- **acl**: the ACL the locks' nodes get and the identities in effect (``zklock_acl``,
  ``zklock_auth``, ``zklock_sasl``; never a secret), read back from the probe node.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.security import ACL

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.clock import MIN_SESSION_TIMEOUT
from celery_zklock.zk import adapter, four_letter, known
from celery_zklock.zk.calls import Deadline, wait_result
from celery_zklock.zk.client import tls_context
from celery_zklock.zk.settings import (
    CREATOR_ACL,
    ClientConfig,
    broker_redelivery_timeout,
    host_ports,
    settings_of,
)

Status = Literal["PASS", "WARN", "FAIL", "INFO"]

REQUEST_TIMEOUT: Final = 10.0


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name}: {self.detail}"


def failed(checks: Sequence[Check]) -> bool:
    """True if any check FAILed (the command's exit code is then 1)."""
    return any(check.status == "FAIL" for check in checks)


# -- verdicts (pure) ---------------------------------------------------------------------------


def setting_name_checks(
    conf: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> list[Check]:
    """A WARN line for each name of ``conf`` and ``environ`` (default: ``os.environ``) that
    looks like a celery-zklock setting and is none, with the one it most likely means; else one
    PASS line. Those named here count as told (:func:`celery_zklock.zk.known.note_said`): reading
    the settings afterwards does not log them a second time."""
    unknowns = known.unknown_settings(conf, environ)
    known.note_said(unknowns)
    if not unknowns:
        return [
            Check("PASS", "setting names", "every zklock_* setting set is one celery-zklock reads")
        ]
    return [Check("WARN", "setting names", unknown.describe()) for unknown in unknowns]


def session_timeout_check(requested: float, negotiated: float | None) -> Check:
    """The negotiated session timeout against the requested one (seconds)."""
    name = "session timeout"
    if negotiated is None:
        return Check("WARN", name, f"requested {requested:g}s; the negotiated one was not seen")
    if negotiated < MIN_SESSION_TIMEOUT:
        return Check(
            "FAIL",
            name,
            f"negotiated {negotiated:g}s: a lease needs at least {MIN_SESSION_TIMEOUT:g}s to be "
            "renewed before it must count as lost; raise zklock_session_timeout and the "
            "server's minSessionTimeout",
        )
    if negotiated < requested:
        return Check(
            "FAIL",
            name,
            f"the server capped it at {negotiated:g}s (its maxSessionTimeout), below the "
            f"requested {requested:g}s: a worker paused (GC, swap) for more than {negotiated:g}s "
            "loses its locks, and whatever was sized from zklock_session_timeout is wrong; set "
            f"zklock_session_timeout <= {negotiated:g} or raise maxSessionTimeout",
        )
    if negotiated > requested:
        return Check(
            "WARN",
            name,
            f"the server raised it to {negotiated:g}s (its minSessionTimeout) from the requested "
            f"{requested:g}s: a dead worker's locks last up to {negotiated:g}s",
        )
    return Check("PASS", name, f"negotiated {negotiated:g}s, as requested")


def server_check(where: str, answer: str | None) -> Check:
    """Version and mode of one server from its ``srvr`` answer."""
    name = f"server {where}"
    if answer is None:
        return Check("WARN", name, "no answer to the srvr four-letter word")
    if four_letter.refused(answer):
        return Check(
            "WARN",
            name,
            "four-letter words are not whitelisted: version, mode and the lease-safety rule "
            "cannot be checked (4lw.commands.whitelist=srvr,conf)",
        )
    fields = four_letter.parse("srvr", answer)
    version = fields.get("Zookeeper version", "unknown").split(",")[0].split("-")[0]
    return Check("PASS", name, f"ZooKeeper {version}, mode {fields.get('Mode', 'unknown')}")


def _millis(conf: Mapping[str, str], key: str) -> float | None:
    try:
        return int(conf[key]) / 1000.0
    except (KeyError, ValueError):
        return None


def lease_safety_checks(where: str, negotiated: float | None, conf: str | None) -> list[Check]:
    """The lease clock's assumption ``T >= 2 * tickTime`` on one server, and, as information,
    ``syncLimit * tickTime`` against ``T``, from its ``conf`` answer."""
    name = f"lease safety {where}"
    if conf is None or four_letter.refused(conf):
        unknown = (
            "tickTime unknown (conf four-letter word not answered or not whitelisted): the "
            "lease clock assumes the negotiated session timeout >= 2 x tickTime"
        )
        return [Check("WARN", name, unknown)]
    values = four_letter.parse("conf", conf)
    tick = _millis(values, "tickTime")
    if tick is None or negotiated is None:
        return [Check("WARN", name, "tickTime or the negotiated session timeout unknown")]
    bounds = ("minSessionTimeout", "maxSessionTimeout")
    limits = ", ".join(f"{key}={values[key]}ms" for key in bounds if key in values)
    rule = f"session timeout {negotiated:g}s, tickTime {tick:g}s ({limits})"
    safety = Check("PASS", name, f"{rule}: T >= 2 x tickTime, as the lease clock assumes")
    if negotiated < 2 * tick:
        safety = Check(
            "FAIL",
            name,
            f"{rule}: below 2 x tickTime, a follower's report of our session may reach the "
            f"leader later than the lease clock allows (tickTime/2 > T/4): a lease could "
            f"outlive its session; set zklock_session_timeout >= {2 * tick:g}",
        )
    lag = "standalone server: no followers"
    sync_limit = values.get("syncLimit")
    if sync_limit is not None and sync_limit.isdigit():
        window = int(sync_limit) * tick
        relation = "longer than" if window > negotiated else "within"
        lag = (
            f"syncLimit x tickTime = {window:g}s, {relation} the session timeout "
            f"{negotiated:g}s: a follower cut off from its leader answers for up to "
            f"{window:g}s; leases count only answers that reached the leader (sync)"
        )
    return [safety, Check("INFO", f"follower lag {where}", lag)]


def describe_acl(acl: Sequence[ACL]) -> str:
    """``scheme:id=perms`` entries, e.g. ``auth:=ALL, world:anyone=READ``."""
    names = (("READ", 1), ("WRITE", 2), ("CREATE", 4), ("DELETE", 8), ("ADMIN", 16))
    parts = []
    for entry in acl:
        perms = [label for label, bit in names if entry.perms & bit]
        text = "ALL" if len(perms) == len(names) else "|".join(perms) or "none"
        parts.append(f"{entry.id.scheme}:{entry.id.id}={text}")
    return ", ".join(parts) or "none"


def identities(config: ClientConfig) -> str:
    """The identities the client presents, without secrets: ``digest:alice``, ``sasl:...``."""
    shown = []
    for scheme, credential in config.auth:
        user = credential.split(":", 1)[0] if scheme == "digest" else "<credential>"
        shown.append(f"{scheme}:{user}")
    sasl = dict(config.sasl)
    if sasl:
        who = sasl.get("username") or sasl.get("principal") or ""
        shown.append(f"sasl {sasl.get('mechanism')}" + (f" as {who}" if who else ""))
    return ", ".join(shown) or "anonymous"


def acl_setting(config: ClientConfig) -> str:
    if not config.acl:
        return "open"
    if config.acl == CREATOR_ACL:
        return "creator"
    return "custom"


def acl_check(config: ClientConfig, read_back: Sequence[ACL] | None) -> Check:
    """The ACL the locks' nodes get, as read back from the probe node, and who we are."""
    setting = acl_setting(config)
    who = identities(config)
    if read_back is None:
        return Check("WARN", "acl", f"zklock_acl={setting}, identities: {who}; not read back")
    detail = f"zklock_acl={setting} -> {describe_acl(read_back)}; identities: {who}"
    if setting == "open":
        detail += " (any client that reaches ZooKeeper may delete lock nodes)"
    return Check("PASS", "acl", detail)


# -- probing ZooKeeper -------------------------------------------------------------------------


def gate_bound_check(app: Any) -> Check:
    """The gate's hold bound against the broker's redelivery bound: a held message goes back
    to the broker at ``zklock_gate_max_hold`` from its receipt, which must come before the
    broker hands it out again. RabbitMQ does not tell clients its ``consumer_timeout``: the
    operator is told to keep the bound below it."""
    name = "gate bound"
    try:
        gate = settings_of(app, connection=False).gate
    except ConfigurationError as exc:
        return Check("FAIL", name, str(exc))
    if not gate.enabled:
        return Check("INFO", name, "zklock_gate=False: no message is held in a worker")
    broker = broker_redelivery_timeout(app.conf)
    url = str(app.conf.get("broker_url") or "")
    if url.split("://", 1)[0].split("+", 1)[0].lower() in ("amqp", "amqps", "pyamqp"):
        return Check(
            "INFO",
            name,
            f"a held message goes back to RabbitMQ {gate.max_hold:g}s after its receipt "
            "(zklock_gate_max_hold); keep it below the server's consumer_timeout (30 min by "
            "default, not told to clients), or the server closes the worker's channel",
        )
    if gate.max_hold >= broker:
        return Check(
            "FAIL",
            name,
            f"zklock_gate_max_hold {gate.max_hold:g}s is not below the broker's redelivery "
            f"bound {broker:g}s (visibility_timeout): a held message would be handed out "
            "twice; lower it (80 % of the bound is the default)",
        )
    return Check(
        "PASS",
        name,
        f"a held message goes back to the broker {gate.max_hold:g}s after its receipt, "
        f"before its visibility timeout ({broker:g}s)",
    )


def connection_limit_check(where: str, conf: str | None, sessions: int) -> Check | None:
    """ZooKeeper's limit of connections from one client address (``maxClientCnxns``, 60 by
    default) against the ``sessions`` one worker of this app opens from its host (one per pool
    process, one for its main process's gate), from the server's ``conf`` answer; None when
    the server does not say."""
    if conf is None or four_letter.refused(conf):
        return None
    raw = four_letter.parse("conf", conf).get("maxClientCnxns", "")
    if not raw.isdigit():
        return None
    limit, name = int(raw), f"connections per address {where}"
    if limit == 0:
        return Check("PASS", name, "maxClientCnxns=0: no limit per client address")
    detail = (
        f"maxClientCnxns={limit}; a worker of this app opens {sessions} ZooKeeper sessions "
        f"(one per pool process, one for its main process), so {limit // sessions} such "
        "workers fit on one host (or behind one NAT address)"
    )
    if sessions > limit:
        return Check(
            "FAIL", name, f"{detail}: connections past the limit are refused, and their "
            "tasks retry ZooKeeperUnavailable; raise maxClientCnxns or lower the concurrency",
        )  # fmt: skip
    if 2 * sessions > limit:
        return Check("WARN", name, f"{detail}: a second worker on the host would pass it")
    return Check("PASS", name, detail)


def server_checks(config: ClientConfig, negotiated: float | None, sessions: int) -> list[Check]:
    """``srvr`` and ``conf`` of every host of the connection string; ``sessions``: how many
    ZooKeeper sessions one worker of the app opens."""
    checks: list[Check] = []
    tls = tls_context(config) if config.use_ssl else None
    for host, port in host_ports(config.hosts):
        where = f"{host}:{port}"
        checks.append(server_check(where, four_letter.ask(host, port, "srvr", tls=tls)))
        conf = four_letter.ask(host, port, "conf", tls=tls)
        checks += lease_safety_checks(where, negotiated, conf)
        limit = connection_limit_check(where, conf, sessions)
        if limit is not None:
            checks.append(limit)
    return checks


def probe_containers(client: KazooClient, root: str, config: ClientConfig) -> list[Check]:
    """Create a container node under ``root`` (and the root's missing ancestors, as the locks
    do), check it is one, read its ACL back and delete it."""
    deadline = Deadline(REQUEST_TIMEOUT)
    probe = f"{root}/zklock-doctor-{uuid.uuid4().hex[:12]}"
    parts = probe.strip("/").split("/")
    acl = list(config.acl) or None
    try:
        for i in range(len(parts)):
            path = "/" + "/".join(parts[: i + 1])
            with contextlib.suppress(NodeExistsError):
                wait_result(adapter.create_container_async(client, path, acl), deadline, path)
        try:
            stat = wait_result(client.exists_async(probe), deadline, probe)
            read_back, _ = wait_result(client.get_acls_async(probe), deadline, probe)
        finally:
            with contextlib.suppress(NoNodeError):
                wait_result(client.delete_async(probe), deadline, probe)
    except Exception as exc:  # NoAuth, Unimplemented (no containers), unavailable...
        read_back = None
        containers = Check(
            "FAIL",
            "containers",
            f"could not create and delete a container node under {root} ({exc!r}): the locks "
            "need ZooKeeper >= 3.5.3 and the right to create and delete under the root",
        )
    else:
        containers = (
            Check("PASS", "containers", f"created and deleted a container node under {root}")
            if stat is not None
            else Check("FAIL", "containers", f"{probe} was created but could not be read back")
        )
    return [containers, acl_check(config, read_back)]


def run_checks(
    client: KazooClient, root: str, config: ClientConfig, sessions: int = 1
) -> list[Check]:
    """Every check after connecting (see the module docstring), in report order; ``sessions``:
    how many ZooKeeper sessions one worker of the app opens."""
    negotiated = adapter.negotiated_timeout(client)
    checks = [session_timeout_check(config.session_timeout, negotiated)]
    checks += server_checks(config, negotiated, sessions)
    checks += probe_containers(client, root, config)
    return checks


def report(checks: Sequence[Check]) -> str:
    """The report's lines and its last line (``N FAIL, N WARN``)."""
    counts = {status: sum(c.status == status for c in checks) for status in ("FAIL", "WARN")}
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    verdict = "not safe to run locked tasks" if failed(checks) else "ok"
    return "\n".join([*(c.line() for c in checks), f"doctor: {verdict} ({summary})"])


def connected_detail(client: KazooClient) -> str:
    session = client.client_id[0] if client.client_id else 0
    return f"session {session:#x}"
