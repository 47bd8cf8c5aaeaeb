"""``celery -A proj zklock ...``: operate celery-zklock's locks with the app's own settings.

Installed as a ``celery.commands`` entry point, so the app (``-A``), its ``zklock_*`` settings
and ``ZKLOCK_*`` environment are the ones the workers use. Sub-commands:

- ``locks [--task NAME] [--json]``: every lock under ``zklock_root``, its holders and waiters
  (:mod:`celery_zklock.ops.commands.render` documents the JSON).
- ``holder TASK [--args JSON] [--kwargs JSON] [--json]``: the lock a call would take (the task's
  own key builder) and who holds it.
- ``break PATH [--yes] [--timeout S] [--force] [--reason TEXT]``: make a stuck holder let go; its
  run ends with LockLost before the lock is granted to anyone else (see :func:`break_`).
- ``doctor``: checks of the server against the settings (:mod:`celery_zklock.ops.commands.checks`).

Every break is logged on the ``celery_zklock.ops.commands`` logger, naming who ran it.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final, NoReturn, TypeVar

import click
from celery import states
from celery.bin.base import CeleryCommand, CeleryOption
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError

from celery_zklock.errors import ConfigurationError, ZkLockError
from celery_zklock.locks.contenders import Contender, parse_child, queue_of
from celery_zklock.locks.holders import LockState, breakable, read_lock, request_break
from celery_zklock.ops.commands import checks
from celery_zklock.ops.commands.render import (
    held_document,
    held_table,
    locks_document,
    locks_table,
    name_and_key,
)
from celery_zklock.ops.holders import read_locks
from celery_zklock.task.delivery import wait_gone
from celery_zklock.task.task import ZkLockTask
from celery_zklock.worker.gate.step import held_messages
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result
from celery_zklock.zk.client import new_client, tls_problem
from celery_zklock.zk.settings import ClientConfig, Settings, settings_of

__all__ = ["zklock"]

logger = logging.getLogger("celery_zklock.commands")
# The commands print every step themselves; their log records are for the logging an app
# configured. Without this handler, Python's last resort would print each record to stderr, a
# second copy of what the command just printed.
logger.addHandler(logging.NullHandler())

BREAK_GRACE: Final = 5.0
"""Seconds added to twice the session timeout for ``break``'s default wait."""
OUTCOME_WAIT: Final = 3.0
"""Seconds ``break`` waits for the result backend to show how a broken run ended."""
EXIT_NOT_RELEASED: Final = 1

F = TypeVar("F", bound=Callable[..., Any])


# -- plumbing -----------------------------------------------------------------------------------


def _app(ctx: click.Context) -> tuple[Any, Settings]:
    """The app of ``-A`` with its tasks loaded, and its settings (a bad one ends the command)."""
    app = ctx.obj.app
    app.loader.import_default_modules()  # the tasks of `-A proj`, as `celery report` loads them
    try:
        return app, settings_of(app)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _option(group: str, *names: str, **kwargs: Any) -> Callable[[F], F]:
    """A ``click.option`` shown under ``group`` in the command's help, as Celery's own are."""
    return click.option(*names, cls=CeleryOption, help_group=group, **kwargs)


@contextmanager
def _connected(config: ClientConfig) -> Iterator[KazooClient]:
    """A client of our own for ``config`` (not the process's shared one), stopped after; a
    ZooKeeper failure in the block ends the command with its message (exit 1)."""
    adapter.install_connect_hook()
    client = new_client(config)
    try:
        client.start(timeout=config.connect_timeout)
    except Exception as exc:
        client.close()
        problem = tls_problem(config) if config.use_ssl else None
        raise click.ClickException(
            problem or f"could not connect to ZooKeeper at {config.hosts!r}: {exc!r}"
        ) from None
    try:
        yield client
    except (ZkLockError, KazooException) as exc:
        raise click.ClickException(f"ZooKeeper at {config.hosts}: {exc!r}") from exc
    finally:
        client.stop()
        client.close()


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(message, err=True)
    raise click.exceptions.Exit(code)


def _locked_task(app: Any, name: str) -> ZkLockTask:
    task = app.tasks.get(name)
    if not isinstance(task, ZkLockTask):
        known = sorted(n for n, t in app.tasks.items() if isinstance(t, ZkLockTask))
        what = "is not a ZkLockTask" if task is not None else "is not a task of this app"
        raise click.BadParameter(f"{name!r} {what}; locked tasks: {', '.join(known) or 'none'}")
    return task


def _lock_names(app: Any) -> dict[str, str]:
    """Task name -> lock name, for every locked task of ``app``."""
    return {
        name: type(task)._zklock_compile(task.name).options.name
        for name, task in app.tasks.items()
        if isinstance(task, ZkLockTask)
    }


def _lock_name(app: Any, name: str, client: KazooClient, root: str) -> str:
    """A task's lock name (its ``lock_name``, default the task name); a lock name as given
    when one of the app's locked tasks uses it or it exists under ``root`` (another app's, a
    recipe's). Anything else is a usage error naming it: a misspelt task would otherwise
    read as "no locks held"."""
    if not name or "/" in name or name in (".", ".."):
        raise click.BadParameter(
            f"{name!r}: a lock name is one znode path segment (not empty, '.' or '..', no '/')",
            param_hint="'--task'",
        )
    known = _lock_names(app)
    if name in known:
        return known[name]
    path = f"{root}/{name}"
    if name in known.values() or _answer(client.exists_async(path), f"looking up {path}"):
        return name
    what = "is not a ZkLockTask" if name in app.tasks else "is not a task of this app"
    raise click.BadParameter(
        f"{name!r} {what}, nor a lock name under {root}; locked tasks: "
        f"{', '.join(sorted(known)) or 'none'}",
        param_hint="'--task'",
    )


def _json_value(text: str | None, kind: type, option: str) -> Any:
    if text is None:
        return kind()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"{option}: not JSON ({exc})") from None
    if not isinstance(value, kind):
        expected = "array" if kind is list else "object"
        raise click.BadParameter(f"{option}: expected a JSON {expected}")
    return value


# -- the group ----------------------------------------------------------------------------------


@click.group(name="zklock")
@click.pass_context
def zklock(ctx: click.Context, /, **_: Any) -> None:
    """Inspect and operate celery-zklock locks, with this app's zklock settings."""


@zklock.command(cls=CeleryCommand)
@_option(
    "Locks Options", "--task", "names", multiple=True,
    help="Only the locks of this task (or lock name); repeatable.",
)  # fmt: skip
@_option(
    "Locks Options", "--json", "as_json", is_flag=True,
    help="A JSON document (stable; see docs/operating.md) instead of the table.",
)  # fmt: skip
@click.pass_context
def locks(ctx: click.Context, /, names: Sequence[str], as_json: bool, **_: Any) -> None:
    """Every lock under zklock_root: mode, holders (task id, task, worker, pid, fencing token,
    held for) and waiters in the order they will be granted; then the messages the workers'
    gates hold until their lock can be granted (task id, task, worker, held for, position in
    its worker's line), per lock."""
    app, settings = _app(ctx)
    lock_names = None
    with _connected(settings.client) as client:
        if names:
            lock_names = sorted({_lock_name(app, n, client, settings.root) for n in names})
        states = read_locks(client, settings.root, names=lock_names)
    held = [
        h for h in held_messages(app)
        if lock_names is None or name_and_key(settings.root, h.path)[0] in lock_names
    ]  # fmt: skip
    now = time.time()
    if as_json:
        document = locks_document(settings.root, states, now)
        document["held"] = held_document(held)
        click.echo(json.dumps(document, indent=2))
    else:
        click.echo(locks_table(states, now))
        if held:
            click.echo(f"\n{held_table(held)}")


@zklock.command(cls=CeleryCommand)
@click.argument("task_name", metavar="TASK")
@_option(
    "Call Options", "--args", "args_json", metavar="JSON",
    help='Positional arguments of the call, a JSON array: --args \'[42, "eu"]\'.',
)  # fmt: skip
@_option(
    "Call Options", "--kwargs", "kwargs_json", metavar="JSON",
    help='Keyword arguments of the call, a JSON object: --kwargs \'{"full": true}\'.',
)  # fmt: skip
@_option(
    "Call Options", "--json", "as_json", is_flag=True,
    help="The lock as the JSON document of `locks --json`.",
)  # fmt: skip
@click.pass_context
def holder(
    ctx: click.Context,
    /,
    task_name: str,
    args_json: str | None,
    kwargs_json: str | None,
    as_json: bool,
    **_: Any,
) -> None:
    """The lock path a call of TASK with these arguments takes, and who holds it."""
    app, settings = _app(ctx)
    task = _locked_task(app, task_name)
    args = _json_value(args_json, list, "--args")
    kwargs = _json_value(kwargs_json, dict, "--kwargs")
    try:
        path = task.lock_path(*args, **kwargs)
    except (ZkLockError, TypeError, ValueError) as exc:
        raise click.BadParameter(f"these arguments make no lock key: {exc}") from None
    with _connected(settings.client) as client:
        state = read_lock(client, path)
    now = time.time()
    if as_json:
        click.echo(json.dumps(locks_document(settings.root, [state], now), indent=2))
        return
    click.echo(f"lock: {path}")
    click.echo(locks_table([state], now) if state.entries else "free: nobody holds or waits")


# -- break --------------------------------------------------------------------------------------


def operator() -> str:
    """Who runs the command: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _holders_at(client: KazooClient, path: str) -> tuple[LockState, list[Contender]]:
    """The lock at ``path`` and the holders to break: all of them for a lock path, the one
    node for a contender node's path (which must hold)."""
    state = read_lock(client, path)
    if state.entries:
        return state, list(state.holders)
    parent, _, name = path.rpartition("/")
    if parent and parse_child(name) is not None and queue_of([name]):
        state = read_lock(client, parent)
        entry = next((e for e in state.entries if e.name == name), None)
        if entry is None:
            _fail(f"{path}: no such contender node (released already?)")
        if entry not in state.holders:
            _fail(f"{path} is waiting, not holding: there is nothing to break")
        return state, [entry]
    _fail(f"{path}: no lock here (no contender node under it)")


def _describe(entry: Contender, now: float) -> str:
    identity = entry.identity
    who = (
        f"task {identity.task_id} ({identity.task}) on {identity.worker} pid {identity.pid}"
        if breakable(entry.name, entry.identity)
        else "a holder that is not a celery-zklock contender"
    )
    return f"{who}, token {entry.token}, held for {entry.age(now):.1f}s"


@zklock.command(name="break", cls=CeleryCommand)
@click.argument("path")
@_option("Break Options", "--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_option(
    "Break Options", "--timeout", type=float, default=None,
    help="Seconds to wait for the holder to let go [default: 2 x session timeout + 5].",
)  # fmt: skip
@_option(
    "Break Options", "--force", is_flag=True,
    help="If the holder does not let go in time, delete its node: the next waiter may then be "
    "granted while the stuck run is still inside (only fencing tokens protect you then).",
)  # fmt: skip
@_option(
    "Break Options", "--reason", default=None,
    help="Why: written into the node, the holder's lost event and the log.",
)  # fmt: skip
@click.pass_context
def break_(
    ctx: click.Context,
    /,
    path: str,
    yes: bool,
    timeout: float | None,
    force: bool,
    reason: str | None,
    **_: Any,
) -> None:
    """Make the holder of the lock PATH (or of the contender node PATH) let go.

    The command writes a break request into the holder's own node. The holder's lease clock
    reads its node, with a watch, once the lease has been held for a renewal interval (T/8):
    a request is seen at that read or, later, at once through the watch. The lease then counts
    as lost: the run is interrupted and ends with LockLost, and its release deletes the node;
    only then is the next waiter granted. The command waits for the node to go and tells how
    the run ended. A run hung where the interruption cannot reach does not let go: with --force
    its node is deleted after the wait (the waiter may then run while the stuck run is still
    inside). A paused process hears nothing; its node goes when its session expires.
    Exit status: 0 once every holder let go (or was deleted with --force), 1 otherwise.
    """
    app, settings = _app(ctx)
    by = operator()
    with _connected(settings.client) as client:
        state, targets = _holders_at(client, path)
        now = time.time()
        session_timeout = adapter.negotiated_timeout(client) or settings.client.session_timeout
        wait = timeout if timeout is not None else 2 * session_timeout + BREAK_GRACE
        click.echo(f"lock {state.path}: {len(state.waiters)} waiting")
        for entry in targets:
            click.echo(f"  holder: {_describe(entry, now)}")
        if not yes:
            click.confirm(
                "Interrupt the holder's run (it ends with LockLost) and let the next waiter in "
                "once it let go?",
                abort=True,
            )
        pending, deaf = _request_breaks(client, state, targets, by, reason, force)
        if pending:
            click.echo(f"waiting up to {wait:g}s for the holder to let go...")
            runs = {f"{state.path}/{e.name}": e.identity.task_id for e in targets}
            pending = _await_release(app, client, pending, runs, wait, by)
        if pending and force:
            _force_delete(client, pending, by)
            pending = []
    if deaf:
        _fail(
            "not broken: a holder that is not a celery-zklock contender cannot hear a break "
            "request; "
            "--force deletes its node now (it may still be inside its critical section)",
            EXIT_NOT_RELEASED,
        )
    if pending:
        for node in pending:
            logger.warning("zklock break: %s did not let go within %gs (by %s)", node, wait, by)
        _fail(
            f"the holder did not let go within {wait:g}s: its process may be paused or hung in "
            "code the interruption cannot reach. Look at the worker; --force deletes its node "
            "(the next waiter may then be granted while the stuck run is still inside).",
            EXIT_NOT_RELEASED,
        )


def _request_breaks(
    client: KazooClient,
    state: LockState,
    targets: Sequence[Contender],
    by: str,
    reason: str | None,
    force: bool,
) -> tuple[list[str], list[str]]:
    """Write the break requests. Returns the nodes to wait for, and those of holders that
    cannot hear a request (not celery-zklock runs), which --force deletes at once instead."""
    pending: list[str] = []
    deaf: list[str] = []
    for entry in targets:
        node = f"{state.path}/{entry.name}"
        try:
            outcome = request_break(client, node, by, reason)
        except NoAuthError:
            _fail(
                f"{node}: this identity may not write the holder's node (ACL); run the command "
                "with the workers' credentials (zklock_auth / zklock_sasl)"
            )
        if outcome.status == "gone":
            click.echo(f"{node}: already released")
        elif outcome.status == "foreign":
            click.echo(f"{node}: not a celery-zklock contender, it cannot hear a break request")
            if force:
                _force_delete(client, [node], by)
            else:
                deaf.append(node)
        else:
            if outcome.status == "already":
                click.echo(f"{node}: a break was already requested by {outcome.by}")
            logger.warning(
                "zklock break requested: node=%s token=%s task_id=%s task=%s worker=%s pid=%s "
                "by=%s reason=%s",
                node, entry.token, entry.identity.task_id, entry.identity.task,
                entry.identity.worker, entry.identity.pid, by, reason,
            )  # fmt: skip
            pending.append(node)
    return pending, deaf


def _await_release(
    app: Any,
    client: KazooClient,
    nodes: Sequence[str],
    runs: Mapping[str, str | None],
    wait: float,
    by: str,
) -> list[str]:
    """Wait (all together, ``wait`` seconds) for ``nodes`` to go and tell how each run ended
    (``runs``: node -> task id); the nodes still there."""
    started = time.monotonic()
    left = []
    for node in nodes:
        if _answer(client.exists_async(node), f"looking up {node}"):
            remaining = max(0.0, wait - (time.monotonic() - started))
            if not (remaining > 0 and wait_gone(client, node, remaining)):
                left.append(node)
                continue
        took = time.monotonic() - started
        ended = run_outcome(app, runs.get(node))
        click.echo(f"{node}: released after {took:.2f}s; {ended}")
        logger.warning("zklock break: %s released after %.2fs (by %s); %s", node, took, by, ended)
    return left


def run_outcome(app: Any, task_id: str | None, wait: float = OUTCOME_WAIT) -> str:
    """How the run ``task_id`` ended, from the app's result backend (its run stores the result
    just after the release); never waits longer than ``wait`` seconds, whatever the backend."""
    if task_id is None:
        return "the holder is not a task run"
    found: list[str] = []

    def look() -> None:
        try:
            result = app.AsyncResult(task_id)
            deadline = time.monotonic() + wait
            while result.state not in states.READY_STATES | {states.RETRY}:
                if time.monotonic() >= deadline:
                    found.append(f"its run's state is still {result.state}")
                    return
                time.sleep(0.05)
            if result.state == states.FAILURE:
                error = result.result
                found.append(f"its run ended FAILURE: {type(error).__name__}: {error}")
            else:
                found.append(f"its run ended {result.state}")
        except Exception as exc:  # no result backend, or it does not answer
            found.append(f"how its run ended is unknown ({type(exc).__name__})")

    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    looker.join(wait + 1.0)
    return found[0] if found else "how its run ended is unknown (the result backend is slow)"


def _answer(result: Any, what: str) -> Any:
    """ZooKeeper's answer to a command's request, within ``checks.REQUEST_TIMEOUT`` seconds
    (ZooKeeperUnavailable, naming ``what``, after that)."""
    return wait_result(result, Deadline(checks.REQUEST_TIMEOUT), what)


def _force_delete(client: KazooClient, nodes: Sequence[str], by: str) -> None:
    for node in nodes:
        try:
            _answer(client.delete_async(node), f"deleting {node}")
        except NoNodeError:
            click.echo(f"{node}: gone meanwhile")
            continue
        except NoAuthError:
            _fail(f"{node}: this identity may not delete it (ACL of the lock's node)")
        click.echo(
            f"{node}: DELETED by force. The next waiter may now be granted while the stuck run "
            "is still inside its body: only a resource that checks fencing tokens refuses its "
            "late writes (the next holder's token is higher)."
        )
        logger.warning("zklock break: %s deleted by force (by %s)", node, by)


# -- doctor -------------------------------------------------------------------------------------


@zklock.command(cls=CeleryCommand)
@click.pass_context
def doctor(ctx: click.Context, /, **_: Any) -> None:
    """Check the ZooKeeper ensemble against this app's settings: negotiated session timeout,
    server version and mode, container nodes, ACL and auth, the lease clock's assumptions.
    Exit status 1 if any check FAILs."""
    app = ctx.obj.app
    names = checks.setting_name_checks(app.conf)  # first: each misspelt name said here, once
    try:
        settings = settings_of(app)
    except ConfigurationError as exc:
        click.echo(checks.report([*names, checks.Check("FAIL", "settings", str(exc))]))
        raise click.exceptions.Exit(1) from None
    config = settings.client
    read = (
        f"hosts {config.hosts}, root {settings.root}, session timeout requested "
        f"{config.session_timeout:g}s"
    )
    found = [*names, checks.Check("PASS", "settings", read), checks.gate_bound_check(app)]
    try:
        with _connected(config) as client:
            found.append(checks.Check("PASS", "connect", checks.connected_detail(client)))
            # One session per pool process and one for the worker's main process (its gate).
            sessions = (app.conf.worker_concurrency or os.cpu_count() or 1) + 1
            found += checks.run_checks(client, settings.root, config, sessions)
    except click.ClickException as exc:
        found.append(checks.Check("FAIL", "connect", exc.message))
    click.echo(checks.report(found))
    if checks.failed(found):
        raise click.exceptions.Exit(1)
