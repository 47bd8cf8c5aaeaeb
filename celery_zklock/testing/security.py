"""Security for a local ZooKeeper: what to switch on, and the material generated for it.

:class:`ZooKeeperSecurity` says what a server (or every member of an ensemble) runs with, given
as ``ZooKeeperServer(security=...)``/``ZooKeeperOptions(security=...)``:

* **digest** authentication (``add_auth("digest", "user:password")``, digest ACLs) is built into
  ZooKeeper and always on; nothing here switches it off.
* **SASL DIGEST-MD5** for the users of ``sasl_users``: a JAAS file with a ``Server`` section
  (``DigestLoginModule``, one ``user_<name>="<password>"`` per user) is passed to the JVM, and
  ``authProvider.1`` registers ZooKeeper's ``SASLAuthenticationProvider`` (ACL scheme ``sasl``).
  A client whose SASL login fails is disconnected (``AUTH_FAILED``).
* a **TLS client port** (Netty): a CA and a server certificate for ``DNS:localhost`` only (no IP
  address, so that a client connecting to ``127.0.0.1`` with hostname checking on gets a
  hostname mismatch), made with ``openssl`` for this start; ``client_auth`` says whether the
  server asks clients for a certificate (a client certificate for ``localhost`` and
  ``127.0.0.1``, signed by the same CA, is generated too). A second CA that signed nothing
  (``wrong_ca_file``) lets tests check that an untrusted CA fails.
* the **plain client port** can be switched off (``plain=False``): only the TLS port listens.

:func:`generate_material` writes the files into a private directory and returns them as a
:class:`SecurityMaterial`; :func:`server_config_lines` and :func:`server_jvm_flags` are what a
node adds to its ``zoo.cfg`` and java command line.
"""

from __future__ import annotations

import re
import secrets
import shutil
import ssl
import subprocess
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from celery_zklock.testing.processes import MissingDependency, StackError

__all__ = [
    "CLIENT_AUTH_MODES",
    "SecurityMaterial",
    "ZooKeeperSecurity",
    "generate_material",
    "server_config_lines",
    "server_jvm_flags",
]

CLIENT_AUTH_MODES = ("none", "want", "need")
"""ZooKeeper's ``ssl.clientAuth`` values: never ask for a client certificate, ask, require."""
TLS_HOSTNAME = "localhost"
"""The only name the server certificate is valid for."""
SASL_MECHANISM = "DIGEST-MD5"
SASL_PROVIDER = "org.apache.zookeeper.server.auth.SASLAuthenticationProvider"
NETTY_FACTORY = "org.apache.zookeeper.server.NettyServerCnxnFactory"
CERT_DAYS = 30
_OPENSSL_TIMEOUT = 30.0
# JAAS option names are StreamTokenizer words; its quoted strings treat `"` and `\` specially.
_USER_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_PASSWORD_RE = re.compile(r"[\x20-\x7e]{1,256}")
_PASSWORD_FORBIDDEN = frozenset('"\\')
_DEFAULT_SASL_USERS: Mapping[str, str | None] = types.MappingProxyType({"alice": None, "bob": None})


def _default_sasl_users() -> Mapping[str, str | None]:
    return _DEFAULT_SASL_USERS


@dataclass(frozen=True)
class ZooKeeperSecurity:
    """What a secured ZooKeeper runs with (see the module docstring). Raises ValueError naming
    the bad option.

    ``tls``: serve a TLS client port (the server's ``secure_port``). ``plain``: serve the plain
    client port as well; ``tls`` or ``plain`` must be on. ``sasl_users``: SASL DIGEST-MD5 users,
    name -> password, where None means a random password generated at start (read it back
    from the started server's ``sasl_users``); empty: no SASL. Names are letters, digits and
    ``_`` starting with a letter; passwords printable ASCII without ``"`` and ``\\``.
    ``client_auth``: ``none`` (default: clients need no certificate), ``want`` or ``need``;
    only with ``tls``. Default: TLS and plain ports, SASL users ``alice`` and ``bob`` with
    generated passwords.
    """

    tls: bool = True
    plain: bool = True
    sasl_users: Mapping[str, str | None] = field(default_factory=_default_sasl_users, hash=False)
    client_auth: str = "none"

    def __post_init__(self) -> None:
        if not (self.tls or self.plain):
            raise ValueError("ZooKeeperSecurity needs tls or plain on: no client port would listen")
        if self.client_auth not in CLIENT_AUTH_MODES:
            raise ValueError(
                f"client_auth must be one of {', '.join(CLIENT_AUTH_MODES)}, "
                f"got {self.client_auth!r}"
            )
        if self.client_auth != "none" and not self.tls:
            raise ValueError(f"client_auth={self.client_auth!r} needs tls=True")
        if isinstance(self.sasl_users, (str, bytes)) or not isinstance(self.sasl_users, Mapping):
            raise ValueError(
                "sasl_users must be a mapping of user name -> password (None: generate one), "
                f"got {self.sasl_users!r}"
            )
        for name, password in self.sasl_users.items():
            if not isinstance(name, str) or not _USER_RE.fullmatch(name):
                raise ValueError(
                    f"SASL user name {name!r} must be letters, digits and _ starting with a "
                    "letter (at most 64)"
                )
            if password is not None and (
                not isinstance(password, str)
                or not _PASSWORD_RE.fullmatch(password)
                or _PASSWORD_FORBIDDEN & set(password)
            ):
                raise ValueError(
                    f"the password of SASL user {name!r} must be 1..256 printable ASCII "
                    'characters without " and \\ (or None to generate one)'
                )
        # An immutable copy: the caller's dict may change after this.
        object.__setattr__(self, "sasl_users", types.MappingProxyType(dict(self.sasl_users)))


@dataclass(frozen=True)
class SecurityMaterial:
    """The files and credentials :func:`generate_material` made for one start.

    Paths are absolute. The TLS files are None without ``tls``; ``jaas_file`` is None without
    SASL users. ``sasl_users`` maps every SASL user to its (given or generated) password.
    """

    security: ZooKeeperSecurity
    directory: Path
    sasl_users: Mapping[str, str] = field(hash=False)
    jaas_file: Path | None = None
    ca_file: Path | None = None
    """PEM of the CA that signed the server and client certificates."""
    wrong_ca_file: Path | None = None
    """PEM of a CA that signed nothing here: trusting only it must fail."""
    keystore_file: Path | None = None
    """The server's key and certificate chain, PEM (ZooKeeper's ``ssl.keyStore.type=PEM``)."""
    client_cert_file: Path | None = None
    client_key_file: Path | None = None

    def server_files(self) -> list[Path]:
        """The files the server reads (copied into each node's own directory)."""
        files = [self.jaas_file, self.keystore_file, self.ca_file]
        return [path for path in files if path is not None]

    def tls_context(self) -> ssl.SSLContext:
        """A client context that trusts only :attr:`ca_file`, checks the hostname and offers
        the client certificate. Raises StackError without TLS."""
        if self.ca_file is None or self.client_cert_file is None or self.client_key_file is None:
            raise StackError("this ZooKeeper has no TLS port (ZooKeeperSecurity(tls=False))")
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.client_cert_file), str(self.client_key_file))
        return context


def _find_openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise MissingDependency(
            "openssl (makes the TLS certificates of a secured ZooKeeper) was not found on PATH: "
            "install it with `apt-get install -y openssl`"
        )
    return found


def _openssl(openssl: str, *args: str, cwd: Path) -> None:
    argv = [openssl, *args]
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_OPENSSL_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise StackError(
            f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )


def _self_signed_ca(openssl: str, directory: Path, name: str, common_name: str) -> None:
    _openssl(
        openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", str(CERT_DAYS),
        "-subj", f"/CN={common_name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


def _signed_leaf(
    openssl: str, directory: Path, name: str, *, usage: str, alt_names: str, serial: int
) -> None:
    extensions = directory / f"{name}.ext"
    extensions.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        f"subjectAltName={alt_names}\n",
        encoding="ascii",
    )
    _openssl(
        openssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={TLS_HOSTNAME}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        openssl, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-set_serial", str(serial), "-days", str(CERT_DAYS), "-extfile", extensions.name,
        "-out", f"{name}.pem",
        cwd=directory,
    )  # fmt: skip


def _jaas(users: Mapping[str, str]) -> str:
    options = "".join(f'\n    user_{name}="{password}"' for name, password in users.items())
    module = "org.apache.zookeeper.server.auth.DigestLoginModule"
    return f"Server {{\n    {module} required{options};\n}};\n"


def generate_material(security: ZooKeeperSecurity, directory: Path) -> SecurityMaterial:
    """Write what ``security`` needs into ``directory`` (which must exist and be private).

    Generates the missing SASL passwords (``secrets.token_urlsafe``) and the JAAS file; with
    ``tls``, runs ``openssl`` (a P-256 CA, a server certificate for ``DNS:localhost`` only, a
    client certificate for ``localhost``/``127.0.0.1``, both valid for ``CERT_DAYS`` days, and
    an unrelated CA). Raises MissingDependency without ``openssl``, StackError if it fails.
    """
    users = {name: pw or secrets.token_urlsafe(18) for name, pw in security.sasl_users.items()}
    jaas_file = None
    if users:
        jaas_file = directory / "jaas.conf"
        jaas_file.write_text(_jaas(users), encoding="ascii")
    if not security.tls:
        return SecurityMaterial(
            security, directory, types.MappingProxyType(users), jaas_file=jaas_file
        )
    openssl = _find_openssl()
    _self_signed_ca(openssl, directory, "ca", "celery-zklock test CA")
    _self_signed_ca(openssl, directory, "wrong-ca", "celery-zklock unrelated CA")
    _signed_leaf(
        openssl, directory, "server", usage="serverAuth", alt_names=f"DNS:{TLS_HOSTNAME}", serial=2
    )
    _signed_leaf(
        openssl,
        directory,
        "client",
        usage="clientAuth",
        alt_names=f"DNS:{TLS_HOSTNAME},IP:127.0.0.1",
        serial=3,
    )
    keystore = directory / "server-keystore.pem"
    keystore.write_text(
        "".join((directory / name).read_text("ascii") for name in ("server.key", "server.pem")),
        encoding="ascii",
    )
    return SecurityMaterial(
        security,
        directory,
        types.MappingProxyType(users),
        jaas_file=jaas_file,
        ca_file=directory / "ca.pem",
        wrong_ca_file=directory / "wrong-ca.pem",
        keystore_file=keystore,
        client_cert_file=directory / "client.pem",
        client_key_file=directory / "client.key",
    )


def server_config_lines(
    material: SecurityMaterial, files: Path, *, secure_port: int | None, address: str
) -> list[str]:
    """The ``zoo.cfg`` lines for ``material``, its server files found in ``files`` (a node's
    copy, see :meth:`SecurityMaterial.server_files`); ``secure_port`` is required with TLS."""
    lines: list[str] = []
    if material.jaas_file is not None:
        lines.append(f"authProvider.1={SASL_PROVIDER}")
    if material.security.tls:
        if secure_port is None or material.keystore_file is None or material.ca_file is None:
            raise ValueError("a TLS ZooKeeper node needs a secure_port and TLS material")
        lines += [
            f"serverCnxnFactory={NETTY_FACTORY}",
            f"secureClientPort={secure_port}",
            f"secureClientPortAddress={address}",
            f"ssl.keyStore.location={files / material.keystore_file.name}",
            "ssl.keyStore.type=PEM",
            f"ssl.trustStore.location={files / material.ca_file.name}",
            "ssl.trustStore.type=PEM",
            f"ssl.clientAuth={material.security.client_auth}",
        ]
    return lines


def server_jvm_flags(material: SecurityMaterial, files: Path) -> list[str]:
    """The java options for ``material`` (the JAAS file, from ``files``, when there is SASL)."""
    if material.jaas_file is None:
        return []
    return [f"-Djava.security.auth.login.config={files / material.jaas_file.name}"]
