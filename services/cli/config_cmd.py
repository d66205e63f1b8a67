"""`kvmesh config ...`: inspect configuration without starting anything."""

from __future__ import annotations

import json
import os
import sys

import click
import yaml

from kvmesh.common.config import ConfigError, config_to_dict, load_config
from kvmesh.common.redact import redact_values

# Exit status for an invalid config; click uses the same for usage errors, and both
# mean "fix what you passed in", unlike 1 for a failure at runtime.
EXIT_INVALID = 2


@click.group("config")
def config() -> None:
    """Check and print kvmesh configuration."""


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of YAML.")
@click.option(
    "--env/--no-env",
    "use_env",
    default=True,
    show_default=True,
    help="Apply KVMESH_<SECTION>__<KEY> environment variables on top of FILE.",
)
def check(file: str, as_json: bool, use_env: bool) -> None:
    """Validate FILE and print the effective configuration.

    The output is every key with the value a service would use: defaults, then FILE,
    then KVMESH_* variables (unless --no-env); a password in a URL is shown as ***.
    An invalid config prints
    `error: <key>: <problem> (from <source>)` on stderr and exits 2.
    """
    try:
        cfg = load_config(file, env=os.environ if use_env else {})
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)
    # A password in a URL (engine.remote.url: redis://user:password@...) is shown as
    # ***: this output goes to terminals and CI logs.
    values = redact_values(config_to_dict(cfg))
    if as_json:
        click.echo(json.dumps(values, indent=2))
    else:
        click.echo(yaml.safe_dump(values, sort_keys=False, default_flow_style=False), nl=False)
