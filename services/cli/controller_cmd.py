"""`kvmesh serve controller`: run the controller (cluster registry) in the foreground."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import click

from kvmesh.common.config import ConfigError, ControllerConfig, load_config
from kvmesh.common.observability import configure_logging
from kvmesh.services.cli.cacheserver_cmd import _write_ready

EXIT_INVALID = 2


@click.command("controller")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config file (default: $KVMESH_CONFIG); its `controller:` section is used.",
)
@click.option("--host", default=None, help="Address to bind (controller.host).")
@click.option("--port", type=int, default=None, help="ZMQ ROUTER port; 0 = any free one.")
@click.option("--http-port", type=int, default=None, help="HTTP admin API port; 0 = off.")
@click.option("--snapshot-path", default=None, help="Registry snapshot file; empty = none.")
@click.option("--snapshot-interval-s", type=float, default=None, help="Seconds between snapshots.")
@click.option("--heartbeat-misses", type=int, default=None, help="Missed heartbeats to drop.")
@click.option("--admin-timeout-s", type=float, default=None, help="Per-worker admin deadline.")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port, http_port} as JSON here once serving.",
)
def controller(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve the controller until SIGTERM or Ctrl-C (it snapshots on the way out).

    Options override the config file, which overrides KVMESH_CONTROLLER__* variables'
    defaults as usual (see docs/configuration.md).
    """
    overrides = {f"controller.{k}": v for k, v in options.items() if v is not None}
    try:
        cfg = load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)
    configure_logging(cfg.logging.level, json=cfg.logging.json, service="controller")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(cfg.controller, ready_file))


async def _serve(cfg: ControllerConfig, ready_file: str | None) -> None:
    from kvmesh.services.controller.server import ControllerServer

    server = ControllerServer(cfg)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
    if ready_file:
        info = {
            "pid": os.getpid(),
            "port": server.port,
            "http_port": server.http.port if server.http else None,
        }
        _write_ready(ready_file, info)
    await server.wait_closed()
