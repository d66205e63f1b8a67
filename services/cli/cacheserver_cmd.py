"""`kvmesh serve cacheserver`: run the cache-server (the shared remote tier) in the foreground."""

from __future__ import annotations

from typing import Any

import click

from kvmesh.services.cli.serving import load_security, load_service_config, run_service


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
@click.option(
    "--data/--no-data", "data_enabled", default=None, help="Serve gets over TCP data connections."
)
@click.option("--data-port", type=int, default=None, help="Data connection port; 0 = any free one.")
@click.option("--metrics-port", type=int, default=None, help="/metrics and /healthz port.")
@click.option("--max-memory", default=None, help="Memory bound, e.g. 8GiB.")
@click.option("--max-value-size", default=None, help="Largest value accepted, e.g. 256MiB.")
@click.option("--spill-path", default=None, help="Directory for evicted values; empty = none.")
@click.option("--spill-max-size", default=None, help="Bound of the spill directory.")
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port, lm_port, data_port, metrics_port} as JSON here once serving.",
)
def cacheserver(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve the cache-server until SIGTERM or Ctrl-C.

    Options override the config file, which overrides KVMESH_CACHESERVER__* variables'
    defaults as usual (see docs/configuration.md).
    """
    cfg = load_service_config("cacheserver", config_file, options)
    curve, _ = load_security(cfg, server=True)
    from kvmesh.services.cacheserver.server import CacheServer

    run_service(
        "cacheserver",
        cfg,
        lambda: CacheServer(cfg.cacheserver, curve=curve),
        ready_file,
        lambda s: {
            "port": s.port,
            "lm_port": s.lm.port if s.lm else None,
            "data_port": s.data.port if s.data else None,
            "metrics_port": s.http.port if s.http else None,
        },
    )
