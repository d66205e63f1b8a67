"""`kvmesh serve cacheserver`: run the cache-server (the shared remote tier) in the foreground."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import click

from kvmesh.common.config import CacheServerConfig, ConfigError, load_config
from kvmesh.common.observability import configure_logging

EXIT_INVALID = 2


@click.command("cacheserver")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config file (default: $KVMESH_CONFIG); its `cacheserver:` section is used.",
)
@click.option("--host", default=None, help="Address to bind (cacheserver.host).")
@click.option("--port", type=int, default=None, help="kvmesh protocol port; 0 = any free one.")
@click.option("--lm/--no-lm", "lm_enabled", default=None, help="Also serve LMCache's lm://.")
@click.option("--lm-port", type=int, default=None, help="lm:// port; 0 = any free one.")
@click.option("--metrics-port", type=int, default=None, help="/metrics and /healthz port.")
@click.option("--max-memory", default=None, help="Memory bound, e.g. 8GiB.")
@click.option("--max-value-size", default=None, help="Largest value accepted, e.g. 256MiB.")
@click.option("--spill-path", default=None, help="Directory for evicted values; empty = none.")
@click.option("--spill-max-size", default=None, help="Bound of the spill directory.")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port, lm_port, metrics_port} as JSON here once serving.",
)
def cacheserver(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve the cache-server until SIGTERM or Ctrl-C.

    Options override the config file, which overrides KVMESH_CACHESERVER__* variables'
    defaults as usual (see docs/configuration.md).
    """
    overrides = {f"cacheserver.{k}": v for k, v in options.items() if v is not None}
    try:
        cfg = load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)
    configure_logging(cfg.logging.level, json=cfg.logging.json, service="cacheserver")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(cfg.cacheserver, ready_file))


def _write_ready(path: str, info: dict[str, Any]) -> None:
    """Write info atomically, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


async def _serve(cfg: CacheServerConfig, ready_file: str | None) -> None:
    from kvmesh.services.cacheserver.server import CacheServer

    server = CacheServer(cfg)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
    if ready_file:
        info = {
            "pid": os.getpid(),
            "port": server.port,
            "lm_port": server.lm.port if server.lm else None,
            "metrics_port": server.http.port if server.http else None,
        }
        _write_ready(ready_file, info)
    await server.wait_closed()
