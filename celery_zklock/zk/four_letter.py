"""ZooKeeper's four-letter words (``srvr``, ``conf``, ``mntr``, ``cons``, ``wchp``, ...): the
one client that asks them and the one reader of their answers, for ``celery zklock doctor``,
the local stack, the fault rig, the benchmarks and the tests.

A word is sent on a connection of its own to the client port (over TLS when given a context)
and the answer is what the server writes before closing it. :func:`ask` bounds each step
(connect, TLS handshake, each read) by a socket timeout and answers None for "nobody answered":
a closed or refusing port, a failed handshake, a server that stays silent. A server that
answers but does not run the word (not in its ``4lw.commands.whitelist``) says so in text,
which :func:`refused` recognises; the caller then names the host, the word and the whitelist.
"""

from __future__ import annotations

import re
import socket
import ssl
from typing import Final

#: Seconds each step of :func:`ask` waits by default.
TIMEOUT: Final = 3.0
#: Bytes of an answer read at most (``wchp`` of a busy server is the longest).
MAX_ANSWER: Final = 1 << 20
_REFUSED: Final = re.compile(r"is not executed because it is not in the whitelist", re.I)
# srvr, stat, ... write "Key: value"; mntr's values (zk_version) and conf's (server.1) hold colons.
_SEPARATORS: Final = {"mntr": "\t", "conf": "=", "envi": "="}


def ask(
    host: str,
    port: int,
    word: str,
    *,
    timeout: float = TIMEOUT,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> str | None:
    """The answer of ``host:port`` to the four-letter word ``word``, or None if nobody answered:
    the connect, the TLS handshake and each read wait at most ``timeout`` seconds. With
    ``tls``, the word goes over TLS with that context, the certificate checked against
    ``server_hostname`` (default ``host``) if the context checks hostnames. At most
    :data:`MAX_ANSWER` bytes are read; a refusal (:func:`refused`) is an answer, not None."""
    answer = bytearray()
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            hostname = server_hostname or host
            sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=hostname)
            with sock:
                sock.sendall(word.encode("ascii"))
                while len(answer) < MAX_ANSWER and (chunk := sock.recv(65536)):
                    answer += chunk
    except ssl.SSLEOFError:
        if not answer:  # a TLS peer that closes without close_notify has still answered
            return None
    except OSError:  # ssl.SSLError and socket.timeout included
        return None
    return answer.decode("utf-8", "replace")


def refused(answer: str) -> bool:
    """True if ``answer`` says the server did not run the word because it is not in its
    ``4lw.commands.whitelist`` (ZooKeeper >= 3.5 answers so rather than closing)."""
    return _REFUSED.search(answer) is not None


def parse(word: str, answer: str) -> dict[str, str]:
    """The key/value lines of ``word``'s answer, keys and values stripped: ``mntr``'s
    ``key<TAB>value``, ``conf``'s and ``envi``'s ``key=value``, the ``Key: value`` lines of
    the others (``srvr``'s ``Zookeeper version``, ``Mode``, ...). A line without the separator
    is left out; the first separator of a line splits it."""
    lines = (line.partition(_SEPARATORS.get(word, ":")) for line in answer.splitlines())
    return {key.strip(): value.strip() for key, sep, value in lines if sep}
