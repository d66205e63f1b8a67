"""`kvmesh serve bridge`: run the disaggregated-prefill HTTP proxy in the foreground."""

from __future__ import annotations

import sys
from typing import Any

import click

from kvmesh.services.cli.serving import (
    EXIT_INVALID,
    load_security,
    load_service_config,
    run_service,
)


@click.command("bridge")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config file (default: $KVMESH_CONFIG); its `bridge:` section is used "
    "(prefillers and decoders are set there).",
)
@click.option("--host", default=None, help="Address to bind (bridge.host).")
@click.option("--port", type=int, default=None, help="HTTP port; 0 = any free one.")
@click.option("--metrics-port", type=int, default=None, help="Also /metrics, /health here.")
@click.option("--prefill-timeout-s", type=float, default=None, help="Deadline of a prefill.")
@click.option("--decode-timeout-s", type=float, default=None, help="Deadline of each decoder read.")
@click.option(
    "--lookup-url",
    default=None,
    help="KV-aware routing: the lookup-server, tcp://host:port (bridge.lookup_url; every "
    "backend then needs its instance_id).",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port, metrics_port} as JSON here once serving.",
)
def bridge(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve the OpenAI-compatible disaggregated-prefill proxy until SIGTERM or Ctrl-C.

    Options override the config file, which overrides KVMESH_BRIDGE__* variables'
    defaults as usual (see docs/configuration.md and docs/deployment.md).
    """
    cfg = load_service_config("bridge", config_file, options)
    if not cfg.bridge.decoders:
        click.echo(
            "error: bridge.decoders: at least one decoder is needed "
            "(a list of {url, kv_endpoints}; see docs/configuration.md)",
            err=True,
        )
        sys.exit(EXIT_INVALID)
    curve, http_token = load_security(cfg, client=bool(cfg.bridge.lookup_url))
    from kvmesh.services.bridge.server import BridgeServer

    run_service(
        "bridge",
        cfg,
        lambda: BridgeServer(cfg.bridge, curve=curve, http_token=http_token),
        ready_file,
        lambda s: {"port": s.port, "metrics_port": s.metrics_port or None},
    )
