"""`kvmesh events`: follow the controller's KV-event feed (docs/operations.md, "KV events").

    kvmesh events [--controller HOST] [--namespace NS ...] [--since SEQ] [--json]

Subscribes to the feed's PUB socket (`controller.events_port`), fills gaps from its
replay socket (`controller.events_replay_port`) through
common/transport/kv_events_client.py, and prints every message: one line per chunk
event for people, one JSON object per message (`--json`) for scripts. What could not
be recovered is said too: a `"kind": "lost"` line (on stderr without --json), after
which what the reader knew of those namespaces is void.

Exit status: 0 at --limit or --duration (or ctrl-C), 1 when zmq fails (no file
descriptor left, ...), 2 for a bad option.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from typing import Any

import click
import msgspec
import zmq

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.kv_events_client import Delivery, KvEventsSubscriber, Lost
from kvmesh.common.transport.tcp_address import is_ipv6, local_host, tcp_endpoint
from kvmesh.services.cli.admin_cmd import BAD_URL_ERRNOS, EXIT_FAILED
from kvmesh.services.cli.serving import load_security, load_service_config

# zmq takes any port number at connect() and only never connects (70000), or refuses
# a negative one as if the host were wrong: checked here, named as the port's fault.
_PORT = click.IntRange(0, 65535)


def _host(controller: str | None, config_host: str) -> str:
    host = controller if controller is not None else config_host
    host = host.removeprefix("tcp://")
    if host.count(":") == 1 or (host.startswith("[") and not host.endswith("]")):
        raise click.BadParameter(
            "give the host only; the ports are --events-port and --replay-port",
            param_hint="--controller",
        )
    if any(c.isspace() for c in host) or (host.startswith("[") and not is_ipv6(host)):
        # Refused here rather than by zmq's connect(), whose failure leaves a socket
        # open that the subscriber's close() would wait for.
        raise click.BadParameter(f"{host!r} is not a host name", param_hint="--controller")
    return local_host(host)


def as_dict(item: Delivery | Lost) -> dict[str, Any]:
    """The JSON line of one item."""
    if isinstance(item, Lost):
        return {"kind": "lost", **dataclasses.asdict(item), "topics": list(item.topics)}
    p = item.payload
    out: dict[str, Any] = {
        "seq": item.seq,
        "namespace": item.topic,
        "replayed": item.replayed,
        "kind": p.__struct_config__.tag,
        **msgspec.to_builtins(p),
    }
    if isinstance(p, kv.EventBatch | kv.WorkerState):
        out["events"] = [{"op": e.op, "key": e.key, "tier": e.tier} for e in p.events]
    return out


def _print(item: Delivery | Lost, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(as_dict(item)))
        return
    if isinstance(item, Lost):
        what = ", ".join(item.topics) or "every namespace"
        click.echo(f"lost ({item.reason}): {what} after seq {item.after_seq}; resync", err=True)
        return
    p = item.payload
    mark = " (replayed)" if item.replayed else ""
    head = f"{item.seq} {item.topic} {p.worker_id}"
    if isinstance(p, kv.WorkerLeft):
        click.echo(f"{head} left ({p.reason}){mark}")
    elif isinstance(p, kv.WorkerState):
        click.echo(f"{head} state: {len(p.events)} chunks{mark}")
        for e in p.events:
            click.echo(f"{head} state {e.tier} {e.key}")
    else:
        for e in p.events:
            click.echo(f"{head} {e.op} {e.tier} {e.key}{mark}")


@click.command("events")
@click.option(
    "--controller",
    default=None,
    help="The controller's host (default: controller.host of the config).",
)
@click.option("--events-port", type=_PORT, default=None, help="Default: controller.events_port.")
@click.option(
    "--replay-port",
    type=_PORT,
    default=None,
    help="Default: controller.events_replay_port; 0 = no replay (gaps are reported as lost).",
)
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    help="Only this namespace id (16 hex digits, the part of a chunk key before '-'); "
    "repeatable. Default: every namespace.",
)
@click.option("--since", type=int, default=None, help="First replay every message after SEQ.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=0,
    help="Stop after this many messages (0 = never).",
)
@click.option(
    "--duration", type=click.FloatRange(min=0), default=0.0, help="Stop after SECONDS (0 = never)."
)
@click.option("--replay-timeout", type=click.FloatRange(min=0), default=5.0, show_default=True)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config (default: $KVMESH_CONFIG): `controller:` for the host and ports, "
    "`security:` for the CURVE client key.",
)
def events(
    controller: str | None,
    events_port: int | None,
    replay_port: int | None,
    namespaces: tuple[str, ...],
    since: int | None,
    as_json: bool,
    limit: int,
    duration: float,
    replay_timeout: float,
    config_file: str | None,
) -> None:
    """Follow the controller's KV-event feed: stored/removed chunks per tier."""
    cfg = load_service_config("controller", config_file, {})
    curve, _ = load_security(cfg, client=True)
    host = _host(controller, cfg.controller.host)
    pub_port = cfg.controller.events_port if events_port is None else events_port
    rep_port = cfg.controller.events_replay_port if replay_port is None else replay_port
    if not pub_port:
        raise click.UsageError("no events port: set controller.events_port or --events-port")
    if since is not None and since < 0:
        raise click.BadParameter("must be >= 0", param_hint="--since")
    try:
        sub = KvEventsSubscriber(
            tcp_endpoint(host, pub_port),
            tcp_endpoint(host, rep_port) if rep_port else "",
            namespaces=namespaces,
            since=since,
            curve=curve,
            replay_timeout_s=replay_timeout,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_follow(sub, as_json, limit, duration))
    except zmq.ZMQError as exc:
        if exc.errno in BAD_URL_ERRNOS:
            # zmq checks only the endpoint's form on connect: the host is what can be wrong.
            raise click.BadParameter(
                f"{sub.events_url}: {zmq.strerror(exc.errno)}", param_hint="--controller"
            ) from None
        # Not the host's fault (no file descriptor left, ...): say what it is.
        click.echo(f"error: zmq: {zmq.strerror(exc.errno)}", err=True)
        sys.exit(EXIT_FAILED)


async def _follow(sub: KvEventsSubscriber, as_json: bool, limit: int, duration: float) -> None:
    printed = 0
    connected = False
    try:
        # The replay of --since is within --duration too: a controller that does not
        # answer it would otherwise add --replay-timeout to the run.
        async with asyncio.timeout(duration if duration > 0 else None):
            await sub.connect()
            connected = True
            async for item in sub:
                _print(item, as_json)
                if isinstance(item, Delivery):
                    printed += 1
                    if limit and printed >= limit:
                        break
    except TimeoutError:
        if not connected and sub.since is not None:
            # Cut before the replay answered: what came after --since is unknown, and
            # a script must not take silence for "nothing happened".
            lost = Lost("replay cut by --duration", "", sub.namespaces, sub.since, 0)
            _print(lost, as_json)
    finally:
        sys.stdout.flush()
        await sub.close()
