"""`kvmesh doctor`: is this host ready to run the mesh the config describes?

    kvmesh doctor [--config FILE] [--json] [--timeout SECONDS]

Each check ends ok, warn or fail with one line saying why and what to do:

- config: the file (and KVMESH_* variables) load; every error is listed;
- ports: each configured port is free, or taken by the service that should hold it
  (it answers its own protocol); anything else holding it is a fail;
- nixl / ucx: NIXL imports and its UCX backend starts (in a child process: a broken
  native library must not take the doctor down); a warn only, the ZMQ channel is the
  fallback;
- native: the C helpers (block copier, token hasher) were built with the package; a
  warn only, slower Python/torch paths give the same results;
- disk: the disk tier's directory exists and is writable, has room for
  engine.disk.max_size, and takes an aligned O_DIRECT write (old tmpfs refuses it);
- memory: engine.l1.max_size + reserve against the memory available now, and the
  cache-server's max_memory;
- reach: the services the engine and the bridge depend on answer (fail), and the
  services the config places on this host are running (warn: maybe not started yet).

Exit status 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import click
import psutil

from kvmesh.common.config import ConfigError, KvmeshConfig, load_config
from kvmesh.common.redact import redact_text, redact_url
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.common.transport.tcp_address import (
    cacheserver_endpoint,
    host_part,
    host_ports,
    local_host,
    tcp_endpoint,
)
from kvmesh.services.cli import status_cmd
from kvmesh.services.cli.doctor_host import (
    Check,
    Level,
    check_disk,
    check_memory,
    check_native,
    check_nixl,
)


def check_config(path: str | None) -> tuple[KvmeshConfig | None, list[Check]]:
    try:
        what = path or "the defaults (no --config, no $KVMESH_CONFIG)"
        return load_config(path), [Check("config", "ok", f"{what}: loads")]
    except ConfigError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        out = [Check("config", "fail", f"{len(lines)} error(s); fix the keys below")]
        out += [Check("config", "fail", line) for line in lines]
        return None, out


# -- ports --------------------------------------------------------------------------------


def _ports(cfg: KvmeshConfig) -> list[tuple[str, str, str, int]]:
    """(label, service, host, port) of every port the config has a service listen on;
    port 0 (off, or any free one) is left out."""
    c, lk, cs, b = cfg.controller, cfg.lookup, cfg.cacheserver, cfg.bridge
    rows = [
        ("controller.port", "controller", c.host, c.port),
        ("controller.http_port", "controller-http", c.host, c.http_port),
        ("controller.metrics_port", "http", c.host, c.metrics_port),
        ("lookup.port", "lookup", lk.host, lk.port),
        ("lookup.metrics_port", "http", lk.host, lk.metrics_port),
        ("cacheserver.port", "cacheserver", cs.host, cs.port),
        ("cacheserver.metrics_port", "http", cs.host, cs.metrics_port),
        ("bridge.port", "http", b.host, b.port),
        ("bridge.metrics_port", "http", b.host, b.metrics_port),
        ("engine.metrics_port", "http", cfg.engine.metrics_host, cfg.engine.metrics_port),
    ]
    if cs.lm_enabled:
        rows.append(("cacheserver.lm_port", "lm", cs.host, cs.lm_port))
    return [r for r in rows if r[3]]


def _bind_error(host: str, port: int) -> int:
    """0 when host:port could be bound now, else the errno."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # The services set SO_REUSEADDR too: a port in TIME_WAIT is free to them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.removeprefix("[").removesuffix("]"), port))
        except OSError as exc:
            return exc.errno or errno.EADDRINUSE
    return 0


def _holder(port: int) -> str:
    """Who listens on port, when this user may know (else "")."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return ""
                with contextlib.suppress(psutil.Error):
                    return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                return f"pid {conn.pid}"
    return ""


async def _answers(service: str, host: str, port: int, timeout_s: float, curve: Any) -> str:
    """ "" when the expected service answers on host:port, else why not."""
    url = tcp_endpoint(local_host(host), port)
    probes: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "controller": lambda: status_cmd.probe_controller(url, timeout_s, curve),
        "lookup": lambda: status_cmd.probe_lookup(url, timeout_s, curve),
        "cacheserver": lambda: status_cmd.probe_cacheserver(url, timeout_s, curve),
    }
    if service in probes:
        got = await status_cmd.timed(probes[service], timeout_s, endpoint=url, curve=curve)
    elif service in ("http", "controller-http"):
        base = f"http://{host_part(local_host(host))}:{port}"
        got = await status_cmd.timed(
            lambda: status_cmd.fetch_metrics(base + "/metrics", timeout_s), timeout_s
        )
    else:
        got = {"up": False, "error": "no protocol to ask it with"}
    return "" if got["up"] else got["error"]


async def check_ports(cfg: KvmeshConfig, timeout_s: float, curve: CurveKeys | None) -> list[Check]:
    # All ports at once: asked one after another, a host whose services hang (stopped,
    # swapping) would take a deadline per port, ten of them.
    return list(await asyncio.gather(*(_check_port(row, timeout_s, curve) for row in _ports(cfg))))


async def _check_port(
    row: tuple[str, str, str, int], timeout_s: float, curve: CurveKeys | None
) -> Check:
    label, service, host, port = row
    err = await asyncio.to_thread(_bind_error, host, port)
    where = f"{label} {host_part(host)}:{port}"
    if err == 0:
        return Check("port", "ok", f"{where} is free")
    if err == errno.EADDRNOTAVAIL:
        return Check(
            "port",
            "warn",
            f"{where}: {host} is not an address of this host (fine if the service runs elsewhere)",
        )
    if err == errno.EACCES:
        return Check(
            "port",
            "fail",
            f"{where}: binding is not permitted for this user; pick a port above 1023",
        )
    why = await _answers(service, host, port, timeout_s, curve)
    if not why:
        return Check("port", "ok", f"{where} is held by the running {service}")
    holder = await asyncio.to_thread(_holder, port) or "another process"
    return Check(
        "port",
        "fail",
        f"{where} is taken by {holder}, which is not a "
        f"kvmesh {service} ({why}); stop it or change {label}",
    )


# -- reachability -------------------------------------------------------------------------


async def _tcp(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        _r, w = await asyncio.open_connection(host, port)
    w.close()
    with contextlib.suppress(Exception):
        await w.wait_closed()
    return {}


# The port a remote URL without one means (the client libraries' own defaults).
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "redis-cluster": 6379}


def _host_port(scheme: str, rest: str) -> tuple[str, int]:
    """The first server of a remote URL (`rest`: what follows `scheme://`); ValueError
    when it names no port and the scheme has no default."""
    default = DEFAULT_PORTS.get(scheme.lower())
    if default is None:
        raise ValueError(f"no default port for {scheme}://")
    # After the last '@' first: a password may hold '/', '?', '#' or ','.
    hosts = rest.rpartition("@")[2]
    for end in "/?#":
        hosts = hosts.split(end, 1)[0]
    # As the connectors read it (host_ports): IPv6 bare or bracketed, empty parts skipped.
    return host_ports(hosts, default)[0]


async def _tcp_url(scheme: str, rest: str, timeout_s: float) -> dict[str, Any]:
    # Parsed here, not while the targets are listed: timed() turns a bad URL into a
    # failed check instead of a traceback.
    host, port = _host_port(scheme, rest)
    return await _tcp(host, port, timeout_s)


def _zmq_endpoint(url: str) -> str:
    """The tcp:// endpoint a kvmesh client of url connects to; "" for other schemes."""
    if url.startswith("tcp://"):
        return url
    if url.startswith("kvmesh://"):
        return cacheserver_endpoint(url)
    return ""


async def check_reach(cfg: KvmeshConfig, timeout_s: float, curve: CurveKeys | None) -> list[Check]:
    # (what, url, level when down, how to ask)
    targets: list[tuple[str, str, Level, Callable[[], Awaitable[dict[str, Any]]]]] = []
    ep = status_cmd.endpoints_from_config(cfg)
    e = cfg.engine
    if e.controller.enabled:
        u = e.controller.url
        targets.append(
            (
                "engine.controller.url",
                u,
                "fail",
                lambda: status_cmd.probe_controller(u, timeout_s, curve),
            )
        )
    if e.remote.enabled:
        scheme, _, rest = e.remote.url.partition("://")
        if scheme == "kvmesh":
            u = cacheserver_endpoint(e.remote.url)
            targets.append(
                (
                    "engine.remote.url",
                    e.remote.url,
                    "fail",
                    lambda: status_cmd.probe_cacheserver(u, timeout_s, curve),
                )
            )
        elif scheme == "fs":
            targets.append(("engine.remote.url", e.remote.url, "fail", lambda: _fs(rest)))
        else:
            targets.append(
                (
                    "engine.remote.url",
                    e.remote.url,
                    "fail",
                    lambda: _tcp_url(scheme, rest, timeout_s),
                )
            )
    if cfg.bridge.lookup_url:
        u = cfg.bridge.lookup_url
        targets.append(
            ("bridge.lookup_url", u, "fail", lambda: status_cmd.probe_lookup(u, timeout_s, curve))
        )
    # The services' own addresses: down may only mean not started yet.
    cache = tcp_endpoint(local_host(cfg.cacheserver.host), cfg.cacheserver.port)
    targets += [
        (
            "controller",
            ep.controller,
            "warn",
            lambda: status_cmd.probe_controller(ep.controller, timeout_s, curve),
        ),
        ("lookup", ep.lookup, "warn", lambda: status_cmd.probe_lookup(ep.lookup, timeout_s, curve)),
        (
            "cacheserver",
            cache,
            "warn",
            lambda: status_cmd.probe_cacheserver(cache, timeout_s, curve),
        ),
    ]
    # A failure of a ZMQ target also says what its CURVE handshake did.
    got = await asyncio.gather(
        *(
            status_cmd.timed(
                ask, timeout_s, endpoint=_zmq_endpoint(url), curve=curve, secret_url=url
            )
            for _, url, _, ask in targets
        )
    )
    out = []
    for (what, raw_url, level, _ask), r in zip(targets, got, strict=True):
        # A remote URL may carry a password: never into the report (a terminal, a log).
        url = redact_url(raw_url)
        if not r["up"]:
            r["error"] = redact_text(r["error"], raw_url)
        if r["up"]:
            out.append(Check("reach", "ok", f"{what} {url} answers ({r['latency_ms']} ms)"))
        elif level == "fail":
            out.append(
                Check(
                    "reach",
                    "fail",
                    f"{what} {url} does not answer ({r['error']}); start it, or fix the URL",
                )
            )
        else:
            out.append(
                Check(
                    "reach",
                    "warn",
                    f"{what} {url} does not answer ({r['error']}); "
                    "fine if it is not meant to run yet",
                )
            )
    return out


async def _fs(path: str) -> dict[str, Any]:
    ok = await asyncio.to_thread(lambda: os.path.isdir(path) and os.access(path, os.W_OK))
    if not ok:
        raise RuntimeError(f"{path} is not a writable directory")
    return {}


# -- the command --------------------------------------------------------------------------


async def _run_all(cfg: KvmeshConfig, timeout_s: float, curve: CurveKeys | None) -> list[Check]:
    # The blocking checks (child process, file I/O) run in threads: the port and
    # reachability probes share this loop.
    nixl = asyncio.create_task(asyncio.to_thread(check_nixl))
    ports = await check_ports(cfg, timeout_s, curve)
    disk = await asyncio.to_thread(check_disk, cfg)
    memory = check_memory(cfg)
    reach = await check_reach(cfg, timeout_s, curve)
    return ports + await nixl + check_native() + disk + memory + reach


def run_doctor(path: str | None, timeout_s: float) -> list[Check]:
    cfg, checks = check_config(path)
    if cfg is None:
        return checks + check_nixl() + check_native()
    from kvmesh.common.transport.curve import load_curve

    try:
        curve = load_curve(cfg.security, client=True)
    except ConfigError as exc:
        checks.append(Check("security", "fail", str(exc).splitlines()[0]))
        curve = None
    return checks + asyncio.run(_run_all(cfg, timeout_s, curve))


@click.command("doctor")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config to check (default: $KVMESH_CONFIG, else the defaults).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Deadline of each network probe, seconds.",
)
def doctor(config_file: str | None, as_json: bool, timeout_s: float) -> None:
    """Check the config, ports, NIXL/UCX, disk, memory and the services' reachability."""
    checks = run_doctor(config_file, timeout_s)
    failed = any(c.level == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}))
    else:
        rows = [("CHECK", "RESULT", "WHY")]
        rows += [(c.name, c.level.upper() if c.level != "ok" else "ok", c.why) for c in checks]
        click.echo(status_cmd.table(rows))
        n = {lvl: sum(c.level == lvl for c in checks) for lvl in ("ok", "warn", "fail")}
        click.echo(f"\n{n['ok']} ok, {n['warn']} warn, {n['fail']} fail")
    sys.exit(1 if failed else 0)
