"""The `kvmesh` console script: one click group, sub-commands in their own modules."""

from __future__ import annotations

import click

from kvmesh import __version__
from kvmesh.services.cli.admin_cmd import admin
from kvmesh.services.cli.bridge_cmd import bridge
from kvmesh.services.cli.cacheserver_cmd import cacheserver
from kvmesh.services.cli.config_cmd import config
from kvmesh.services.cli.controller_cmd import controller
from kvmesh.services.cli.demo_cmd import demo
from kvmesh.services.cli.disk_cmd import disk
from kvmesh.services.cli.doctor_cmd import doctor
from kvmesh.services.cli.events_cmd import events
from kvmesh.services.cli.keys_cmd import keys
from kvmesh.services.cli.lookup_cmd import lookup
from kvmesh.services.cli.probe_cmd import probe_cmd
from kvmesh.services.cli.status_cmd import status


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="kvmesh")
def cli() -> None:
    """kvmesh: a hierarchical KV-cache layer for LLM serving."""


@cli.group()
def serve() -> None:
    """Start a kvmesh service (controller, lookup, cacheserver, bridge)."""


serve.add_command(bridge)
serve.add_command(cacheserver)
serve.add_command(controller)
serve.add_command(lookup)
cli.add_command(admin)
cli.add_command(config)
cli.add_command(demo)
cli.add_command(disk)
cli.add_command(doctor)
cli.add_command(events)
cli.add_command(keys)
cli.add_command(probe_cmd)
cli.add_command(status)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
