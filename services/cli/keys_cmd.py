"""`kvmesh keys generate DIR [--name NAME]`: a CURVE key pair for `security:`.

Writes DIR/NAME.key (the public half, to hand out: servers list client ones in
`security.allowed_clients`, clients are given the server's) and DIR/NAME.key_secret
(readable by its owner only). The files are pyzmq certificates (`zmq.auth`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import zmq.auth

EXIT_EXISTS = 1
EXIT_FAILED = 1


@click.group("keys")
def keys() -> None:
    """CURVE keys for the mesh's ZMQ sockets (see docs/operations.md, Security)."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default="kvmesh", show_default=True, help="File stem: NAME.key(_secret).")
@click.option("--force", is_flag=True, help="Overwrite an existing pair.")
def generate(directory: Path, name: str, force: bool) -> None:
    """Write DIRECTORY/NAME.key (public) and DIRECTORY/NAME.key_secret (mode 0600)."""
    if not name or "/" in name or name.startswith("."):
        raise click.BadParameter("a plain file stem, as server or worker-1", param_hint="--name")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not force:
        click.echo(f"error: {', '.join(existing)} exists (--force to overwrite)", err=True)
        sys.exit(EXIT_EXISTS)
    try:
        _write_pair(directory, name, public, secret)
    except OSError as exc:
        # A directory that cannot be made or written (read-only, not a directory, no
        # permission): one line naming it, not a traceback.
        where = exc.filename or directory
        click.echo(f"error: {where}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"public key: {public}\nsecret key: {secret}")


def _write_pair(directory: Path, name: str, public: Path, secret: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # The umask makes the secret file 0600 from its creation, so it is never readable
    # by others, not even between pyzmq writing it and a chmod.
    old = os.umask(0o077)
    try:
        for path in (public, secret):
            path.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
