"""What every `kvmesh serve X` command does around its service: load the config (an
invalid one exits 2 with one line per problem), set up logging and uvloop, run the
service until SIGTERM or Ctrl-C, and write a ready file once it serves."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any, Protocol

import click
import zmq

from kvmesh.common.config import ConfigError, KvmeshConfig, load_config
from kvmesh.common.observability import configure_logging
from kvmesh.common.observability.http_auth import read_http_token
from kvmesh.common.transport.curve import CurveKeys, load_curve, warn_if_world_readable

EXIT_FAILED = 1
EXIT_INVALID = 2
# Start failures that mean the configured address (port in use, host not local or
# unknown) is wrong: exit 2, as for any other config problem.
_ADDRESS_ERRNOS = frozenset(
    {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EINVAL, errno.ENODEV}
    | {socket.EAI_NONAME}
)
STOP_AFTER_FAILED_START_S = 5.0


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def wait_closed(self) -> None: ...


def load_service_config(
    section: str, config_file: str | None, options: dict[str, Any]
) -> KvmeshConfig:
    """The config with the command's options (those given) over `section`; exits 2 on
    any problem, naming the key and where it came from."""
    overrides = {f"{section}.{k}": v for k, v in options.items() if v is not None}
    try:
        return load_config(config_file, overrides=overrides, service=section)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)


def load_security(
    cfg: KvmeshConfig, *, server: bool = False, client: bool = False
) -> tuple[CurveKeys | None, str]:
    """The CURVE keys and HTTP token the config names, read and checked before the
    service starts; exits 2 naming the `security.*` key and the path on any problem."""
    try:
        keys, token = (
            load_curve(cfg.security, server=server, client=client),
            read_http_token(cfg.security),
        )
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_INVALID)
    if token:
        warn_if_world_readable("security.http_token_file", cfg.security.http_token_file)
    return keys, token


def run_service(
    name: str,
    cfg: KvmeshConfig,
    make: Callable[[], Service],
    ready_file: str | None,
    ready_info: Callable[[Any], dict[str, Any]],
) -> None:
    """Serve make()'s service in the foreground; ready_info(service) (plus the pid)
    goes to ready_file once it serves."""
    configure_logging(cfg.logging.level, json=cfg.logging.json, service=name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(name, make, ready_file, ready_info))


async def _serve(
    name: str,
    make: Callable[[], Service],
    ready_file: str | None,
    ready_info: Callable[[Any], dict[str, Any]],
) -> None:
    service = make()
    try:
        await service.start()
    except (OSError, zmq.ZMQError) as exc:
        # What did start (a ROUTER bound before the HTTP port failed) must not outlive it.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_AFTER_FAILED_START_S):
                await service.stop()
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        click.echo(f"error: cannot start {name}: {why}", err=True)
        sys.exit(EXIT_INVALID if exc.errno in _ADDRESS_ERRNOS else EXIT_FAILED)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(service.stop()))
    if ready_file:
        try:
            write_ready(ready_file, {"pid": os.getpid(), **ready_info(service)})
        except OSError as exc:
            # Whoever waits for the file would wait forever: stop, saying why (a
            # directory that does not exist or cannot be written is the option's fault).
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_AFTER_FAILED_START_S):
                    await service.stop()
            click.echo(f"error: --ready-file {ready_file}: {exc.strerror or exc}", err=True)
            sys.exit(EXIT_INVALID)
    await service.wait_closed()


def write_ready(path: str, info: dict[str, Any]) -> None:
    """Write info atomically, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
