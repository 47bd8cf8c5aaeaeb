"""Local ZooKeeper for tests, demos and benchmarks: one standalone server or an N-node ensemble.

Each node is a JVM (``QuorumPeerMain zoo.cfg``) run as our child on free 127.0.0.1 ports, with a
private directory removed on stop. It serves once ``srvr`` answers with a mode (``ruok``
answers before the server serves) from a listening socket that is the JVM's own; a start whose
port was taken is retried with new ports. An ensemble's ``isolatable`` members can be cut off
from the others (:meth:`ZooKeeperEnsemble.isolate`). ZooKeeper is found through
``zookeeper_home``/``$ZOOKEEPER_HOME`` or Debian's jar, java through ``java``/``$JAVA_HOME``/
``PATH``; a missing one raises :class:`MissingDependency` naming the Debian package.

Security (``security=``:class:`~celery_zklock.testing.security.ZooKeeperSecurity`): SASL
DIGEST-MD5 users, a TLS client port and the plain port switched off; the material (certificates,
JAAS file) is generated once per start into a private directory of the server or ensemble, and
each node reads its own copy. With TLS on, readiness and :meth:`ZooKeeperNode.srvr` ask over TLS
(the TLS port is the last one a standalone server binds).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from celery_zklock.testing.processes import (
    ChildProcess,
    MissingDependency,
    Service,
    StackError,
    free_port,
    listener_is_owned_by,
    make_temp_dir,
    remove_temp_dir,
    start_with_retries,
)
from celery_zklock.testing.security import (
    TLS_HOSTNAME,
    SecurityMaterial,
    ZooKeeperSecurity,
    generate_material,
    server_config_lines,
    server_jvm_flags,
)
from celery_zklock.zk import four_letter
from celery_zklock.zk.validate import positive_int

__all__ = [
    "ZooKeeperEnsemble",
    "ZooKeeperNode",
    "ZooKeeperOptions",
    "ZooKeeperServer",
    "partition_unavailable_reason",
]

DEBIAN_ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
# Debian's zookeeper.jar carries only slf4j-api: without a binding ZooKeeper logs nothing.
DEBIAN_SLF4J_BINDING = Path("/usr/share/java/slf4j-simple.jar")
# The Netty jars Debian's zookeeper.jar manifest leaves out; the TLS port (Netty) needs them.
DEBIAN_NETTY_EXTRAS = (
    Path("/usr/share/java/netty-codec.jar"),
    Path("/usr/share/java/netty-resolver.jar"),
)
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
BASE_JVM_FLAGS = ("-Xms16m", "-Xmx64m", "-XX:+UseSerialGC", "-XX:-UsePerfData")
JVM_FLAGS_ENV = "ZKLOCK_ZOOKEEPER_JVM_FLAGS"
"""Extra JVM flags for every node started (space-separated): this project's test suite sets
:data:`QUICK_JVM_FLAGS` (``tests/conftest.py``), benchmarks leave it unset."""
QUICK_JVM_FLAGS = "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1"
"""The client compiler only, one compiler thread: about a fifth less CPU for a server's start and
a few hundred requests (measured: 1.8 s against 2.3 s), for suites that start many servers; a
long run at full load is faster with the default JIT."""
# Only addresses that also accept connections to 127.0.0.1: readiness and port ownership are
# checked there.
CLIENT_ADDRESSES = ("127.0.0.1", "0.0.0.0")
SERVING_MODES = frozenset({"standalone", "leader", "follower"})
_BIND_FAILURE_RE = re.compile(r"Address already in use|BindException|UNABLE_TO_BIND", re.I)
_LOG_FILE = "zookeeper.log"

_LOGBACK_XML = """<configuration>
  <appender name="STDERR" class="ch.qos.logback.core.ConsoleAppender">
    <target>System.err</target>
    <encoder><pattern>%d{HH:mm:ss.SSS} [%thread] %-5level %logger{36} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="STDERR"/></root>
</configuration>
"""
_LOG4J_PROPERTIES = """log4j.rootLogger=INFO, STDERR
log4j.appender.STDERR=org.apache.log4j.ConsoleAppender
log4j.appender.STDERR.Target=System.err
log4j.appender.STDERR.layout=org.apache.log4j.PatternLayout
log4j.appender.STDERR.layout.ConversionPattern=%d{HH:mm:ss,SSS} [%t] %-5p %c{1} - %m%n
"""


# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class ZooKeeperOptions:
    """How to run each ZooKeeper node. Raises ValueError naming the bad option.

    ``zookeeper_home`` (else ``$ZOOKEEPER_HOME``, else Debian's jar) and ``java`` (else
    ``$JAVA_HOME/bin/java``, else ``java`` on PATH) choose the installation.
    ``port_picker`` returns candidate ports (default :func:`free_port`); tests use it to force
    a port that is already taken. ``start_attempts`` is how many sets of ports a start tries.
    ``client_address`` is where the client port listens: ``127.0.0.1`` (default) or
    ``0.0.0.0``, every address of the machine, so that clients in a network namespace reach the
    server through a veth pair; quorum and election ports stay on 127.0.0.1.
    ``init_limit_ticks`` and ``sync_limit_ticks`` are an ensemble's ``initLimit`` and
    ``syncLimit`` (in ticks of ``tick_time_ms``): a follower that hears nothing from its leader
    for ``sync_limit_ticks * tick_time_ms`` stops serving, and the leader drops a follower that
    is silent as long. ZooKeeper's minimum session timeout is its default, ``2 * tick_time_ms``.
    ``security``: SASL users, a TLS client port, the plain port on or off (see
    :class:`~celery_zklock.testing.security.ZooKeeperSecurity`); None (default): a plain port
    and nothing else, as before.
    """

    container_check_interval_ms: int = 300
    container_max_per_minute: int = 1_000_000
    tick_time_ms: int = 200
    max_session_timeout_ms: int = 60_000
    force_sync: bool = True
    extra_jvm_flags: tuple[str, ...] = ()
    zookeeper_home: str | os.PathLike[str] | None = None
    java: str | None = None
    port_picker: Callable[[], int] | None = field(default=None, compare=False)
    start_attempts: int = 3
    client_address: str = "127.0.0.1"
    init_limit_ticks: int = 10
    sync_limit_ticks: int = 5
    security: ZooKeeperSecurity | None = None

    def __post_init__(self) -> None:
        if self.security is not None and not isinstance(self.security, ZooKeeperSecurity):
            raise ValueError(f"security must be a ZooKeeperSecurity or None, got {self.security!r}")
        if self.client_address not in CLIENT_ADDRESSES:
            raise ValueError(
                f"client_address must be one of {', '.join(CLIENT_ADDRESSES)}, "
                f"got {self.client_address!r}"
            )
        for name in (
            "tick_time_ms",
            "max_session_timeout_ms",
            "container_check_interval_ms",
            "container_max_per_minute",
            "start_attempts",
            "init_limit_ticks",
            "sync_limit_ticks",
        ):
            positive_int(name, getattr(self, name))
        if self.max_session_timeout_ms < 2 * self.tick_time_ms:
            raise ValueError(
                f"max_session_timeout_ms ({self.max_session_timeout_ms}) must be at least "
                f"2 * tick_time_ms ({2 * self.tick_time_ms}), ZooKeeper's minimum session timeout"
            )
        if isinstance(self.extra_jvm_flags, str):
            raise ValueError("extra_jvm_flags must be a sequence of flags, not one string")
        object.__setattr__(self, "extra_jvm_flags", tuple(self.extra_jvm_flags))

    def pick_port(self) -> int:
        return (self.port_picker or free_port)()

    @property
    def tls(self) -> bool:
        """True if nodes serve a TLS client port."""
        return self.security is not None and self.security.tls

    @property
    def plain(self) -> bool:
        """True if nodes serve the plain client port."""
        return self.security is None or self.security.plain


@dataclass(frozen=True)
class _Runtime:
    java: str
    classpath: tuple[str, ...]


def _find_java(explicit: str | None) -> str:
    hint = "install it with `apt-get install -y default-jre-headless` (or set JAVA_HOME)"
    if explicit is not None:
        found = shutil.which(explicit)
        if found is None:
            raise MissingDependency(f"java {explicit!r} is not an executable: {hint}")
        return found
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise MissingDependency(f"java was not found on PATH: {hint}")
    return found


def _find_classpath(
    explicit: str | os.PathLike[str] | None, *, netty: bool = False
) -> tuple[str, ...]:
    home = explicit if explicit is not None else os.environ.get("ZOOKEEPER_HOME") or None
    if home is not None:
        root = Path(home)
        jars = sorted((root / "lib").glob("*.jar")) + sorted(root.glob("*.jar"))
        if not any(jar.name.startswith("zookeeper") for jar in jars):
            source = "zookeeper_home" if explicit is not None else "ZOOKEEPER_HOME"
            raise MissingDependency(
                f"{source}={str(root)!r} holds no ZooKeeper jars (looked for "
                f"{root}/lib/*.jar and {root}/*.jar): point it at an unpacked Apache ZooKeeper "
                "release, or unset it and `apt-get install -y zookeeper`"
            )
        return tuple(str(jar) for jar in jars)
    if not DEBIAN_ZOOKEEPER_JAR.is_file():
        raise MissingDependency(
            f"ZooKeeper was not found ({DEBIAN_ZOOKEEPER_JAR} is missing and ZOOKEEPER_HOME is "
            "not set): install it with `apt-get install -y zookeeper`"
        )
    debian = [DEBIAN_ZOOKEEPER_JAR]  # its manifest Class-Path pulls in its dependencies
    if DEBIAN_SLF4J_BINDING.is_file():
        debian.append(DEBIAN_SLF4J_BINDING)
    if netty:
        debian += [jar for jar in DEBIAN_NETTY_EXTRAS if jar.is_file()]
    return tuple(str(jar) for jar in debian)


def _find_runtime(options: ZooKeeperOptions) -> _Runtime:
    return _Runtime(
        java=_find_java(options.java),
        classpath=_find_classpath(options.zookeeper_home, netty=options.tls),
    )


def _mode_of(answer: str | None) -> str | None:
    return None if answer is None else four_letter.parse("srvr", answer).get("Mode")


# -------------------------------------------------------------------------------------- nodes


class ZooKeeperNode(ChildProcess):
    """One ZooKeeper process: its ports, its directory and (while it runs) its JVM.

    ``myid`` is the server id in an ensemble (1..N), or 1 for a standalone server.
    ``port`` is the client port: the plain one, or, when ``options.security`` switches the plain
    port off, the TLS one. ``secure_port`` is the TLS client port when ``options.security`` has
    TLS (required then, and equal to ``port`` or omitted with the plain port off), else None;
    ``material`` is the generated security material, required with ``options.security``; the
    node copies the files the server reads into its own directory (``security/``). The
    directory survives :meth:`stop` and a killed JVM, so that an ensemble can restart the node
    with the same data; :meth:`destroy` removes it.
    ``uid``: run the JVM under this numeric uid and gid (no passwd entry needed; its directory
    is given to it at launch) through ``setpriv``, which keeps the parent-death signal; needs
    root. None (default) runs it as we run.
    """

    directory: Path

    def __init__(
        self,
        myid: int,
        options: ZooKeeperOptions,
        *,
        port: int,
        quorum_port: int | None = None,
        election_port: int | None = None,
        uid: int | None = None,
        secure_port: int | None = None,
        material: SecurityMaterial | None = None,
    ) -> None:
        if options.tls:
            if not options.plain:
                if secure_port not in (None, port):
                    raise ValueError(
                        f"with the plain port off, port is the TLS port: secure_port "
                        f"({secure_port}) must be omitted or equal to port ({port})"
                    )
                secure_port = port
            elif secure_port is None or secure_port == port:
                raise ValueError("a node with TLS and plain ports needs a distinct secure_port")
        elif secure_port is not None:
            raise ValueError("secure_port is given but options.security has no TLS")
        if (options.security is None) != (material is None):
            raise ValueError("material must be given exactly when options.security is set")
        directory = make_temp_dir(f"zklock-zk{myid}-")
        super().__init__(
            f"ZooKeeper node {myid} (port {port})",
            [],
            log_path=directory / _LOG_FILE,
            cwd=directory,
            directory=directory,
        )
        self.myid = myid
        self.uid = uid
        self.port = port
        self.quorum_port = quorum_port
        self.election_port = election_port
        self.secure_port = secure_port
        self.material = material
        self._options = options
        self._probe_tls = material.tls_context() if material and options.tls else None
        self.data_dir = directory / "data"
        self.data_dir.mkdir()

    def __repr__(self) -> str:
        return f"<ZooKeeperNode myid={self.myid} port={self.port} pid={self.pid}>"

    def srvr(self, timeout: float = 1.0) -> str | None:
        """The node's answer to ``srvr``, or None if nothing answers on its client port.

        With TLS on, asked on the TLS port over TLS (the certificate is checked), else on the
        plain port.
        """
        if self._probe_tls is not None and self.secure_port is not None:
            return four_letter.ask(
                "127.0.0.1",
                self.secure_port,
                "srvr",
                timeout=timeout,
                tls=self._probe_tls,
                server_hostname=TLS_HOSTNAME,
            )
        return four_letter.ask("127.0.0.1", self.port, "srvr", timeout=timeout)

    def mode(self) -> str | None:
        """``standalone``/``leader``/``follower`` while the node serves, else None.

        Only an answer from our own JVM counts (see :meth:`owns_ports`).
        """
        if not self.is_running():
            return None
        mode = _mode_of(self.srvr())
        if mode is None or not self.owns_ports(mode):
            return None
        return mode

    def owns_ports(self, mode: str | None = None) -> bool:
        """True if our JVM listens on the client port (and election port; leader: quorum port)."""
        pid = self.pid
        return pid is not None and all(listener_is_owned_by(pid, p) for p in self._listeners(mode))

    def _listeners(self, mode: str | None) -> list[int]:
        """The ports our JVM listens on in ``mode``."""
        ports = [self.port]
        if self.secure_port is not None and self.secure_port != self.port:
            ports.append(self.secure_port)
        if self.election_port is not None:
            ports.append(self.election_port)
        if mode == "leader" and self.quorum_port is not None:
            ports.append(self.quorum_port)
        return ports

    def write_config(self, peers: Sequence[ZooKeeperNode] = ()) -> Path:
        """Write ``zoo.cfg`` (and ``myid`` when ``peers`` is given); return the config path."""
        opts = self._options
        lines = [f"tickTime={opts.tick_time_ms}", f"dataDir={self.data_dir}"]
        if opts.plain:
            lines += [f"clientPort={self.port}", f"clientPortAddress={opts.client_address}"]
        if self.material is not None:
            files = self._copy_security_files(self.material)
            lines += server_config_lines(
                self.material,
                files,
                secure_port=self.secure_port,
                address=opts.client_address,
            )
        lines += [
            "4lw.commands.whitelist=*",
            "admin.enableServer=false",
            f"maxSessionTimeout={opts.max_session_timeout_ms}",
            # Tests open hundreds of clients from 127.0.0.1; the default limit is 60 per address.
            "maxClientCnxns=0",
        ]
        if not opts.force_sync:
            lines.append("forceSync=no")
        if peers:
            lines += [f"initLimit={opts.init_limit_ticks}", f"syncLimit={opts.sync_limit_ticks}"]
            lines += [
                f"server.{peer.myid}=127.0.0.1:{peer.quorum_port}:{peer.election_port}"
                for peer in peers
            ]
            (self.data_dir / "myid").write_text(f"{self.myid}\n", encoding="ascii")
        config = self.directory / "zoo.cfg"
        config.write_text("\n".join(lines) + "\n", encoding="ascii")
        (self.directory / "logback.xml").write_text(_LOGBACK_XML, encoding="ascii")
        (self.directory / "log4j.properties").write_text(_LOG4J_PROPERTIES, encoding="ascii")
        return config

    def _copy_security_files(self, material: SecurityMaterial) -> Path:
        """Copy what the server reads into our directory (a JVM run under its own uid cannot
        read the material's private directory); return the copy's directory."""
        files = self.directory / "security"
        files.mkdir(mode=0o700, exist_ok=True)
        for path in material.server_files():
            shutil.copyfile(path, files / path.name)
        return files

    def launch(self, runtime: _Runtime) -> None:
        """Start the JVM on the written config; does not wait for it to serve."""
        opts = self._options
        argv = [
            runtime.java,
            *BASE_JVM_FLAGS,
            *os.environ.get(JVM_FLAGS_ENV, "").split(),
            f"-Dznode.container.checkIntervalMs={opts.container_check_interval_ms}",
            f"-Dznode.container.maxPerMinute={opts.container_max_per_minute}",
            # Logs go to stderr, which is appended to zookeeper.log in the node's directory,
            # whichever logging backend the installation has.
            f"-Dlogback.configurationFile={self.directory / 'logback.xml'}",
            f"-Dlog4j.configuration=file:{self.directory / 'log4j.properties'}",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            f"-Dzookeeper.log.dir={self.directory}",
            "-Dzookeeper.jmx.log4j.disable=true",
            *(
                server_jvm_flags(self.material, self.directory / "security")
                if self.material is not None
                else ()
            ),
            *opts.extra_jvm_flags,
            "-cp",
            os.pathsep.join(runtime.classpath),
            MAIN_CLASS,
            str(self.directory / "zoo.cfg"),
        ]
        if self.uid is not None:
            self._give_directory_to(self.uid)
            # setpriv execs the JVM (same pid); --pdeathsig=keep restores the parent-death signal
            # that changing the uid clears, so the JVM still dies with us.
            argv = [
                _find_setpriv(),
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--pdeathsig=keep",
                "--",
                *argv,
            ]
        self.argv = argv
        self.spawn()

    def _give_directory_to(self, uid: int) -> None:
        for root, dirs, files in os.walk(self.directory):
            for name in (*dirs, *files):
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
        os.chown(self.directory, uid, uid)

    def wait_serving(self, deadline: float, modes: Iterable[str] = SERVING_MODES) -> str:
        """Wait until the node serves in one of ``modes``; return the mode.

        Raises PortTaken when a port turned out to be taken by another program, and StackError
        when the JVM exits for another reason or ``deadline`` (monotonic) passes.
        """
        wanted = frozenset(modes)
        return self.wait_ready(
            deadline,
            lambda: _mode_of(self.srvr(timeout=0.5)),
            ports=[
                p
                for p in (self.port, self.secure_port, self.quorum_port, self.election_port)
                if p is not None
            ],
            bind_failure=_BIND_FAILURE_RE,
            listeners=self._listeners,
            accept=wanted.__contains__,
        )


# ------------------------------------------------------------------------------------ security


class _Secured(Service):
    """What a client needs to reach a server or ensemble started with ``security=``.

    The material is generated by :meth:`_make_material` at start, into a private directory
    that :meth:`_drop_material` (called by stop) removes. Every accessor raises StackError
    before start, or when the part is not secured in the way asked about.
    """

    options: ZooKeeperOptions
    _material: SecurityMaterial | None = None

    def _client_nodes(self) -> list[ZooKeeperNode]:
        raise NotImplementedError

    def _make_material(self) -> None:
        security = self.options.security
        if security is None:
            return
        directory = make_temp_dir("zklock-zksec-")
        try:
            self._material = generate_material(security, directory)
        except BaseException:
            remove_temp_dir(directory)
            raise

    def _drop_material(self) -> None:
        material, self._material = self._material, None
        if material is not None:
            remove_temp_dir(material.directory)

    def _plain_off(self) -> StackError:
        return StackError(
            f"{self.what} has no plain client port (ZooKeeperSecurity(plain=False)): "
            "connect with tls_hosts"
        )

    @property
    def security_material(self) -> SecurityMaterial:
        """Everything generated for this start (raises StackError before start or if not
        secured)."""
        if not self.is_started():
            raise self._not_started()
        if self._material is None:
            raise StackError(f"{self.what} was started without security=ZooKeeperSecurity(...)")
        return self._material

    def _tls_material(self) -> SecurityMaterial:
        material = self.security_material
        if not material.security.tls:
            raise StackError(f"{self.what} has no TLS port (ZooKeeperSecurity(tls=False))")
        return material

    @property
    def tls_hosts(self) -> str:
        """``localhost:PORT[,localhost:PORT...]``: the TLS client ports, under the one name the
        server certificate is valid for."""
        self._tls_material()
        return ",".join(f"{TLS_HOSTNAME}:{node.secure_port}" for node in self._client_nodes())

    @property
    def ca_file(self) -> Path:
        """PEM of the CA that signed the server certificate (trust it, and only it)."""
        path = self._tls_material().ca_file
        assert path is not None  # set whenever tls is
        return path

    @property
    def wrong_ca_file(self) -> Path:
        """PEM of an unrelated CA: a client trusting only it must fail to connect."""
        path = self._tls_material().wrong_ca_file
        assert path is not None
        return path

    @property
    def client_cert_file(self) -> Path:
        """PEM client certificate (``localhost``, ``127.0.0.1``) signed by :attr:`ca_file`'s
        CA, for ``client_auth`` ``want``/``need``."""
        path = self._tls_material().client_cert_file
        assert path is not None
        return path

    @property
    def client_key_file(self) -> Path:
        """PEM private key of :attr:`client_cert_file` (not encrypted)."""
        path = self._tls_material().client_key_file
        assert path is not None
        return path

    @property
    def sasl_users(self) -> dict[str, str]:
        """SASL DIGEST-MD5 user -> password (empty if SASL is off)."""
        return dict(self.security_material.sasl_users)


# ---------------------------------------------------------------------------------- standalone


class ZooKeeperServer(_Secured):
    """A standalone ZooKeeper server on 127.0.0.1, a child of this process.

    ``start`` returns once it serves (see the module docstring); ``stop`` returns once the JVM
    is gone and its directory removed. Options: see :class:`ZooKeeperOptions`. With
    ``security``, what a client needs is on the started server: :attr:`secure_port`,
    :attr:`tls_hosts`, :attr:`ca_file`, :attr:`wrong_ca_file`, :attr:`sasl_users`,
    :attr:`client_cert_file`/:attr:`client_key_file`, and :attr:`hosts` if the plain port is on.
    """

    what = "the ZooKeeper server"
    _child: ZooKeeperNode | None

    def __init__(
        self,
        *,
        container_check_interval_ms: int = 300,
        container_max_per_minute: int = 1_000_000,
        tick_time_ms: int = 200,
        max_session_timeout_ms: int = 60_000,
        force_sync: bool = True,
        extra_jvm_flags: Sequence[str] = (),
        zookeeper_home: str | os.PathLike[str] | None = None,
        java: str | None = None,
        port_picker: Callable[[], int] | None = None,
        start_attempts: int = 3,
        client_address: str = "127.0.0.1",
        security: ZooKeeperSecurity | None = None,
    ) -> None:
        self.options = ZooKeeperOptions(
            container_check_interval_ms=container_check_interval_ms,
            container_max_per_minute=container_max_per_minute,
            tick_time_ms=tick_time_ms,
            max_session_timeout_ms=max_session_timeout_ms,
            force_sync=force_sync,
            extra_jvm_flags=tuple(extra_jvm_flags),
            zookeeper_home=zookeeper_home,
            java=java,
            port_picker=port_picker,
            start_attempts=start_attempts,
            client_address=client_address,
            security=security,
        )
        self._child = None
        self._runtime: _Runtime | None = None

    def __repr__(self) -> str:
        state = f"port={self._child.port} pid={self.pid}" if self._child else "stopped"
        return f"<ZooKeeperServer {state}>"

    def is_started(self) -> bool:
        return self._child is not None

    def start(self, timeout: float = 30.0) -> ZooKeeperServer:
        """Start the server and wait until it serves; return self.

        Raises MissingDependency (java or ZooKeeper not installed), StackError (did not serve
        within ``timeout`` seconds, exited, or every attempt found its port taken; the message
        ends with the server's log), or StackError if it is already running.
        """
        self._refuse_restart()
        runtime = _find_runtime(self.options)
        opts = self.options

        def attempt(deadline: float) -> ZooKeeperNode:
            port = opts.pick_port()
            node = ZooKeeperNode(
                1,
                opts,
                port=port,
                secure_port=opts.pick_port() if opts.tls and opts.plain else None,
                material=self._material,
            )
            try:
                node.write_config()
                node.launch(runtime)
                node.wait_serving(deadline, modes={"standalone"})
            except BaseException:
                node.destroy()
                raise
            return node

        self._make_material()
        try:
            self._child = start_with_retries(
                "ZooKeeper server", self.options.start_attempts, timeout, attempt
            )
        except BaseException:
            self._drop_material()
            raise
        self._runtime = runtime
        return self

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to the server and wait until its process is gone; its port and data are
        kept for :meth:`restart` (an outage, as :meth:`ZooKeeperEnsemble.kill` for a member).

        Raises StackError if it is not running, or still alive ``timeout`` seconds after a
        signal that was not fatal.
        """
        node = self.node
        if not node.is_running():
            raise StackError(f"{self!r} is not running")
        node.send_signal(sig)
        if not node.wait(timeout):
            raise StackError(
                f"the ZooKeeper server (pid {node.pid}) is still running {timeout:.1f} s after "
                f"signal {signal.Signals(sig).name}; use SIGKILL"
            )

    def restart(self, timeout: float = 30.0) -> None:
        """Start the killed server again on the same port and data, and wait until it serves.

        Raises StackError if it is running, or does not serve within ``timeout`` seconds (the
        server is then stopped: for example another program took its port meanwhile).
        """
        node = self.node
        if node.is_running():
            raise StackError(f"{self!r} is running; kill() it before restart()")
        assert self._runtime is not None  # set by start, as node is
        node.launch(self._runtime)
        try:
            node.wait_serving(time.monotonic() + timeout, {"standalone"})
        except StackError as exc:
            node.stop()
            raise StackError(f"restart of the ZooKeeper server failed: {exc}") from exc

    def stop(self) -> None:
        """Stop the server and remove its directory (and the security material); returns once
        the JVM is gone. Idempotent."""
        node, self._child = self._child, None
        try:
            if node is not None:
                node.destroy()
        finally:
            self._drop_material()

    def _client_nodes(self) -> list[ZooKeeperNode]:
        return [self.node]

    @property
    def node(self) -> ZooKeeperNode:
        """The server's node (raises StackError before start)."""
        if self._child is None:
            raise self._not_started()
        return self._child

    @property
    def port(self) -> int:
        """The plain client port (raises StackError before start or with it off)."""
        node = self.node
        if not self.options.plain:
            raise self._plain_off()
        return node.port

    @property
    def hosts(self) -> str:
        """The plain connection string, ``127.0.0.1:PORT`` (raises StackError before start or
        with the plain port off)."""
        return f"127.0.0.1:{self.port}"

    @property
    def secure_port(self) -> int:
        """The TLS client port (raises StackError before start or without TLS)."""
        self._tls_material()
        port = self.node.secure_port
        assert port is not None  # every node of a TLS server has one
        return port


# ---------------------------------------------------------------------------------- partitions

_IPTABLES_TIMEOUT = 15.0
_CHAIN_PREFIX = "ZKL"
_MARK_SHIFT = 24  # connmark bits 24..30, one per member myid 1..7
_MAX_ISOLATABLE_MYID = 7
_UID_BASE = 0x40000000  # uids no account uses; each member gets its own random one


def _find_setpriv() -> str:
    found = shutil.which("setpriv")
    if found is None:
        raise MissingDependency(
            "setpriv (runs a ZooKeeper member under its own uid) was not found on PATH: "
            "install it with `apt-get install -y util-linux`"
        )
    return found


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``iptables -w <args>`` (filter table); raise StackError on failure if ``check``."""
    argv = ["iptables", "-w", "5", *args]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_IPTABLES_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and done.returncode != 0:
        raise StackError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _pid_namespace_tag() -> str:
    """Hex inode of our pid namespace: chains of dead pids are reaped only in our namespace."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:
        return "0"


@functools.cache
def _kernel_partition_problem() -> str | None:
    """Try the iptables rules a partition uses on a scratch chain; the error, or None."""
    chain = f"{_CHAIN_PREFIX}{_pid_namespace_tag()}-{os.getpid():x}-p{secrets.token_hex(2)}"
    rules = [
        ["-p", "tcp", "-m", "owner", "--uid-owner", str(_UID_BASE), "-m", "conntrack",
         "--ctorigdstport", "1", "-j", "CONNMARK", "--or-mark", f"{1 << _MARK_SHIFT:#x}"],
        ["-p", "tcp", "-m", "connmark", "--mark", f"{1 << _MARK_SHIFT:#x}/"
         f"{1 << _MARK_SHIFT:#x}", "-m", "conntrack", "--ctorigdstport", "1", "-j", "DROP"],
    ]  # fmt: skip
    try:
        _iptables("-N", chain)
    except StackError as exc:
        return f"iptables cannot create a chain here: {exc}"
    try:
        for rule in rules:
            _iptables("-A", chain, *rule)
    except StackError as exc:
        return f"the kernel refuses the owner/conntrack/connmark rules a partition needs: {exc}"
    finally:
        _iptables("-F", chain, check=False)
        _iptables("-X", chain, check=False)
    return None


def partition_unavailable_reason() -> str | None:
    """Why :meth:`ZooKeeperEnsemble.isolate` cannot work here, or None if it can.

    Needs root (iptables, and running members under other uids), the ``iptables`` program
    (Debian package ``iptables``; either backend, nf_tables or legacy, works), ``setpriv``
    (``util-linux``), and a kernel that accepts the ``owner``, ``conntrack`` and ``connmark``
    matches and the ``CONNMARK`` target in the filter table's OUTPUT chain (checked once per
    process on a scratch chain, which is removed again).
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "cutting a ZooKeeper member off needs root (iptables, other uids)"
    if shutil.which("iptables") is None:
        return "the `iptables` program is missing: apt-get install -y iptables"
    if shutil.which("setpriv") is None:
        return "the `setpriv` program is missing: apt-get install -y util-linux"
    return _kernel_partition_problem()


_live_firewalls: set[_Firewall] = set()
_firewalls_lock = threading.Lock()
_firewall_atexit_installed = False


def _remove_live_firewalls() -> None:
    with _firewalls_lock:
        firewalls = list(_live_firewalls)
    for firewall in firewalls:
        firewall.remove()


def _reap_stale_chains() -> None:
    """Remove chains left by processes of our pid namespace that died without cleaning up."""
    prefix = f"{_CHAIN_PREFIX}{_pid_namespace_tag()}-"
    listing = _iptables("-S", check=False).stdout
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0] != "-N" or not parts[1].startswith(prefix):
            continue
        pid_hex = parts[1][len(prefix) :].split("-", 1)[0]
        try:
            pid = int(pid_hex, 16)
        except ValueError:
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _drop_chain(parts[1])


def _drop_chain(chain: str) -> None:
    """Unhook ``chain`` from OUTPUT (every jump), flush and delete it; ignores a missing one."""
    for _ in range(100):
        if _iptables("-D", "OUTPUT", "-j", chain, check=False).returncode != 0:
            break
    _iptables("-F", chain, check=False)
    _iptables("-X", chain, check=False)


class _Firewall:
    """The iptables chain of one ensemble: cuts isolated members off from the others.

    One chain per ensemble, ``ZKL<pid namespace>-<pid>-<random>``, jumped to first from the
    filter table's OUTPUT chain (every packet between local processes passes OUTPUT, so one
    chain sees both directions). It only ever matches this ensemble's quorum and election
    connections, so ensembles of parallel runs never touch each other's traffic:

    * always, for each isolatable member k (its JVM runs under its own uid U_k): a packet that
      U_k sends on a connection it opened to another member's quorum or election port marks
      that connection (conntrack mark bit k, ``CONNMARK --or-mark``);
    * while k is isolated: DROP every packet of a connection with mark bit k opened to another
      member's quorum or election port (k's connections to the others, both directions), and
      every packet of a connection opened to k's quorum or election port (the others'
      connections to k, both directions, new ones included). The ports name this ensemble: a
      parallel run's member k marks its own connections with the same bit.

    Client connections are never matched: k's client port keeps serving its clients.
    """

    def __init__(self, members: dict[int, int], nodes: Sequence[ZooKeeperNode]) -> None:
        self.members = dict(members)  # myid -> uid
        self.nodes = list(nodes)
        self.chain = f"{_CHAIN_PREFIX}{_pid_namespace_tag()}-{os.getpid():x}-{secrets.token_hex(3)}"
        self.isolated: set[int] = set()
        self._installed = False
        self._lock = threading.Lock()

    @staticmethod
    def _peer_ports(node: ZooKeeperNode) -> list[int]:
        return [p for p in (node.quorum_port, node.election_port) if p is not None]

    def _mark_rules(self) -> list[list[str]]:
        rules: list[list[str]] = []
        for myid, uid in sorted(self.members.items()):
            for other in self.nodes:
                if other.myid == myid:
                    continue
                for port in self._peer_ports(other):
                    rules.append(
                        ["-p", "tcp", "-m", "owner", "--uid-owner", str(uid),
                         "-m", "conntrack", "--ctorigdstport", str(port),
                         "-j", "CONNMARK", "--or-mark", self._bit(myid)]
                    )  # fmt: skip
        return rules

    def _drop_rules(self, myid: int) -> list[list[str]]:
        # The mark bit is k's in every ensemble's chain: a parallel run's member k marks its
        # connections with the same bit, so the rule also names this ensemble's ports.
        bit = self._bit(myid)
        rules: list[list[str]] = []
        for other in self.nodes:
            if other.myid == myid:
                continue
            for port in self._peer_ports(other):
                rules.append(
                    ["-p", "tcp", "-m", "connmark", "--mark", f"{bit}/{bit}",
                     "-m", "conntrack", "--ctorigdstport", str(port), "-j", "DROP"]
                )  # fmt: skip
        node = next(n for n in self.nodes if n.myid == myid)
        for port in self._peer_ports(node):
            rules.append(
                ["-p", "tcp", "-m", "conntrack", "--ctorigdstport", str(port), "-j", "DROP"]
            )
        return rules

    @staticmethod
    def _bit(myid: int) -> str:
        return f"{1 << (_MARK_SHIFT + myid - 1):#x}"

    def install(self) -> None:
        """Create the chain with its marking rules and hook it into OUTPUT."""
        global _firewall_atexit_installed
        with _firewalls_lock:
            if not _firewall_atexit_installed:
                atexit.register(_remove_live_firewalls)
                _firewall_atexit_installed = True
            _live_firewalls.add(self)
        _reap_stale_chains()
        with self._lock:
            self._installed = True
            try:
                _iptables("-N", self.chain)
                for rule in self._mark_rules():
                    _iptables("-A", self.chain, *rule)
                _iptables("-I", "OUTPUT", "1", "-j", self.chain)
            except BaseException:
                self._remove_locked()
                raise

    def isolate(self, myid: int) -> None:
        """Drop member ``myid``'s quorum and election traffic, both ways (idempotent)."""
        with self._lock:
            if not self._installed:
                raise StackError("the ensemble's partition rules are not installed")
            if myid in self.isolated:
                return
            for rule in self._drop_rules(myid):
                _iptables("-A", self.chain, *rule)
            self.isolated.add(myid)

    def heal(self, myid: int) -> None:
        """Remove member ``myid``'s drop rules (idempotent)."""
        with self._lock:
            if myid not in self.isolated:
                return
            for rule in self._drop_rules(myid):
                _iptables("-D", self.chain, *rule, check=False)
            self.isolated.discard(myid)

    def remove(self) -> None:
        """Unhook and delete the chain (idempotent)."""
        with self._lock:
            self._remove_locked()

    def _remove_locked(self) -> None:
        if self._installed:
            _drop_chain(self.chain)
            self._installed = False
            self.isolated.clear()
        with _firewalls_lock:
            _live_firewalls.discard(self)


# ----------------------------------------------------------------------------------- ensemble


def _modes(nodes: Sequence[ZooKeeperNode]) -> dict[int, str | None]:
    return {node.myid: node.mode() for node in nodes}


def _log_tails(nodes: Sequence[ZooKeeperNode]) -> str:
    return "\n".join(
        f"--- node {node.myid} (running: {node.is_running()}) ---\n{node.log_tail(15)}"
        for node in nodes
    )


def _wait_ensemble_serving(nodes: Sequence[ZooKeeperNode], deadline: float) -> None:
    """Wait until every running node of ``nodes`` reports a mode and one of them leads."""
    started = time.monotonic()
    while True:
        modes = {node.myid: node.mode() for node in nodes if node.is_running()}
        if modes and None not in modes.values() and "leader" in modes.values():
            return
        if time.monotonic() >= deadline:
            raise StackError(
                f"the ZooKeeper ensemble was not serving within {deadline - started:.1f} s; "
                f"modes: {_modes(nodes)}\n{_log_tails(nodes)}"
            )
        time.sleep(0.02)


class ZooKeeperEnsemble(_Secured):
    """An N-node ZooKeeper ensemble on 127.0.0.1 (``size >= 2``), every node a child of ours.

    ``start`` returns once every node serves and a leader exists. Nodes can be killed and
    restarted (same ports, same data) to test failover. ``stop`` returns once every JVM is gone
    and every directory removed. Options: see :class:`ZooKeeperOptions`.

    Partitions: ``isolatable`` (``True`` for every member, or a collection of myids) runs those
    members' JVMs under their own random uids, so that :meth:`isolate` can cut one of them off
    from the other members - quorum and election traffic, both directions, existing and new
    connections, packets silently dropped - while its client port stays reachable by clients.
    It uses one iptables chain per ensemble (see :class:`_Firewall`), removed by :meth:`stop`
    (also when start fails), at interpreter exit, and, if this process died without either, by
    the next ensemble that installs a chain in this pid namespace. Requirements:
    :func:`partition_unavailable_reason`; ``start`` raises :class:`MissingDependency` or
    :class:`StackError` with that reason when they are not met. Up to myid 7.

    ``security``: as for :class:`ZooKeeperServer` (every member the same; one CA and server
    certificate for all); :attr:`tls_hosts` lists every member's TLS port.
    """

    what = "the ZooKeeper ensemble"

    def __init__(
        self,
        size: int = 3,
        *,
        container_check_interval_ms: int = 300,
        container_max_per_minute: int = 1_000_000,
        tick_time_ms: int = 200,
        max_session_timeout_ms: int = 60_000,
        force_sync: bool = True,
        extra_jvm_flags: Sequence[str] = (),
        zookeeper_home: str | os.PathLike[str] | None = None,
        java: str | None = None,
        port_picker: Callable[[], int] | None = None,
        start_attempts: int = 3,
        client_address: str = "127.0.0.1",
        init_limit_ticks: int = 10,
        sync_limit_ticks: int = 5,
        isolatable: bool | Collection[int] = False,
        security: ZooKeeperSecurity | None = None,
    ) -> None:
        if size < 2:
            raise ValueError(f"an ensemble needs size >= 2, got {size}; use ZooKeeperServer")
        self.size = size
        wanted = set(range(1, size + 1)) if isolatable is True else set(isolatable or ())
        if not wanted <= set(range(1, size + 1)):
            raise ValueError(f"isolatable myids must be in 1..{size}, got {sorted(wanted)}")
        if wanted and max(wanted) > _MAX_ISOLATABLE_MYID:
            raise ValueError(f"only myids 1..{_MAX_ISOLATABLE_MYID} can be isolatable")
        self.isolatable: frozenset[int] = frozenset(wanted)
        """The myids that run under their own uid, the ones :meth:`isolate` accepts."""
        self.options = ZooKeeperOptions(
            container_check_interval_ms=container_check_interval_ms,
            container_max_per_minute=container_max_per_minute,
            tick_time_ms=tick_time_ms,
            max_session_timeout_ms=max_session_timeout_ms,
            force_sync=force_sync,
            extra_jvm_flags=tuple(extra_jvm_flags),
            zookeeper_home=zookeeper_home,
            java=java,
            port_picker=port_picker,
            start_attempts=start_attempts,
            client_address=client_address,
            init_limit_ticks=init_limit_ticks,
            sync_limit_ticks=sync_limit_ticks,
            security=security,
        )
        self._nodes: list[ZooKeeperNode] = []
        self._runtime: _Runtime | None = None
        self._firewall: _Firewall | None = None

    def __repr__(self) -> str:
        if not self._nodes:
            return f"<ZooKeeperEnsemble size={self.size} stopped>"
        return f"<ZooKeeperEnsemble {self.hosts} pids={[n.pid for n in self._nodes]}>"

    def start(self, timeout: float = 30.0) -> ZooKeeperEnsemble:
        """Start every node and wait until all serve and a leader exists; return self.

        Raises MissingDependency, or StackError (as :meth:`ZooKeeperServer.start`).
        """
        self._refuse_restart()
        runtime = _find_runtime(self.options)
        uids: dict[int, int] = {}
        if self.isolatable:
            _find_setpriv()
            reason = partition_unavailable_reason()
            if reason is not None:
                raise StackError(f"isolatable ZooKeeper members cannot be run: {reason}")
            while len(set(uids.values())) < len(self.isolatable):
                uids = {m: _UID_BASE + secrets.randbelow(0x3FFF0000) for m in self.isolatable}

        def attempt(deadline: float) -> list[ZooKeeperNode]:
            opts = self.options
            pick = opts.pick_port
            nodes: list[ZooKeeperNode] = []
            firewall: _Firewall | None = None
            try:
                for myid in range(1, self.size + 1):
                    nodes.append(
                        ZooKeeperNode(
                            myid,
                            opts,
                            port=pick(),
                            quorum_port=pick(),
                            election_port=pick(),
                            uid=uids.get(myid),
                            secure_port=pick() if opts.tls and opts.plain else None,
                            material=self._material,
                        )
                    )
                if uids:
                    # Before the JVMs start: every member connection is tracked and marked.
                    firewall = _Firewall(uids, nodes)
                    self._firewall = firewall
                    firewall.install()
                for node in nodes:
                    node.write_config(nodes)
                for node in nodes:
                    node.launch(runtime)
                for node in nodes:
                    node.wait_serving(deadline, {"leader", "follower"})
                _wait_ensemble_serving(nodes, deadline)
            except BaseException:
                for node in nodes:
                    node.send_signal(signal.SIGTERM)
                for node in nodes:
                    node.destroy()
                if firewall is not None:
                    firewall.remove()
                    self._firewall = None
                raise
            return nodes

        self._make_material()
        try:
            self._nodes = start_with_retries(
                f"ZooKeeper ensemble of {self.size}", self.options.start_attempts, timeout, attempt
            )
        except BaseException:
            self._drop_material()
            raise
        self._runtime = runtime
        return self

    def stop(self) -> None:
        """Stop every node and remove their directories; returns once all JVMs are gone.

        Also heals every partition, removes the ensemble's iptables chain and the security
        material. Idempotent.
        """
        nodes, self._nodes = self._nodes, []
        firewall, self._firewall = self._firewall, None
        try:
            for node in nodes:
                node.send_signal(signal.SIGTERM)  # all at once: the stops overlap, not add up
            for node in nodes:
                node.destroy()
        finally:
            try:
                if firewall is not None:
                    firewall.remove()
            finally:
                self._drop_material()

    def _client_nodes(self) -> list[ZooKeeperNode]:
        if not self._nodes:
            raise self._not_started()
        return list(self._nodes)

    def is_started(self) -> bool:
        return bool(self._nodes)

    def is_running(self) -> bool:
        """True while every node's JVM runs."""
        return bool(self._nodes) and all(node.is_running() for node in self._nodes)

    def isolate(self, myid: int) -> None:
        """Cut member ``myid`` off from every other member; its client port stays reachable.

        From return on, every packet between ``myid`` and the other members' quorum and
        election ports, both directions, on existing and new connections, is dropped silently
        (no reset). Clients connected to ``myid`` keep their connection: the member keeps
        answering them (pings, reads) until it notices the silence itself - a follower after
        ``sync_limit_ticks * tick_time_ms`` without its leader - and then stops serving and
        drops them; the leader, meanwhile, stops counting it after the same time. Idempotent.
        Raises ValueError if ``myid`` is not in :attr:`isolatable`, StackError if the ensemble
        is not started or iptables fails.
        """
        self._partition_firewall(myid).isolate(myid)

    def heal(self, myid: int) -> None:
        """Undo :meth:`isolate` for ``myid`` (idempotent); the member rejoins by itself.

        Returns once the rules are gone, not once the member serves again: wait with
        :meth:`wait_serving` for that.
        """
        if self._firewall is not None:
            self._partition_firewall(myid).heal(myid)

    @property
    def isolated(self) -> frozenset[int]:
        """The myids currently cut off by :meth:`isolate`."""
        return frozenset(self._firewall.isolated) if self._firewall is not None else frozenset()

    @property
    def firewall_chain(self) -> str | None:
        """Name of this ensemble's iptables chain (filter table) while it exists, else None."""
        return self._firewall.chain if self._firewall is not None else None

    def _partition_firewall(self, myid: int) -> _Firewall:
        if myid not in self.isolatable:
            raise ValueError(
                f"ZooKeeper member {myid} is not isolatable (isolatable: "
                f"{sorted(self.isolatable)}); pass isolatable=... to the ensemble"
            )
        if self._firewall is None or not self._nodes:
            raise self._not_started()
        return self._firewall

    @property
    def nodes(self) -> list[ZooKeeperNode]:
        """The nodes, ordered by myid (1..N); empty before start."""
        return list(self._nodes)

    def node(self, myid: int) -> ZooKeeperNode:
        """The node with that myid; raises StackError if there is none."""
        for node in self._nodes:
            if node.myid == myid:
                return node
        raise StackError(
            f"no ZooKeeper node with myid {myid} (started: {[n.myid for n in self._nodes]})"
        )

    @property
    def hosts(self) -> str:
        """``127.0.0.1:p1,127.0.0.1:p2,...``: the plain client ports (raises StackError before
        start or with the plain port off)."""
        if not self._nodes:
            raise self._not_started()
        if not self.options.plain:
            raise self._plain_off()
        return ",".join(f"127.0.0.1:{node.port}" for node in self._nodes)

    def leader(self, timeout: float = 10.0) -> int:
        """The myid of the current leader: polls ``srvr`` until a running node says ``leader``.

        Raises StackError if no node does within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            for node in self._nodes:
                if node.mode() == "leader":
                    return node.myid
            if time.monotonic() >= deadline:
                raise StackError(
                    f"no leader within {timeout:.1f} s; modes: {_modes(self._nodes)}\n"
                    + _log_tails(self._nodes)
                )
            time.sleep(0.02)

    def wait_serving(self, timeout: float) -> None:
        """Wait until every running node reports a mode and a leader exists.

        Raises StackError with every node's mode and log tail after ``timeout`` seconds.
        """
        _wait_ensemble_serving(self._nodes, time.monotonic() + timeout)

    def kill(self, myid: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to node ``myid`` and wait until its process is gone.

        The node's directory is kept for :meth:`restart`. Raises StackError if the node is not
        running or still alive after ``timeout`` seconds (e.g. ``sig`` was not fatal).
        """
        node = self.node(myid)
        if not node.is_running():
            raise StackError(f"ZooKeeper node {myid} is not running")
        node.send_signal(sig)
        if not node.wait(timeout):
            raise StackError(
                f"ZooKeeper node {myid} (pid {node.pid}) is still running {timeout:.1f} s after "
                f"signal {signal.Signals(sig).name}; use SIGKILL"
            )

    def restart_stopped(self, timeout: float = 30.0) -> list[int]:
        """Start every member that is not running again (same ports, same data), all at once,
        and wait until the ensemble serves; return their myids. Unlike :meth:`restart`, this
        brings back an ensemble that lost its quorum (one member alone would wait for the
        others). Raises StackError if it does not serve within ``timeout`` seconds.
        """
        if self._runtime is None:
            raise self._not_started()
        stopped = [node for node in self._nodes if not node.is_running()]
        for node in stopped:
            node.launch(self._runtime)
        _wait_ensemble_serving(self._nodes, time.monotonic() + timeout)
        return [node.myid for node in stopped]

    def restart(self, myid: int, timeout: float = 30.0) -> None:
        """Start node ``myid`` again (same ports, same data) and wait until it serves.

        Raises StackError if it is running, exits, or does not serve within ``timeout`` seconds
        (for example because another program took one of its ports meanwhile).
        """
        node = self.node(myid)
        if node.is_running():
            raise StackError(f"ZooKeeper node {myid} is running; kill() it before restart()")
        if self._runtime is None:
            raise self._not_started()
        node.launch(self._runtime)
        try:
            node.wait_serving(time.monotonic() + timeout, {"leader", "follower"})
        except StackError as exc:
            node.stop()
            raise StackError(f"restart of ZooKeeper node {myid} failed: {exc}") from exc
