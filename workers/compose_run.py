"""``python -m workers fleet`` (``make fleet``): the load test on the compose fleet, start to end.

It makes sure a Docker engine runs (starting ``dockerd`` as root when none does, and stopping
it again at the end), builds the images from Debian packages (:func:`workers.compose.build_images`),
starts a compose project of ``compose/docker-compose.yml`` with N worker containers, runs the
load test against it in external mode with its faults made through Docker
(:mod:`workers.docker_faults`), and removes the project (containers, networks, volumes). Every
load test option applies (``--help``); ``--pools`` names the one pool all workers run.
Defaults: 4 workers (prefork, 4 processes each), 300 tasks over 12 keys, a 4 s session timeout,
each Docker fault kind twice.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Final

from celery_zklock.testing.cli import Subcommand
from workers.compose import BASE_IMAGE, ComposeProject, DockerEngine, DockerError, build_images
from workers.docker_faults import DOCKER_FAULT_KINDS
from workers.loadtest import External, LoadConfig, config_from_args, configure_parser, run_loadtest

__all__ = ["COMMAND", "FLEET", "run_fleet"]

FLEET: Final = LoadConfig(
    tasks=300,
    keys=12,
    workers=4,
    pools=("prefork",),
    concurrency=4,
    session_timeout=4.0,
    wait_timeout=10.0,
    faults=dict.fromkeys(DOCKER_FAULT_KINDS, 2),
    name="fleet",
)
"""The compose fleet's defaults."""
DEFAULT_PROJECT: Final = "zklock-fleet"

_HELP: Final = (
    "Build the fleet's images from Debian packages, start it with docker-compose, run the load "
    "test against it with faults made through Docker, and stop everything (make fleet)."
)


def _configure(parser: argparse.ArgumentParser) -> None:
    configure_parser(parser, FLEET)
    group = parser.add_argument_group("compose fleet")
    group.add_argument(
        "--base-image", default=os.environ.get("ZKLOCK_BASE_IMAGE", BASE_IMAGE),
        help=f"base image of the fleet's images ($ZKLOCK_BASE_IMAGE, else {BASE_IMAGE}); built "
        "with debootstrap when it can be neither found nor pulled")  # fmt: skip
    group.add_argument(
        "--project", default=DEFAULT_PROJECT,
        help=f"docker-compose project name ({DEFAULT_PROJECT})")  # fmt: skip
    group.add_argument(
        "--build-only", action="store_true",
        help="build the images and stop (no project, no load test)")  # fmt: skip
    group.add_argument(
        "--keep-running", action="store_true",
        help="leave the project running (docker-compose -p NAME down -v removes it)")  # fmt: skip


def _check(args: argparse.Namespace, config: LoadConfig) -> str | None:
    if args.zk_hosts or args.broker or args.compose_project:
        return "fleet starts its own compose project: --zk-hosts, --broker, --compose-project"
    if len(config.pools) != 1:
        return f"the compose fleet's workers all run one pool; got --pools {','.join(config.pools)}"
    return None


def build_only(base: str) -> int:
    """Build the fleet's images (starting and stopping ``dockerd`` if needed); exit status."""
    try:
        engine = DockerEngine.ensure(Path(tempfile.gettempdir()) / "zklock-dockerd.log")
        try:
            build_images(base, say=lambda line: print(line, flush=True))
        finally:
            engine.close()
    except DockerError as exc:
        print(f"celery-zklock fleet: could not build the images: {exc}", flush=True)
        return 1
    return 0


def run_fleet(config: LoadConfig, base: str, project_name: str, keep_running: bool) -> int:
    """Run the load test ``config`` on a compose project (see the module docstring); return the
    exit status (0: the report is ok)."""
    with contextlib.ExitStack() as stack:
        try:
            log = Path(tempfile.gettempdir()) / "zklock-dockerd.log"
            engine = DockerEngine.ensure(log)
            stack.callback(engine.close)
            if engine.started_here:
                print(f"started dockerd (log {log}); it is stopped at the end", flush=True)
            build_images(base, say=lambda line: print(line, flush=True))
            visibility = config.effective_visibility_timeout()
            project = ComposeProject(
                project_name,
                {
                    "ZKLOCK_POOL": config.pools[0],
                    "ZKLOCK_CONCURRENCY": str(config.concurrency),
                    "ZKLOCK_SESSION_TIMEOUT": f"{config.session_timeout:g}",
                    "ZKLOCK_VISIBILITY_TIMEOUT": f"{visibility:g}",
                },
            )
            project.down()  # what a run of the same name left behind
            if not keep_running:
                stack.callback(project.down)
            project.up(config.workers)
            print(
                f"compose project {project.name}: {config.workers} worker containers "
                f"({config.pools[0]}, concurrency {config.concurrency})",
                flush=True,
            )
            records = project.records_url()
            external = External(
                zk_hosts=project.zk_hosts(),
                broker=project.broker_url(),
                record_url=records,
                result_backend=records,
                workers=config.workers,
                slots=config.workers * config.concurrency,
                visibility_timeout=visibility,
                compose=project,
            )
        except DockerError as exc:
            print(f"celery-zklock fleet: could not start: {exc}", flush=True)
            return 1
        status = run_loadtest(replace(config, external=external))
        if status != 0:
            print(project.logs(tail=20), flush=True)
        return status
    raise AssertionError("unreachable")  # the with block returns


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args, "fleet")
    problem = _check(args, config)
    if problem is not None:
        print(f"celery-zklock fleet: {problem}", file=sys.stderr)
        return 2
    if args.build_only:
        return build_only(args.base_image)
    try:
        return run_fleet(config, args.base_image, args.project, args.keep_running)
    except KeyboardInterrupt:
        print("celery-zklock fleet: interrupted; the compose project is removed")
        return 130


COMMAND: Final = Subcommand(name="fleet", help=_HELP, configure=_configure, run=_run)
"""``python -m workers fleet``."""
