"""Hosts and ports as ZMQ takes them, IPv6 included.

libzmq opens IPv4 sockets unless a socket is told otherwise, and takes an IPv6 address
only in brackets. Every kvmesh socket binds and connects through `bind`/`connect` here
(or `set_family` first): a socket is IPv6 exactly when its endpoint's host is an IPv6
address, "::" (every address of both families) included. A host name keeps resolving
to IPv4, as libzmq does by default: "localhost" must stay 127.0.0.1, where a service
bound to it listens, although /etc/hosts also names ::1 "localhost" (libzmq with IPv6
on would dial ::1 first, and never the other). So an IPv6-only host is given by its
address, not a name.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import socket
from typing import Any

import zmq

EVERY_ADDRESS_V4 = ("", "0.0.0.0", "*")
EVERY_ADDRESS = ("::", "[::]")


def is_ipv6(host: str) -> bool:
    """Whether host is an IPv6 address (bracketed or not), not a name or IPv4."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def host_part(host: str) -> str:
    """host as it goes before ":port" in a URL or endpoint: an IPv6 address bracketed."""
    if is_ipv6(host) and not host.startswith("["):
        return f"[{host}]"
    return host


def tcp_endpoint(host: str, port: int) -> str:
    """tcp://host:port, an IPv6 address bracketed."""
    return f"tcp://{host_part(host)}:{port}"


def _host_of(endpoint: str) -> str:
    return endpoint.partition("://")[2].rpartition(":")[0]


def set_family(sock: zmq.Socket, endpoint: str) -> None:
    """Before sock binds or connects endpoint: IPv6 on when its host is an IPv6 address
    (a bind of "::" then takes IPv4 too, as on Linux), off otherwise."""
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.IPV6, int(is_ipv6(_host_of(endpoint))))


def connect(sock: zmq.Socket, endpoint: str) -> None:
    """sock.connect(endpoint), an IPv6 endpoint on an IPv6 socket."""
    set_family(sock, endpoint)
    sock.connect(endpoint)


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """sock.bind(endpoint), an IPv6 endpoint on an IPv6 socket."""
    set_family(sock, endpoint)
    sock.bind(endpoint)


class UnresolvedHost(OSError):
    """A bind host that is no address, no interface, and no name that resolves in time.
    Its errno is the resolver's (EAI_NONAME for no such name, EAI_AGAIN for no answer):
    `kvmesh serve` tells a config to fix from a passing failure by it."""

    def __init__(self, message: str, code: int | None = socket.EAI_NONAME) -> None:
        super().__init__(message)
        self.errno = code


RESOLVE_TIMEOUT_S = 5.0  # below the 10 s a service start waits for its bind


def _bind_host_without_lookup(host: str) -> str | None:
    """bind_host's answer where no resolver is asked (None: host is a name to resolve).
    An interface name ("eth0") goes to libzmq as it is, which binds it before any name,
    as libzmq itself tries it."""
    if host in EVERY_ADDRESS_V4 or (host in EVERY_ADDRESS and not socket.has_dualstack_ipv6()):
        return "*"
    if is_ipv6(host):
        return host_part(host)
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        if host in (name for _, name in socket.if_nameindex()):
            return host
    except OSError:  # no interface list here: the name is resolved
        pass
    return None


def _bind_host_of(host: str, infos: list[Any]) -> str:
    if not infos:
        raise UnresolvedHost(f"bind host {host!r} resolves to no address")
    return host_part(ipv4_first(infos)[4][0])


def bind_host(host: str) -> str:
    """host as a ZMQ tcp bind takes it: every IPv4 address as "*", every address of both
    families as "[::]", an address bracketed, an interface name as it is, a host name
    resolved once (libzmq binds interfaces and addresses only), to its IPv4 address where
    it has one. UnresolvedHost for a name that does not resolve.

    This asks the resolver with no deadline, blocking: code on an event loop uses
    `bind_host_async`, and passes its answer (which this returns as it is)."""
    quick = _bind_host_without_lookup(host)
    if quick is not None:
        return quick
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except OSError as exc:
        raise UnresolvedHost(f"bind host {host!r} does not resolve: {exc}", exc.errno) from exc
    return _bind_host_of(host, infos)


async def bind_host_async(host: str, timeout_s: float | None = None) -> str:
    """`bind_host` for code on an event loop: a name is resolved on a thread of the
    loop's executor, never on the loop, within timeout_s seconds (RESOLVE_TIMEOUT_S
    unless given; UnresolvedHost past it: a resolver that does not answer would
    otherwise hold a service's start)."""
    if timeout_s is None:
        timeout_s = RESOLVE_TIMEOUT_S
    quick = _bind_host_without_lookup(host)
    if quick is not None:
        return quick
    # socket.getaddrinfo on the loop's executor, as asyncio's loop.getaddrinfo does it,
    # and not loop.getaddrinfo itself: uvloop's goes through libuv instead, and this way
    # every loop resolves exactly as bind_host does.
    lookup = functools.partial(socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM)
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, lookup), timeout_s
        )
    except TimeoutError:
        raise UnresolvedHost(
            f"bind host {host!r}: the resolver did not answer within {timeout_s:g}s",
            socket.EAI_AGAIN,
        ) from None
    except OSError as exc:
        raise UnresolvedHost(f"bind host {host!r} does not resolve: {exc}", exc.errno) from exc
    return _bind_host_of(host, infos)


def ipv4_first(infos: list[Any]) -> Any:
    """Of getaddrinfo's answers, the first IPv4 one, else the first: a name binds and is
    dialled as ZMQ does it (`bind_host`), so "localhost" is 127.0.0.1 for every listener
    and client of a service, whatever order /etc/hosts gives."""
    return next((info for info in infos if info[0] == socket.AF_INET), infos[0])


def local_host(host: str) -> str:
    """The address a client on the service's own host reaches host at: a service bound
    to every address answers on loopback."""
    return "127.0.0.1" if host in EVERY_ADDRESS_V4 + EVERY_ADDRESS else host


def every_address_socket(host: str, port: int) -> socket.socket | None:
    """For "::", one listening TCP socket for IPv6 and IPv4 (as a ZMQ bind of "::"
    takes both), to hand to an asyncio or aiohttp server, whose own bind of "::" is IPv6
    only; None for any other host. Where the kernel has no IPv6, every IPv4 address."""
    if host not in EVERY_ADDRESS:
        return None
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(
                ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
            )
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
    return socket.create_server(("0.0.0.0", port), backlog=128)


def host_ports(netloc: str, default_port: int) -> list[tuple[str, int]]:
    """`h1:p1,h2:p2` (credentials already stripped) as [(host, port)]; IPv6 in []."""
    out: list[tuple[str, int]] = []
    for part in filter(None, netloc.split(",")):
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        if not host:
            raise ValueError(f"no host in {part!r}")
        try:
            out.append((host, int(port) if port else default_port))
        except ValueError:
            raise ValueError(f"bad port in {part!r}") from None
    if not out:
        raise ValueError("no host:port given")
    return out


CACHESERVER_PORT = 7620


def cacheserver_endpoint(url: str) -> str:
    """The tcp:// endpoint of a kvmesh://host[:port][/...] URL (port 7620 when left
    out, an IPv6 address bracketed or not); ValueError for more than one host."""
    rest = url.partition("://")[2].split("/", 1)[0]
    (host, port), *more = host_ports(rest, CACHESERVER_PORT)
    if more:
        raise ValueError("kvmesh:// takes one host:port")
    return tcp_endpoint(host, port)
