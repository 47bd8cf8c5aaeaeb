"""Network namespaces for partition faults: a worker cut off from ZooKeeper, not from Redis.

A :class:`Namespace` joins the host by two veth pairs in a ``10.254.N.0/24`` block no address
or route of the host uses (Redis link: host 10.254.N.1 <-> 10.254.N.2; ZooKeeper link: host
10.254.N.5 <-> 10.254.N.6). A process run with :meth:`Namespace.argv` reaches Redis and
ZooKeeper at the host ends (:meth:`Namespace.rehost`; they must listen there).
:meth:`Namespace.cut` takes the ZooKeeper link down, :meth:`Namespace.blackhole` silently drops
its packets, :meth:`Namespace.heal` undoes either; why two kinds: ``docs/fleet.md``. Needs root
and iproute2 (:func:`unavailable_reason`), the black hole also ``iptables``
(:func:`blackhole_unavailable_reason`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Namespace", "NetnsError", "blackhole_unavailable_reason", "unavailable_reason"]

_BLOCK_PREFIX = "10.254"
_IP_TIMEOUT = 15.0
_blocks_in_use: set[int] = set()
_blocks_lock = threading.Lock()


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and what it printed."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None if they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` program is missing: apt-get install -y iproute2"
    return None


def blackhole_unavailable_reason() -> str | None:
    """Why :meth:`Namespace.blackhole` cannot work here (no namespaces, no ``iptables``), or
    None if it can."""
    reason = unavailable_reason()
    if reason is None and shutil.which("iptables") is None:
        reason = "the `iptables` program is missing: apt-get install -y iptables"
    return reason


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


#: What ``ip link delete`` says of a link that is gone: before its lookup, or after it.
_LINK_GONE = ("Cannot find device", "No such device")


def _pick_block() -> int:
    """A block number N whose 10.254.N.0/24 no host address or route touches."""
    text = _ip("-4", "-o", "addr", "show") + _ip("-4", "route", "show", "table", "all")
    taken = {int(n) for n in re.findall(rf"\b{re.escape(_BLOCK_PREFIX)}\.(\d+)\.", text)}
    with _blocks_lock:
        free = [n for n in range(1, 255) if n not in taken and n not in _blocks_in_use]
        if not free:
            raise NetnsError(f"every {_BLOCK_PREFIX}.N.0/24 block is in use on this host")
        block = free[secrets.randbelow(len(free))]
        _blocks_in_use.add(block)
        return block


@dataclass
class Namespace:
    """One namespace and its two links; create with :meth:`create`, remove with :meth:`delete`."""

    tag: str
    block: int
    cut_now: bool = False
    blackholed_now: bool = False

    @property
    def name(self) -> str:
        return f"zklock-{self.tag}"

    @property
    def links(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """``(host end, namespace end)`` of the Redis link and of the ZooKeeper link."""
        return (f"zr{self.tag}h", f"zr{self.tag}n"), (f"zz{self.tag}h", f"zz{self.tag}n")

    @property
    def redis_address(self) -> str:
        """The host's address on the Redis link, as seen from inside the namespace."""
        return f"{_BLOCK_PREFIX}.{self.block}.1"

    @property
    def zookeeper_address(self) -> str:
        """The host's address on the ZooKeeper link, as seen from inside the namespace."""
        return f"{_BLOCK_PREFIX}.{self.block}.5"

    @classmethod
    def create(cls, label: str = "") -> Namespace:
        """Make a namespace with both links up; raises NetnsError (and leaves nothing behind).

        ``label`` (letters and digits) goes into the names, to tell namespaces apart in ``ip``.
        """
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        # Interface names are at most 15 characters: 2 + 4 + up to 6 + 1.
        tag = re.sub(r"[^a-z0-9]", "", label.lower())[:6] + secrets.token_hex(2)
        block = _pick_block()
        namespace = cls(tag=tag, block=block)
        try:
            namespace._build()
        except BaseException:
            namespace.delete()
            raise
        return namespace

    def _build(self) -> None:
        base = f"{_BLOCK_PREFIX}.{self.block}"
        _ip("netns", "add", self.name)
        _ip("-n", self.name, "link", "set", "lo", "up")
        (redis_host, redis_ns), (zk_host, zk_ns) = self.links
        links = (
            (redis_host, redis_ns, f"{base}.1/30", f"{base}.2/30"),
            (zk_host, zk_ns, f"{base}.5/30", f"{base}.6/30"),
        )
        for host_end, ns_end, host_address, ns_address in links:
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", self.name)
            _ip("addr", "add", host_address, "dev", host_end)
            _ip("link", "set", host_end, "up")
            _ip("-n", self.name, "addr", "add", ns_address, "dev", ns_end)
            _ip("-n", self.name, "link", "set", ns_end, "up")
        self._wait_link_up(deadline=time.monotonic() + 5.0)

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the namespace (``ip netns exec`` execs it: the pid is kept)."""
        return ["ip", "netns", "exec", self.name, *command]

    def rehost(self, url_or_hosts: str) -> str:
        """A Redis URL or ZooKeeper connection string with 127.0.0.1/localhost replaced by the
        host's address on the matching link."""
        if "://" in url_or_hosts:
            parts = urlsplit(url_or_hosts)
            host = parts.hostname or ""
            if host not in ("127.0.0.1", "localhost"):
                return url_or_hosts
            netloc = parts.netloc.replace(host, self.redis_address, 1)
            return urlunsplit(parts._replace(netloc=netloc))
        hosts, slash, chroot = url_or_hosts.partition("/")
        entries = []
        for entry in hosts.split(","):
            host, _, port = entry.strip().rpartition(":")
            if host in ("127.0.0.1", "localhost"):
                host = self.zookeeper_address
            entries.append(f"{host}:{port}")
        return ",".join(entries) + slash + chroot

    def cut(self) -> None:
        """Set the host end of the ZooKeeper link down: packets are dropped both ways, with no
        reset (an open connection sees silence); a new connection fails after about a second
        ("No route to host"). The Redis link keeps working."""
        _ip("link", "set", self.links[1][0], "down")
        self.cut_now = True

    def blackhole(self) -> None:
        """Drop every packet of the ZooKeeper link, both ways, with the link up: open and new
        connections alike see nothing at all. The rules sit in ``INPUT`` on both ends (one in
        ``OUTPUT`` would make the sender's kernel report ``EPERM``). Raises NetnsError (with
        nothing left behind) if a rule cannot be added."""
        try:
            for argv in self._drop_rules("-I"):
                _run(argv)
        except NetnsError:
            self._remove_drop_rules()
            raise
        self.blackholed_now = True

    def heal(self, timeout: float = 5.0) -> None:
        """Undo :meth:`cut` and :meth:`blackhole`; returns once the link carries traffic again
        (NetnsError if not)."""
        self._remove_drop_rules()
        self.blackholed_now = False
        _ip("link", "set", self.links[1][0], "up")
        self._wait_link_up(deadline=time.monotonic() + timeout)
        self.cut_now = False

    def _drop_rules(self, action: str) -> list[list[str]]:
        """The ``iptables`` commands that add (``-I``) or delete (``-D``) the black hole."""
        host_end, ns_end = self.links[1]
        return [
            ["iptables", "-w", "5", action, "INPUT", "-i", host_end, "-j", "DROP"],
            self.argv(["iptables", "-w", "5", action, "INPUT", "-i", ns_end, "-j", "DROP"]),
        ]

    def _remove_drop_rules(self) -> None:
        """Delete the black hole's rules, every copy of them; a missing rule (or a namespace
        already gone) is fine."""
        for argv in self._drop_rules("-D"):
            for _ in range(8):
                try:
                    _run(argv)
                except NetnsError:
                    break

    def _wait_link_up(self, deadline: float) -> None:
        while True:
            ns_end = self.links[1][1]
            state = _ip("-n", self.name, "-o", "link", "show", ns_end)
            flags = re.search(r"<([^>]*)>", state)
            if flags and "LOWER_UP" in flags.group(1).split(","):
                return
            if time.monotonic() >= deadline:
                raise NetnsError(f"link {ns_end} in {self.name} is not up: {state}")
            time.sleep(0.02)

    def delete(self) -> None:
        """Remove the namespace and both links (their host ends go with it), and the black
        hole's host rule if it is still there. Idempotent."""
        try:
            if shutil.which("iptables") is not None:
                self._remove_drop_rules()
            names = _ip("netns", "list")
            if re.search(rf"^{re.escape(self.name)}\b", names, re.MULTILINE):
                _ip("netns", "delete", self.name)
            for host_end, _ in self.links:
                try:
                    _ip("link", "delete", host_end)
                except NetnsError as exc:
                    # Deleting the namespace destroys the pair, a moment later: the link is
                    # gone before ip looks it up, or between its lookup and its delete.
                    if not any(gone in str(exc) for gone in _LINK_GONE):
                        raise
        finally:
            with _blocks_lock:
                _blocks_in_use.discard(self.block)
