"""`kvmesh serve controller`: run the controller (cluster registry) in the foreground."""

from __future__ import annotations

from typing import Any

import click

from kvmesh.services.cli.serving import load_security, load_service_config, run_service


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
    "--events-port",
    type=int,
    default=None,
    help="KV-event feed XPUB port (controller.events_port); 0 = off.",
)
@click.option(
    "--events-replay-port",
    type=int,
    default=None,
    help="The feed's replay ROUTER port (controller.events_replay_port); needs the feed.",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write {pid, port, http_port, events_port, events_replay_port} as JSON here "
    "once serving (0 for a socket that is off).",
)
def controller(config_file: str | None, ready_file: str | None, **options: Any) -> None:
    """Serve the controller until SIGTERM or Ctrl-C (it snapshots on the way out).

    Options override the config file, which overrides KVMESH_CONTROLLER__* variables'
    defaults as usual (see docs/configuration.md).
    """
    cfg = load_service_config("controller", config_file, options)
    curve, http_token = load_security(cfg, server=True)
    from kvmesh.services.controller.server import ControllerServer

    run_service(
        "controller",
        cfg,
        lambda: ControllerServer(cfg.controller, curve=curve, http_token=http_token),
        ready_file,
        lambda s: {
            "port": s.port,
            "http_port": s.http.port if s.http else None,
            "events_port": s.events_pub.port if s.events_pub else 0,
            "events_replay_port": cfg.controller.events_replay_port if s.events_replay else 0,
        },
    )
