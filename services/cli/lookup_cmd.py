"""`kvmesh serve lookup`: run the lookup-server in the foreground."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import click

from kvmesh.common.config import ConfigError, LookupConfig, load_config
from kvmesh.common.observability import configure_logging
from kvmesh.services.cli.cacheserver_cmd import _write_ready

EXIT_INVALID = 2


@click.command("lookup")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config file (default: $KVMESH_CONFIG); its `lookup:` section is used.",
)
@click.option("--host", default=None, help="Address to bind (lookup.host).")
@click.option("--port", type=int, default=None, help="ZMQ ROUTER port; 0 = any free one.")
@click.option("--controller-url", default=None, help="The controller, tcp://host:port.")
@click.option("--worker-timeout-s", type=float, default=None, help="Deadline asking workers.")
@click.option(
    "--controller-timeout-s", type=float, default=None, help="Deadline asking the controller."
)
@click.option("--chunk-size", type=int, default=None, help="The engines' chunk size.")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port} as JSON here once serving.",
)
def lookup(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve lookups until SIGTERM or Ctrl-C.

    Options override the config file, which overrides KVMESH_LOOKUP__* variables'
    defaults as usual (see docs/configuration.md).
    """
    overrides = {f"lookup.{k}": v for k, v in options.items() if v is not None}
    try:
        cfg = load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)
    configure_logging(cfg.logging.level, json=cfg.logging.json, service="lookup")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(cfg.lookup, ready_file))


async def _serve(cfg: LookupConfig, ready_file: str | None) -> None:
    from kvmesh.services.lookup.server import LookupService

    service = LookupService(cfg)
    await service.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(service.stop()))
    if ready_file:
        _write_ready(ready_file, {"pid": os.getpid(), "port": service.port})
    await service.wait_closed()
