"""``python -m workers COMMAND``: the fleet's command line.

- ``python -m workers worker [celery worker options...]`` starts one fleet worker: compose's
  ``worker`` service, the demo and the fleet launcher all run it
  (:func:`workers.fleet.worker_command` builds the command line).
- ``python -m workers demo [options]``: the load test, demo-sized (``make demo``,
  :mod:`workers.demo`).
- ``python -m workers loadtest [options]``: a load test on a local or an existing fleet
  (:mod:`workers.loadtest`).
- ``python -m workers fleet [options]``: the load test on the compose fleet, images, Docker
  and clean-up included (``make fleet``, :mod:`workers.compose_run`).

The fleet is a folder of the repository, not part of the library's wheel: run it from the
repository root, or with the root on ``PYTHONPATH`` (the compose image does that).

``worker`` reads the settings (:mod:`workers.settings`), exits with status 2 and a message
naming each bad or missing variable if they are wrong, and otherwise runs ``celery worker`` for
``workers.app:app`` in this process with the arguments of :func:`worker_argv`: the pool and
concurrency from the settings, ``--without-mingle --without-gossip --without-heartbeat`` (no
start-up sync or worker-to-worker chatter, so a worker is ready in about half a second) and
``-l info``. Extra command-line arguments are appended, so they override those (e.g.
``-n name@%h`` for the node name, ``-c 8``). The exit status is the worker's. A gevent worker
monkey-patches before anything else is imported, the settings included (they import
``celery_zklock``, which imports kazoo): the pool is read from ``ZKLOCK_POOL`` and the
arguments first, the settings are checked after.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.settings import Settings

__all__ = ["build_parser", "effective_pool", "main", "run_worker", "worker_argv"]

PROG = "python -m workers"
WORKER_HELP = "start one fleet worker; celery worker options follow (settings: ZKLOCK_* env)"
POOL_VARIABLE = "ZKLOCK_POOL"  # workers.settings reads it too, once the pool is patched


def worker_argv(settings: Settings, extra: Sequence[str] = ()) -> list[str]:
    """The ``celery`` arguments (starting with ``worker``) of a fleet worker."""
    return [
        "worker",
        "--pool",
        settings.pool,
        "--concurrency",
        str(settings.concurrency),
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "--loglevel",
        "info",
        *extra,
    ]


def run_worker(extra: Sequence[str] = ()) -> int:
    """Run a worker until it is told to stop; return its exit status (2: bad settings)."""
    # `celery worker -P gevent` monkey-patches in celery's own __main__, before anything else is
    # imported; this entry point must do the same, before the settings, the library (kazoo) or
    # the app (redis) are imported. An invalid pool patches nothing and fails the check below.
    from celery import maybe_patch_concurrency

    pool = os.environ.get(POOL_VARIABLE, "").strip() or "prefork"
    maybe_patch_concurrency(["celery", "--pool", effective_pool(["--pool", pool, *extra])])
    from workers.settings import SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"{PROG} worker: {exc}", file=sys.stderr)
        return 2
    argv = worker_argv(settings, extra)
    from workers.app import app

    # app.start() rather than app.worker_main(): the same command, but it returns the exit code.
    status = app.start(argv)
    return int(status or 0)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``demo``, ``loadtest`` and ``fleet``; ``worker`` is listed, but
    :func:`main` hands its arguments to ``celery worker`` unparsed."""
    # Not at the top: `worker` must import them after patching.
    from workers import compose_run, demo, loadtest

    parser = argparse.ArgumentParser(
        prog=PROG, description="The celery-zklock worker fleet, its demo and its load test."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers.add_parser("worker", help=WORKER_HELP, add_help=False)
    for command in (demo.COMMAND, loadtest.COMMAND, compose_run.COMMAND):
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(_command=command, _parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m workers``; returns the exit status (2: bad usage or settings)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["worker"]:
        return run_worker(args[1:])
    from workers.loadtest import config_from_args

    parsed = build_parser().parse_args(args)
    command = parsed._command
    config_from_args(parsed, command.name, parsed._parser)  # usage errors exit 2 here
    status: int = command.run(parsed)
    return status


def effective_pool(argv: Sequence[str]) -> str:
    """The pool a ``celery worker`` command line selects: its last ``-P``/``--pool`` option."""
    pool = "prefork"
    for i, arg in enumerate(argv):
        if arg in ("-P", "--pool") and i + 1 < len(argv):
            pool = argv[i + 1]
        elif arg.startswith("--pool="):
            pool = arg.split("=", 1)[1]
        elif arg.startswith("-P") and len(arg) > 2:
            pool = arg[2:].lstrip("=")
    return pool


if __name__ == "__main__":
    sys.exit(main())
