"""Whether a `host:port` (or a URL holding some) is one the clients can dial.

The clients parse these lazily: redis-py when it first connects, zmq after connect()
returned, the connectors' host_ports when the engine builds its tiers. A port that is
not a number then shows up as a store that is never reachable, so the config checks
them when it loads, the way each client will read them:

- `host_ports` (kvmesh://, redis-cluster://, P2P endpoints) cuts the port at the last
  ':', so an IPv6 address works there with or without brackets;
- redis-py (redis://, rediss://) and aiohttp (http://) read URLs with urllib, which
  takes an IPv6 address only in brackets.
"""

from __future__ import annotations

from urllib.parse import unquote

from kvmesh.common.redact import redact_url
from kvmesh.common.transport.tcp_address import is_ipv6

MAX_PORT = 65535


def port_problem(port: str) -> str | None:
    """Why `port` (the text after the ':') is no port a client can connect to."""
    # isdecimal() alone would pass "²" or "٣", which int() reads or refuses unlike
    # the clients' parsers: only ASCII digits are a port.
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} is not a number"
    if not 0 < int(port) <= MAX_PORT:
        return f"port {port} is not in 1-{MAX_PORT}"
    return None


def host_port_problem(part: str, *, bare_ipv6: bool, port_required: bool = False) -> str | None:
    """Why `part` is not `host[:port]` or `[ipv6][:port]`; None when it is.

    bare_ipv6: the reader cuts the port at the last ':', so `::1:7620` means [::1]:7620.
    port_required: no default port applies (a zmq endpoint).
    """
    if not part:
        return "no host"
    if any(c.isspace() for c in part):
        return f"{part!r} holds a space"
    if part.startswith("["):
        host, bracket, rest = part[1:].partition("]")
        if not bracket or not is_ipv6(host.partition("%")[0]):
            return f"{part!r}: expected [an IPv6 address] in the brackets"
        if rest and not rest.startswith(":"):
            return f"{part!r}: expected :port after the ]"
        port = rest[1:]
        has_port = bool(rest)
    elif part.count(":") > 1:
        host, _, port = part.rpartition(":")
        if not bare_ipv6 or not is_ipv6(host):
            return f"{part!r}: write an IPv6 address in brackets, as [::1]:6379"
        has_port = True
    else:
        host, colon, port = part.partition(":")
        has_port = bool(colon)
        if not host:
            return f"no host in {part!r}"
        if "[" in host or "]" in host:
            return f"{part!r}: a bracket outside [an IPv6 address]"
    if not has_port or not port:
        return f"no port in {part!r}" if port_required else None
    return port_problem(port)


# Schemes whose hosts the connectors read with host_ports (the others: redis-py's urllib).
_HOST_PORTS_SCHEMES = ("kvmesh", "redis-cluster")


def remote_url_problem(url: str) -> str | None:
    """Why a kvmesh://, redis://, rediss:// or redis-cluster:// URL names no store the
    connector can dial; None when it does. The message quotes the URL redacted."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    shown = redact_url(url)
    if scheme in _HOST_PORTS_SCHEMES:
        netloc = rest.split("/", 1)[0]
    else:
        netloc = rest
        for end in "/?#":
            netloc = netloc.split(end, 1)[0]
    hosts = netloc.rpartition("@")[2]
    # The connector skips empty parts ("a:1,b:2,"), as host_ports does.
    parts = ([p for p in hosts.split(",") if p] or [""]) if scheme == "redis-cluster" else [hosts]
    if scheme == "kvmesh" and len(parts) == 1 and "," in hosts:
        return f"kvmesh:// takes one host:port (got {shown!r})"
    for part in parts:
        problem = host_port_problem(part, bare_ipv6=scheme in _HOST_PORTS_SCHEMES)
        if problem is not None:
            # A password holding a '/' ends the authority early; what the problem
            # quotes is then a piece of it, which the redacted URL no longer shows.
            if part not in shown:
                problem = "no valid host:port"
            return f"{scheme}:// needs host:port: {problem} (got {shown!r})"
    if scheme in ("redis", "rediss"):
        path = rest[len(netloc) :].partition("?")[0].partition("#")[0]
        # redis-py reads the path as the database number, and silently uses 0 when it
        # is not one.
        db = unquote(path).replace("/", "")
        if db and not (db.isascii() and db.isdigit()):
            return f"{scheme}:// takes a database number after the / (got {shown!r})"
    return None
