"""The ``celery-zklock`` command line: the library's own commands.

``celery-zklock stack up [--zk-nodes N] [--no-redis] [--secure]`` runs ZooKeeper (and Redis)
in the foreground, prints ``export ZKLOCK_HOSTS=...`` / ``export ZKLOCK_BROKER_URL=...`` lines and
waits; SIGINT (Ctrl-C) or SIGTERM stops everything and exits 0. It names each ZooKeeper process
that exits on its own (on stderr, with the end of its log); if every ZooKeeper node or the Redis
server is gone, it stops the rest and exits 1.

``celery-zklock stack outage SECONDS [--stack PID] [--json]`` (also spelled ``stack drill
--seconds SECONDS``) is an outage drill: the running ``stack up`` (the only one, or the one with
that pid) SIGKILLs its ZooKeeper, every member of an ensemble, and starts it again on the same
ports and data SECONDS later; the command prints each step with its time of day (``--json``: one
JSON object per step) and exits 0 once ZooKeeper serves again, 1 if the drill failed. See
:mod:`celery_zklock.testing.drill` and ``docs/outage.md``.

``--secure`` starts ZooKeeper with SASL DIGEST-MD5 users, digest auth and a TLS client port
(see :class:`~celery_zklock.testing.security.ZooKeeperSecurity`) and prints the TLS settings
instead: ``export`` lines for ``ZKLOCK_HOSTS`` (the TLS host string), ``ZKLOCK_USE_SSL``,
``ZKLOCK_SSL_CA``, ``ZKLOCK_SASL_MECHANISM``/``_USERNAME``/``_PASSWORD``, ``ZKLOCK_AUTH``
(and ``ZKLOCK_BROKER_URL``), then ``#`` comment lines with the plain host string, every SASL
user and password, and the unrelated CA.

Each subcommand is a :class:`Subcommand` (a name, a one-line help, a function that adds its
arguments to its parser and one that runs it and returns the exit status), listed in
``COMMANDS``. The repository's worker fleet has its own entry point, ``python -m workers
worker|demo|loadtest``, built from the same :class:`Subcommand` shape; this module imports
nothing from it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from celery_zklock.testing import RedisServer, StackError, ZooKeeperEnsemble, ZooKeeperServer, drill
from celery_zklock.testing.security import SASL_MECHANISM, ZooKeeperSecurity
from celery_zklock.zk import validate

__all__ = ["COMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    """One subcommand: ``celery-zklock <name>`` (or ``python -m workers <name>``, the fleet's)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------------------------- stack


def _configure_stack(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="stack_action", metavar="ACTION", required=True)
    up = actions.add_parser(
        "up",
        help="run ZooKeeper and Redis in the foreground until Ctrl-C or SIGTERM",
        description=(
            "Start a local ZooKeeper (standalone, or an ensemble with --zk-nodes > 1) and Redis "
            "on free 127.0.0.1 ports, print the environment to use them, and wait. Ctrl-C or "
            "SIGTERM stops everything."
        ),
    )
    up.add_argument(
        "--zk-nodes",
        type=validate.argument(validate.positive_int),
        default=1,
        metavar="N",
        help="ZooKeeper nodes: 1 = standalone (default), N > 1 = an N-node ensemble",
    )
    up.add_argument("--no-redis", action="store_true", help="do not start Redis")
    up.add_argument(
        "--secure",
        action="store_true",
        help=(
            "ZooKeeper with a TLS client port (CA made on the fly), SASL DIGEST-MD5 users alice "
            "and bob, and digest auth; prints the TLS, SASL and digest settings"
        ),
    )
    up.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for start-up (default 60)"
    )
    outage = actions.add_parser(
        "outage",
        help="an outage drill: stop the running stack's ZooKeeper for SECONDS, then restart it",
        description=(
            "Ask the running `celery-zklock stack up` to SIGKILL its ZooKeeper (every member of "
            "an ensemble) and start it again on the same ports and data SECONDS later. Prints "
            "each step with its time of day; exits 0 once ZooKeeper serves again."
        ),
    )
    outage.add_argument(
        "seconds",
        type=validate.argument(validate.seconds),
        metavar="SECONDS",
        help="how long ZooKeeper stays down",
    )
    _drill_options(outage)
    alias = actions.add_parser("drill", help="the same as `outage SECONDS`: --seconds SECONDS")
    alias.add_argument(
        "--seconds",
        type=validate.argument(validate.seconds),
        required=True,
        metavar="SECONDS",
        help="how long ZooKeeper stays down",
    )
    _drill_options(alias)


def _drill_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stack",
        type=validate.argument(validate.positive_int),
        metavar="PID",
        help="the pid of the `stack up` to drill (needed when several run)",
    )
    parser.add_argument("--json", action="store_true", help="print each step as a JSON object")


@contextlib.contextmanager
def _stop_signals() -> Iterator[Callable[..., bool]]:
    """Turn SIGINT/SIGTERM into a flag; yield ``wait(timeout) -> stop requested``.

    The handlers only set a flag; a wakeup pipe makes the wait return at once (no lost wakeup
    between checking the flag and sleeping).
    """
    requested: list[int] = []
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, frame: FrameType | None) -> None:
        requested.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait(timeout: float | None, readable: Any = None) -> bool:
        """Wait up to ``timeout`` seconds for a stop signal (or for ``readable`` to be)."""
        if not requested:
            ready, _, _ = select.select(
                [read_fd, *([readable] if readable else [])], [], [], timeout
            )
            if read_fd in ready:
                os.read(read_fd, 512)
        return bool(requested)

    try:
        yield wait
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(read_fd)
        os.close(write_fd)


def _run_stack(args: argparse.Namespace) -> int:
    if args.stack_action == "up":
        return _stack_up(args)
    if args.stack_action in ("outage", "drill"):
        return _stack_outage(args)
    raise AssertionError(f"unknown stack action {args.stack_action!r}")  # argparse prevents it


def _secure_exports(zookeeper: ZooKeeperServer | ZooKeeperEnsemble) -> list[str]:
    """The ``export`` lines of ``--secure``: TLS, and SASL and digest as the first user."""
    user, password = next(iter(zookeeper.sasl_users.items()))
    return [
        f"export ZKLOCK_HOSTS={zookeeper.tls_hosts}",
        "export ZKLOCK_USE_SSL=true",
        f"export ZKLOCK_SSL_CA={zookeeper.ca_file}",
        f"export ZKLOCK_SASL_MECHANISM={SASL_MECHANISM}",
        f"export ZKLOCK_SASL_USERNAME={user}",
        f"export ZKLOCK_SASL_PASSWORD={password}",
        f"export ZKLOCK_AUTH=digest:{user}:{password}",
    ]


def _secure_comments(zookeeper: ZooKeeperServer | ZooKeeperEnsemble) -> list[str]:
    """The ``#`` lines after the exports of ``--secure``: the rest a client may want."""
    lines = [f"# plain port (no TLS): ZKLOCK_HOSTS={zookeeper.hosts} ZKLOCK_USE_SSL=false"]
    lines += [f"# SASL user {name} password {pw}" for name, pw in zookeeper.sasl_users.items()]
    lines.append(f"# unrelated CA (a client trusting it must fail): {zookeeper.wrong_ca_file}")
    return lines


def _stack_up(args: argparse.Namespace) -> int:
    security = ZooKeeperSecurity() if args.secure else None
    zookeeper: ZooKeeperServer | ZooKeeperEnsemble = (
        ZooKeeperServer(security=security)
        if args.zk_nodes == 1
        else ZooKeeperEnsemble(args.zk_nodes, security=security)
    )
    redis = None if args.no_redis else RedisServer()
    with _stop_signals() as stop_requested, drill.control_socket() as control:
        try:
            zookeeper.start(timeout=args.timeout)
            if stop_requested(0):
                return 0
            if redis is not None:
                redis.start(timeout=args.timeout)
            if args.secure:
                print("\n".join(_secure_exports(zookeeper)))
            else:
                print(f"export ZKLOCK_HOSTS={zookeeper.hosts}")
            if redis is not None:
                print(f"export ZKLOCK_BROKER_URL={redis.url}")
            if args.secure:
                print("\n".join(_secure_comments(zookeeper)))
            sys.stdout.flush()
            print(
                f"# ZooKeeper pids {_pids(zookeeper)}"
                + (f", Redis pid {redis.pid}" if redis is not None else "")
                + ". Ctrl-C or SIGTERM stops them. An outage drill: celery-zklock stack "
                f"outage SECONDS (--stack {os.getpid()}).",
                file=sys.stderr,
                flush=True,
            )
            deaths = drill.DeathWatch(zookeeper)
            while not stop_requested(1.0, control):
                if not drill.serve_drill(control, zookeeper, stop_requested, _say):
                    return 0 if stop_requested(0) else 1
                for line in deaths.check():
                    _say(f"celery-zklock stack up: {line}")
                problem = _health_problem(deaths, redis)
                if problem:
                    _say(f"celery-zklock stack up: {problem}; stopping")
                    return 1
            return 0
        except StackError as exc:
            print(f"celery-zklock stack up: {exc}", file=sys.stderr)
            return 1
        finally:
            if redis is not None:
                redis.stop()
            zookeeper.stop()


def _pids(zookeeper: ZooKeeperServer | ZooKeeperEnsemble) -> list[int | None]:
    if isinstance(zookeeper, ZooKeeperEnsemble):
        return [node.pid for node in zookeeper.nodes]
    return [zookeeper.pid]


def _health_problem(deaths: drill.DeathWatch, redis: RedisServer | None) -> str | None:
    if deaths.all_gone():
        return "every ZooKeeper process exited"
    if redis is not None and not redis.is_running():
        return "the Redis server exited"
    return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _stack_outage(args: argparse.Namespace) -> int:
    try:
        path = drill.find_stack(args.stack)
        for step in drill.request_outage(path, args.seconds, drill.RESTART_TIMEOUT + 30):
            print(step.to_json() if args.json else step.describe(), flush=True)
            if step.event == "error":
                return 1
    except StackError as exc:
        print(f"celery-zklock stack {args.stack_action}: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------- commands

COMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        name="stack",
        help="run the local ZooKeeper/Redis stack",
        configure=_configure_stack,
        run=_run_stack,
    ),
)
"""The subcommands of ``celery-zklock``."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``celery-zklock``."""
    parser = argparse.ArgumentParser(
        prog="celery-zklock", description="Celery tasks under ZooKeeper locks."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``celery-zklock``; returns the exit status (argparse exits with 2 on bad usage)."""
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
