"""`kvmesh serve lookup`: run the lookup-server in the foreground."""

from __future__ import annotations

from typing import Any

import click

from kvmesh.services.cli.serving import load_security, load_service_config, run_service


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
@click.option("--metrics-port", type=int, default=None, help="/metrics and /health; 0 = off.")
@click.option(
    "--index/--no-index",
    default=None,
    help="Follow the controller's registry and answer from this copy while in sync.",
)
@click.option("--index-ping-s", type=float, default=None, help="Seconds between index pings.")
@click.option(
    "--index-max-staleness-s",
    type=float,
    default=None,
    help="An index not confirmed for this long is not used.",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port} (and metrics_port when served) as JSON here once serving.",
)
def lookup(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve lookups until SIGTERM or Ctrl-C.

    Options override the config file, which overrides KVMESH_LOOKUP__* variables'
    defaults as usual (see docs/configuration.md).
    """
    cfg = load_service_config("lookup", config_file, options)
    curve, _ = load_security(cfg, server=True, client=True)
    from kvmesh.services.lookup.server import LookupService

    run_service(
        "lookup",
        cfg,
        lambda: LookupService(cfg.lookup, curve=curve),
        ready_file,
        lambda s: {"port": s.port, **({"metrics_port": s.http.port} if s.http else {})},
    )
