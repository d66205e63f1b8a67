"""`kvmesh admin ...`: administer a running mesh through the controller (ZMQ).

    kvmesh admin workers                 one line per worker (JSON with --json)
    kvmesh admin instances               workers grouped by instance
    kvmesh admin clear [--instance I] [--tier T]
    kvmesh admin pin KEY... [--instance I] [--unpin]
    kvmesh admin health [--instance I]   each worker's own health (chunks, memory)
    kvmesh admin copy --from A --to B [KEY...]   A's chunks (all in L1, or KEYs) into B
    kvmesh admin move --from A --to B [KEY...]   the same, then removed from A
    kvmesh admin lookup TOKENS [--instance I]   cached prefix (via the lookup-server)
    kvmesh admin transfers [--bridge URL]        requests in flight through a bridge

Admin commands print one result per worker and exit 1 when any worker failed or
timed out (or zmq failed, e.g. no file descriptor left), 2 for a URL zmq refuses, 3
when the controller (or the bridge, lookup-server) did not answer.
"""

from __future__ import annotations

import asyncio
import errno
import json
import sys
import uuid
from pathlib import Path
from typing import Any, NoReturn

import click
import msgspec
import zmq

from kvmesh.common.config.schema import ZMQ_ENDPOINT_FORMS, is_zmq_endpoint
from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import (
    ControllerConnection,
    ControllerError,
    ControllerUnavailable,
)
from kvmesh.services.cli.serving import load_security, load_service_config

EXIT_FAILED = 1
EXIT_BAD_URL = 2
EXIT_UNREACHABLE = 3

# What libzmq's connect() raises for an endpoint it cannot parse or route to a
# transport (pyzmq 27 / libzmq 4.3: "tcp://-:1", "tcp://*:1" EINVAL, an ipc:// path
# over the socket-address limit ENAMETOOLONG, another scheme EPROTONOSUPPORT or
# ENOCOMPATPROTO). Any other errno (EMFILE, ETERM, ...) is not the URL's fault.
BAD_URL_ERRNOS = frozenset(
    {errno.EINVAL, errno.ENAMETOOLONG, errno.EPROTONOSUPPORT, zmq.ENOCOMPATPROTO}
)


def _zmq_url(_ctx: click.Context, _param: click.Parameter, url: str) -> str:
    # Checked before any socket exists: a connect() zmq refuses leaves one behind that
    # a client's close() could wait for.
    if not is_zmq_endpoint(url):
        raise click.BadParameter(f"expected {ZMQ_ENDPOINT_FORMS} (got {url!r})")
    return url


@click.group("admin")
@click.option(
    "--url",
    envvar="KVMESH_CONTROLLER_URL",
    default="tcp://127.0.0.1:7600",
    callback=_zmq_url,
    show_default=True,
    help="The controller's ZMQ endpoint (env KVMESH_CONTROLLER_URL).",
)
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0), default=10.0, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config (default: $KVMESH_CONFIG) whose `security:` section holds the "
    "CURVE client key and the HTTP token.",
)
@click.pass_context
def admin(
    ctx: click.Context, url: str, timeout_s: float, as_json: bool, config_file: str | None
) -> None:
    """Administer a running mesh through its controller."""
    cfg = load_service_config("security", config_file, {})
    curve, token = load_security(cfg, client=True)
    ctx.obj = {"url": url, "timeout_s": timeout_s, "json": as_json, "curve": curve}
    ctx.obj["token"] = token


def _call(ctx: click.Context, build: Any, expect: type, extra_s: float = 0.0) -> Any:
    """One request to the controller; its reply within --timeout plus extra_s."""

    async def main() -> Any:
        conn = ControllerConnection(
            ctx.obj["url"], timeout_s=ctx.obj["timeout_s"], client="cli", curve=ctx.obj["curve"]
        )
        try:
            await conn.connect()
            deadline_s = ctx.obj["timeout_s"] + extra_s
            return await conn.request(build(conn.next_rid()), expect, deadline_s)
        finally:
            await conn.close()

    try:
        return asyncio.run(main())
    except ControllerUnavailable as exc:
        click.echo(f"error: controller at {ctx.obj['url']} did not answer: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except ControllerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except zmq.ZMQError as exc:
        _zmq_failed("--url", ctx.obj["url"], exc)


def _zmq_failed(option: str, url: str, exc: zmq.ZMQError) -> NoReturn:
    """Exit 2 for an endpoint zmq refuses to connect to (it checks the form only);
    exit 1 with zmq's own words for anything else, such as no file descriptor left."""
    why = zmq.strerror(exc.errno)
    if exc.errno in BAD_URL_ERRNOS:
        click.echo(
            f"error: {option} {url!r}: {why}; expected tcp://host:port or ipc://path", err=True
        )
        sys.exit(EXIT_BAD_URL)
    click.echo(f"error: zmq: {why}", err=True)
    sys.exit(EXIT_FAILED)


def _workers(ctx: click.Context) -> list[proto.WorkerInfo]:
    return _call(ctx, proto.ListWorkers, proto.ListWorkersReply).workers


@admin.command("workers")
@click.pass_context
def workers(ctx: click.Context) -> None:
    """List registered workers."""
    infos = _workers(ctx)
    if ctx.obj["json"]:
        click.echo(json.dumps([msgspec.structs.asdict(w) for w in infos]))
        return
    for w in infos:
        chunks = ", ".join(f"{t}={n}" for t, n in sorted(w.chunks.items())) or "no chunks"
        state = " (restored)" if w.restored else ""
        p2p = w.p2p_endpoint or "-"
        click.echo(f"{w.worker_id}  p2p={p2p}  {chunks}  seen {w.seen_s_ago:.1f}s ago{state}")


@admin.command("instances")
@click.pass_context
def instances(ctx: click.Context) -> None:
    """List instances and their ranks."""
    grouped: dict[str, list[proto.WorkerInfo]] = {}
    for w in _workers(ctx):
        grouped.setdefault(w.instance_id, []).append(w)
    if ctx.obj["json"]:
        out = {i: [msgspec.structs.asdict(w) for w in ws] for i, ws in grouped.items()}
        click.echo(json.dumps(out))
        return
    for inst, ws in sorted(grouped.items()):
        total = sum(sum(w.chunks.values()) for w in ws)
        ranks = ",".join(str(w.rank) for w in ws)
        click.echo(f"{inst}  ranks {ranks} of {ws[0].world_size}  {total} chunks")


def _print_results(ctx: click.Context, reply: proto.AdminReply) -> None:
    if ctx.obj["json"]:
        results = [msgspec.structs.asdict(r) for r in reply.results]
        click.echo(json.dumps({"event_id": reply.event_id, "results": results}))
    else:
        for r in reply.results:
            status = "ok" if r.ok else f"FAILED: {r.error}"
            extra = " ".join(f"{k}={v}" for k, v in sorted(r.detail.items()))
            click.echo(f"{r.worker_id}  {status}  count={r.count} {extra}".rstrip())
    if any(not r.ok for r in reply.results):
        sys.exit(EXIT_FAILED)


@admin.command("clear")
@click.option("--instance", default="", help="Only this instance (default: all).")
@click.option("--tier", default="", help="Only this tier (default: all).")
@click.pass_context
def clear(ctx: click.Context, instance: str, tier: str) -> None:
    """Remove cached chunks (pinned ones stay) on every worker or one instance's."""
    ev = uuid.uuid4().hex
    _print_results(ctx, _call(ctx, lambda r: proto.Clear(r, ev, instance, tier), proto.AdminReply))


@admin.command("pin")
@click.argument("keys", nargs=-1, required=True)
@click.option("--instance", default="", help="Only this instance (default: all).")
@click.option("--unpin", is_flag=True, help="Release pins instead.")
@click.pass_context
def pin(ctx: click.Context, keys: tuple[str, ...], instance: str, unpin: bool) -> None:
    """Pin chunks (by key string) in L1 so eviction skips them."""
    ev = uuid.uuid4().hex
    build = lambda r: proto.Pin(r, ev, list(keys), instance, unpin)  # noqa: E731
    _print_results(ctx, _call(ctx, build, proto.AdminReply))


@admin.command("health")
@click.option("--instance", default="", help="Only this instance (default: all).")
@click.pass_context
def health(ctx: click.Context, instance: str) -> None:
    """Ask every worker for its health (chunks, memory, events dropped)."""
    ev = uuid.uuid4().hex
    _print_results(ctx, _call(ctx, lambda r: proto.Health(r, ev, instance), proto.AdminReply))


def _compress_options(f: Any) -> Any:
    f = click.option(
        "--worker-timeout",
        type=float,
        default=0.0,
        help="Deadline of each worker's rewrite, seconds (0: the controller's admin timeout).",
    )(f)
    f = click.option("--instance", default="", help="Only this instance (default: all).")(f)
    f = click.option(
        "--tier", type=click.Choice(proto.COMPRESS_TIERS), default="disk", show_default=True
    )(f)
    return click.argument("keys", nargs=-1)(f)


def _compress(
    ctx: click.Context,
    keys: tuple[str, ...],
    method: str,
    tier: str,
    instance: str,
    timeout_s: float,
) -> None:
    ev = uuid.uuid4().hex
    build = lambda r: proto.Compress(  # noqa: E731
        r, ev, instance, method, tier, list(keys), timeout_s
    )
    _print_results(ctx, _call(ctx, build, proto.AdminReply, extra_s=timeout_s))


@admin.command("compress")
@_compress_options
@click.option(
    "--method",
    type=click.Choice([m for m in proto.COMPRESS_METHODS if m != "none"]),
    default="zstd",
    show_default=True,
)
@click.pass_context
def compress(
    ctx: click.Context,
    keys: tuple[str, ...],
    tier: str,
    instance: str,
    worker_timeout: float,
    method: str,
) -> None:
    """Rewrite stored chunks (KEYs, or all each worker holds in the tier) through a
    codec, each replaced whole; new chunks keep the tier's configured compression."""
    _compress(ctx, keys, method, tier, instance, worker_timeout)


@admin.command("decompress")
@_compress_options
@click.pass_context
def decompress(
    ctx: click.Context, keys: tuple[str, ...], tier: str, instance: str, worker_timeout: float
) -> None:
    """Store chunks (KEYs, or all) raw again."""
    _compress(ctx, keys, "none", tier, instance, worker_timeout)


def _move_options(f: Any) -> Any:
    f = click.option(
        "--transfer-timeout",
        type=float,
        default=0.0,
        help="Deadline of each rank's transfer, seconds (0: the controller's admin timeout).",
    )(f)
    f = click.option("--to", "dst", required=True, help="The destination instance.")(f)
    f = click.option("--from", "src", required=True, help="The source instance.")(f)
    return click.argument("keys", nargs=-1)(f)


def _move(
    ctx: click.Context, keys: tuple[str, ...], src: str, dst: str, timeout_s: float, copy: bool
) -> None:
    ev = uuid.uuid4().hex
    build = lambda r: proto.Move(r, ev, list(keys), src, dst, copy, timeout_s)  # noqa: E731
    _print_results(ctx, _call(ctx, build, proto.AdminReply, extra_s=timeout_s))


@admin.command("copy")
@_move_options
@click.pass_context
def copy(
    ctx: click.Context, keys: tuple[str, ...], src: str, dst: str, transfer_timeout: float
) -> None:
    """Copy chunks (KEYs, or everything the source holds in L1) from one instance's
    memory to another's, rank by rank: each destination worker reads them from its
    source rank over P2P and verifies them."""
    _move(ctx, keys, src, dst, transfer_timeout, copy=True)


@admin.command("move")
@_move_options
@click.pass_context
def move(
    ctx: click.Context, keys: tuple[str, ...], src: str, dst: str, transfer_timeout: float
) -> None:
    """Copy chunks as `copy` does, then remove from the source the chunks the
    destination confirmed it holds (the rest stay where they were)."""
    _move(ctx, keys, src, dst, transfer_timeout, copy=False)


def _read_tokens(spec: str) -> list[int]:
    """`START:STOP` (token ids START..STOP-1) or a file of ids (a JSON list, or ids
    separated by white space or commas)."""
    if ":" in spec and not Path(spec).exists():
        start, _, stop = spec.partition(":")
        try:
            return list(range(int(start), int(stop)))
        except ValueError:
            raise click.BadParameter(f"{spec!r}: expected START:STOP") from None
    try:
        text = Path(spec).read_text()
    except OSError as exc:
        raise click.BadParameter(f"{spec}: {exc.strerror}") from None
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        return [int(t) for t in ids]
    except (ValueError, TypeError):
        raise click.BadParameter(f"{spec}: not a list of token ids") from None


@admin.command("lookup")
@click.argument("tokens")
@click.option("--instance", default="", help="Ask this instance's workers (default: rank all).")
@click.option(
    "--lookup-url",
    envvar="KVMESH_LOOKUP_URL",
    default="tcp://127.0.0.1:7610",
    callback=_zmq_url,
    show_default=True,
    help="The lookup-server (env KVMESH_LOOKUP_URL).",
)
@click.option("--lookup-id", default="", help="Pin what was counted under this id.")
@click.pass_context
def lookup(ctx: click.Context, tokens: str, instance: str, lookup_url: str, lookup_id: str) -> None:
    """How many leading TOKENS (START:STOP or a file of ids) are cached: on one
    instance (asking its workers), or on every instance, best first."""
    from kvmesh.common.transport.lookup_service_client import (
        LookupServiceClient,
        LookupServiceError,
        LookupServiceUnavailable,
    )

    ids = _read_tokens(tokens)

    async def main() -> Any:
        async with LookupServiceClient(
            lookup_url, timeout_s=ctx.obj["timeout_s"], name="cli", curve=ctx.obj["curve"]
        ) as c:
            if instance:
                return await c.lookup(instance, ids, lookup_id=lookup_id, pin=bool(lookup_id))
            return await c.best_instances(ids)

    try:
        result = asyncio.run(main())
    except LookupServiceUnavailable as exc:
        click.echo(f"error: lookup-server at {lookup_url} did not answer: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except LookupServiceError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except zmq.ZMQError as exc:
        _zmq_failed("--lookup-url", lookup_url, exc)
    if instance:
        if ctx.obj["json"]:
            click.echo(json.dumps(msgspec.structs.asdict(result)))
        else:
            ranks = " ".join(str(h) for h in result.per_rank)
            click.echo(
                f"{instance}  hit_tokens={result.hit_tokens} l1_tokens={result.l1_tokens} "
                f"per_rank=[{ranks}] of {len(ids)}"
            )
        return
    if ctx.obj["json"]:
        click.echo(json.dumps([msgspec.structs.asdict(i) for i in result]))
        return
    for i in result:
        click.echo(f"{i.instance_id}  hit_tokens={i.hit_tokens} l1_tokens={i.l1_tokens}")


@admin.command("transfers")
@click.option(
    "--bridge",
    "bridge_url",
    envvar="KVMESH_BRIDGE_URL",
    default="http://127.0.0.1:7630",
    show_default=True,
    help="The bridge's HTTP address (env KVMESH_BRIDGE_URL).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def transfers(ctx: click.Context, bridge_url: str, as_json: bool) -> None:
    """Requests in flight through a bridge: transfer id, prefiller, decoder, phase, age."""
    from kvmesh.services.bridge.client import BridgeError, BridgeUnavailable, fetch_transfers

    try:
        infos = asyncio.run(fetch_transfers(bridge_url, ctx.obj["timeout_s"], ctx.obj["token"]))
    except BridgeUnavailable as exc:
        click.echo(f"error: bridge at {bridge_url} did not answer: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except BridgeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # A 200 that is not the bridge's list: another server on that port, or a proxy.
        click.echo(f"error: {bridge_url} did not answer with a transfer list: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    if as_json or ctx.obj["json"]:
        click.echo(json.dumps([msgspec.structs.asdict(i) for i in infos]))
        return
    rows = [("TRANSFER", "ENDPOINT", "PHASE", "AGE_S", "PREFILLER", "DECODER", "FALLBACK", "ROUTE")]
    rows += [
        (i.transfer_id, i.endpoint, i.phase, f"{i.age_s:.3f}", i.prefiller or "-", i.decoder,
         i.fallback or "-", _route(i))
        for i in infos
    ]  # fmt: skip
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    click.echo(f"{len(infos)} in flight")


def _route(info: Any) -> str:
    """How the bridge chose the backend computing the prompt, one word per column:
    "kv:1024/1100" (cached prefix / prompt tokens), "load", "load:lookup_timeout"."""
    if info.route == "kv":
        return f"kv:{info.hit_tokens}/{info.prompt_tokens}"
    return f"load:{info.route_fallback}" if info.route_fallback else "load"
