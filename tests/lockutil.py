"""Helpers shared by the lock tests: server-side session expiry, polling, 4lw queries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.task.interrupt import _MainThreadSignal
from celery_zklock.zk import four_letter as four_letter_client
from celery_zklock.zk.settings import host_ports


def expire_session(hosts: str, client: KazooClient) -> None:
    """Expire ``client``'s session on the server (its ephemeral nodes vanish at once).

    A second client attaches to the same session and closes it: the real server-side expiry,
    not kazoo's client-side simulation.
    """
    session_id, password = client.client_id
    expire_session_id(hosts, session_id, password)


def expire_session_id(hosts: str, session_id: int, password: bytes, attempts: int = 20) -> None:
    """Expire the session ``session_id`` on the server (see :func:`expire_session`), and make
    sure it is gone: a twin that finds the session still there closes it, and the next twin
    must be refused it (the server then gives it a new session).

    One close is not always enough: attaching the twin drops the owner's connection, and the
    owner's client may reconnect to its session before the twin's close goes out, dropping the
    twin's connection instead (its close then never reached the server, once in CI).
    """
    for _ in range(attempts):
        twin = KazooClient(hosts, client_id=(session_id, password))
        twin.start(timeout=15)
        try:
            if twin.client_id[0] != session_id:
                return  # refused: the server no longer knows the session
        finally:
            twin.stop()
            twin.close()
    raise AssertionError(f"session {session_id:#x} still open after {attempts} closes")


WAIT_FLOOR = 30.0
"""Least seconds :func:`wait_for` waits. Its bounds are on events in other processes (a
worker's log line, a node going), never what a test measures: under load (CI, or two suites
side by side) a pool respawn or a redelivery takes several times its usual second, and a
shorter bound only turns that into a failure. A predicate that never comes true still fails.

So a ``wait_for`` bound is never a test's claim: "released at once" written as a 2 s wait would
pass a release 29 s late. A claim of promptness is asserted by the order of events instead (the
release's log line before the task's failure line, a node's zxid below another's), with
``wait_for`` only as the hang guard; durations belong in the benchmarks."""


def wait_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until true; fail the test with ``what`` after ``timeout`` seconds
    (at least :data:`WAIT_FLOOR`): a hang guard, not a bound the test asserts."""
    timeout = max(timeout, WAIT_FLOOR)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def let_interruption_land() -> None:
    """Run bytecode with calls in it (where CPython handles signals and async exceptions) until
    an interruption already fired has been handled: a signal once its handler took it (it may
    reach another thread first), an async exception at once."""
    for _ in range(1000):
        abs(0)
    wait_for(lambda: not _MainThreadSignal._pending, what="the signal to be handled")


def children(client: KazooClient, path: str) -> list[str]:
    """The sorted children of ``path``; [] if it is not there. One request, not an ``exists``
    then a listing: an empty lock's parent is a container, which the server may reap between
    the two (a listing then failed with NoNodeError once, at double load)."""
    try:
        return sorted(client.get_children(path))
    except NoNodeError:
        return []


def four_letter(hosts: str, word: str) -> str:
    """Send a ZooKeeper four-letter word to the first host of ``hosts``; return the answer.
    Raises AssertionError naming the host and the word if it does not answer or refuses."""
    host, port = host_ports(hosts)[0]
    answer = four_letter_client.ask(host, port, word, timeout=5.0)
    if answer is None:
        raise AssertionError(f"no answer to {word!r} from {host}:{port}: is ZooKeeper up there?")
    if four_letter_client.refused(answer):
        raise AssertionError(
            f"{host}:{port} refuses {word!r}: add it to the server's 4lw.commands.whitelist"
        )
    return answer


def watches_by_path(hosts: str) -> dict[str, list[str]]:
    """``wchp``: the sessions watching each path."""
    result: dict[str, list[str]] = {}
    current = None
    for line in four_letter(hosts, "wchp").splitlines():
        if line.startswith("/"):
            current = line.strip()
            result[current] = []
        elif line.strip().startswith("0x") and current is not None:
            result[current].append(line.strip())
    return result


def app_with(conf: Mapping[str, Any]) -> Any:
    """An app as celery-zklock's settings see it: its ``conf`` alone (a dict will do). Keep it
    while its settings are in use: :func:`~celery_zklock.zk.settings.settings_of` holds the
    app weakly."""
    return type("App", (), {"conf": conf})()


def task_client(task: Any) -> KazooClient:
    """The kazoo client the locked runs of ``task`` use in this process."""
    from celery_zklock.zk.client import get_client
    from celery_zklock.zk.settings import settings_of

    return get_client(settings_of(task.app).client)


def in_thread(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target()`` in a daemon thread; the dict gets its ``"value"`` or its ``"error"``
    (any exception, for the test to inspect)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except BaseException as exc:  # the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
