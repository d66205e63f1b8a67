"""ZMQ CURVE for kvmesh sockets: keys from the `security` config, server and client
socket options, and one ZAP authenticator per context that accepts only the allowed
client keys and counts who it refuses.

    keys = load_curve(cfg.security, server=True)     # None: CURVE off, nothing changes
    guard = CurveGuard(ctx, keys, metrics, "controller")
    guard.serve(router_sock)                          # before bind
    keys.client(dealer_sock)                          # before connect
    guard.close()                                     # before the context's term()

The crypto and the ZAP protocol are pyzmq's (`zmq.auth`); this module only decides
which files and which sockets. Refusals are counted from a socket monitor rather than
from the ZAP handler, because a client with no key at all (NULL mechanism) or the wrong
server key never reaches ZAP: its handshake fails first.
"""

from __future__ import annotations

import itertools
import os
import stat
import sys
import threading
from dataclasses import dataclass

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kvmesh.common.config.errors import ConfigError, ConfigIssue, Source
from kvmesh.common.config.schema import SecurityConfig
from kvmesh.common.observability import Metrics, get_logger

log = get_logger(__name__)

# Why a handshake failed, as the metric's reason label.
REFUSALS = {
    # The peer went away mid-handshake: in practice a client without CURVE giving up.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "bad_handshake",  # e.g. the wrong server key
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "unknown_key",  # ZAP said no
}
REFUSAL_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_POLL_MS = 100
_monitor_ids = itertools.count()


@dataclass(frozen=True)
class CurveKeys:
    """The keys one process uses, loaded and checked (z85 bytes, as pyzmq wants them)."""

    server_public: bytes
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None
    # The public keys found in security.allowed_clients when the process started.
    allowed: frozenset[bytes] = frozenset()

    def server(self, sock: zmq.Socket) -> None:
        """Make sock a CURVE server (before bind); use CurveGuard.serve, which also
        checks client keys."""
        if self.server_secret is None:
            raise ValueError("security.server_key is a public key file: this process cannot serve")
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        """Make sock a CURVE client of the mesh's servers (before connect)."""
        if self.client_secret is None or self.client_public is None:
            raise ValueError("security.client_key is not set: this process cannot connect")
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def apply_client(sock: zmq.Socket, keys: CurveKeys | None, endpoint: str) -> None:
    """CURVE client options on sock (before connect) when keys are configured and the
    endpoint is tcp://; nothing otherwise. An ipc:// endpoint is guarded by its file's
    permissions, and the engines' ipc lookup servers do not speak CURVE."""
    if keys is not None and endpoint.startswith("tcp://"):
        keys.client(sock)


def _issue(key: str, path: str, problem: str) -> ConfigError:
    return ConfigError([ConfigIssue(f"security.{key}", Source("config"), f"{path}: {problem}")])


def _load(key: str, path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a pyzmq certificate file, or a ConfigError naming key and path."""
    if not os.path.isfile(path):
        raise _issue(key, path, "no such key file")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise _issue(key, path, f"not a readable CURVE certificate ({exc})") from exc
    if not public or len(public) != 40:
        raise _issue(key, path, "not a CURVE certificate (no 40-character public-key)")
    if secret and (not private or len(private) != 40):
        raise _issue(key, path, "holds no secret key: give the NAME.key_secret file")
    if private:
        warn_if_world_readable(f"security.{key}", path)
    return public, private


def warn_if_world_readable(key: str, path: str) -> bool:
    """Log a warning if the mode of the secret file at path lets every user read it
    (o+r; whether they can reach it depends on its directories too); whether it does.
    Group-readable is left alone (the chart mounts its Secrets 0440 for the pod's
    fsGroup). The warning names the key, the path and the mode, never the content."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # the caller reports a missing or unreadable file itself
    if not mode & stat.S_IROTH:
        return False
    event = "secret file's mode lets every user of this host read it: chmod o-r it"
    fields = {"key": key, "path": path, "mode": oct(stat.S_IMODE(mode))}
    if structlog.is_configured():
        log.warning(event, **fields)
    else:
        # Before logging is set up (`kvmesh serve` reads its keys first; the CLI's
        # clients never set it up) structlog would print on stdout, into the
        # `--json` output of `kvmesh status` and the like.
        print(f"warning: {event}", *(f"{k}={v}" for k, v in fields.items()), file=sys.stderr)
    return True


def load_curve(
    security: SecurityConfig, *, server: bool = False, client: bool = False
) -> CurveKeys | None:
    """The keys for a process that serves and/or connects; None when CURVE is off.

    Reads files: call it at start-up, before the event loop or in a thread. Every
    problem is a ConfigError naming the `security.*` key and the path.
    """
    if not security.curve:
        return None
    server_public, server_secret = _load("server_key", security.server_key, secret=server)
    client_public = client_secret = None
    if client:
        if not security.client_key:
            raise _issue("client_key", "(unset)", "required: this process connects to servers")
        client_public, client_secret = _load("client_key", security.client_key, secret=True)
    if server:
        where = security.allowed_clients
        if not where:
            raise _issue("allowed_clients", "(unset)", "required: this process serves")
        if not os.path.isdir(where):
            raise _issue("allowed_clients", where, "not a directory of client *.key files")
        found = [n for n in os.listdir(where) if n.endswith(".key")]
        if not found:
            raise _issue("allowed_clients", where, "holds no *.key file: no client could connect")
        allowed = frozenset(
            _load("allowed_clients", os.path.join(where, name), secret=False)[0] for name in found
        )
    else:
        allowed = frozenset()
    return CurveKeys(
        server_public, server_secret if server else None, client_public, client_secret, allowed
    )


class CurveGuard:
    """CURVE for the server sockets of one context: the ZAP authenticator (a pyzmq
    thread) accepting the allowed client keys, and a thread counting refused
    handshakes in `kvmesh_<service>_auth_failures_total{reason}`.

    With keys None every method does nothing, so callers need no branch.
    """

    def __init__(
        self, ctx: zmq.Context, keys: CurveKeys | None, metrics: Metrics, service: str
    ) -> None:
        self.keys = keys
        failures = metrics.counter(
            f"{service}_auth_failures_total", "Connections refused by CURVE, by why", ["reason"]
        )
        self.failures = {reason: failures.labels(reason=reason) for reason in REFUSALS.values()}
        for counter in self.failures.values():
            counter.inc(0)
        self._auth: ThreadAuthenticator | None = None
        self._monitor: threading.Thread | None = None
        self._pending: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if keys is None:
            return
        # A shadow sync context: the authenticator and monitor threads need blocking
        # sockets even when the caller's context is zmq.asyncio's.
        self._sync = zmq.Context.shadow(ctx.underlying)
        self._auth = ThreadAuthenticator(self._sync, log=_quiet_logger())
        self._auth.start()
        # The keys load_curve read at start-up: no file is read here, on an event loop.
        self._auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(keys))
        self._monitor = threading.Thread(
            target=self._watch, name=f"kvmesh-{service}-curve", daemon=True
        )
        self._monitor.start()

    @property
    def events(self) -> int:
        """The monitor events `count` needs (0 with CURVE off)."""
        return REFUSAL_EVENTS if self.keys is not None else 0

    def secure(self, sock: zmq.Socket) -> None:
        """CURVE server options on sock (before bind), for a caller that monitors sock
        itself: it adds `events` to its monitor and passes each event to `count`."""
        if self.keys is not None:
            self.keys.server(sock)

    def count(self, event: dict) -> None:
        """Count one parsed monitor event if it is a refused handshake."""
        reason = REFUSALS.get(event["event"])
        if (
            event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and event.get("value") == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            # A client speaking NULL to a CURVE server: libzmq reports it as a
            # protocol error (measured: value MECHANISM_MISMATCH), not NO_DETAIL.
            reason = "no_key"
        if reason is not None:
            self.failures[reason].inc()
            log.warning("connection refused: CURVE", reason=reason)

    def serve(self, sock: zmq.Socket) -> None:
        """CURVE server options on sock, and its refusals counted; call before bind.
        A socket has one monitor: one that is monitored already takes `secure`."""
        if self.keys is None:
            return
        self.keys.server(sock)
        addr = f"inproc://kvmesh-curve-monitor-{os.getpid()}-{next(_monitor_ids)}"
        sock.monitor(addr, REFUSAL_EVENTS)
        # Connected here, so no event is lost before the thread picks it up; the lock
        # hands the socket over to that thread (a full barrier, as ZMQ requires).
        pair = self._sync.socket(zmq.PAIR)
        pair.linger = 0
        pair.connect(addr)
        with self._lock:
            self._pending.append(pair)

    def close(self) -> None:
        """Stop both threads (blocks ~0.1 s); call before the context's term()."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
            self._monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _watch(self) -> None:
        poller = zmq.Poller()
        pairs: list[zmq.Socket] = []
        try:
            while not self._stop.is_set():
                with self._lock:
                    pending, self._pending = self._pending, []
                for pair in pending:
                    poller.register(pair, zmq.POLLIN)
                    pairs.append(pair)
                for pair, _ in poller.poll(_POLL_MS):
                    self._count(pair)
        finally:
            with self._lock:
                pairs += self._pending
                self._pending = []
            for pair in pairs:
                pair.close(linger=0)

    def _count(self, pair: zmq.Socket) -> None:
        while True:
            try:
                self.count(parse_monitor_message(pair.recv_multipart(zmq.NOBLOCK)))
            except zmq.Again:
                return


class _Allowed:
    """pyzmq's credentials provider: called, in the authenticator's thread, with each
    connecting client's public key."""

    def __init__(self, keys: CurveKeys) -> None:
        self._allowed = keys.allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._allowed


def _quiet_logger():
    """pyzmq's authenticator logs every handshake at debug; keep it on its own logger."""
    import logging

    return logging.getLogger("kvmesh.zap")
