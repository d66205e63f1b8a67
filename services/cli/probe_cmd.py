"""`kvmesh probe URL`: exit 0 when a service answers (the check itself: probe.py)."""

from __future__ import annotations

import sys

import click

from kvmesh.services.cli.probe import probe, url_problem


@click.command("probe")
@click.argument("url")
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0), default=2.0, show_default=True
)
def probe_cmd(url: str, timeout_s: float) -> None:
    """Exit 0 if URL answers (http(s):// with a 2xx, or tcp://host:port accepting)."""
    # A URL that cannot be asked is the caller's mistake (exit 2), not an unhealthy
    # service (exit 1).
    if (bad := url_problem(url)) is not None:
        raise click.BadParameter(bad, param_hint="URL")
    why = probe(url, timeout_s)
    if why is not None:
        click.echo(f"unhealthy: {why}", err=True)
        sys.exit(1)
