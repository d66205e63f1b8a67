"""What every fuzz module shares: hypothesis strategies for hostile ZMQ messages and
HTTP requests, the clients that send them, and the checks made after each batch.

A fuzz run is time-bounded, not example-bounded: `fuzz_for` draws batches round after
round (seed KVMESH_FUZZ_SEED + round, printed with any failure) until
KVMESH_FUZZ_SECONDS (default 20) have passed for that service. After every batch
`Watched.check` asserts the service is alive, wrote no traceback to its log and has
not grown its RSS more than RSS_SLACK over what it had after the first batch (the
warm-up: allocator arenas, caches and imports settle there); the caller also checks
that a well-formed request still gets its correct answer within its deadline.

    KVMESH_FUZZ_SECONDS=600 .venv/bin/pytest tests/fuzz      # a longer run
    KVMESH_FUZZ_SEED=7 .venv/bin/pytest tests/fuzz           # other inputs
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import msgspec.inspect as mi
import psutil
import zmq
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from kvtest.service_process import ServiceProcess

from kvmesh.common.protocol import wire

FUZZ_SECONDS = float(os.environ.get("KVMESH_FUZZ_SECONDS", "20"))
FUZZ_SEED = int(os.environ.get("KVMESH_FUZZ_SEED", "20261125"))
RSS_SLACK = 64 << 20
# A reply on a loaded 2-core box: generous, since a miss here fails the run.
REPLY_S = 10.0
EXAMPLES_PER_ROUND = 5
NS = "0123456789abcdef"  # a namespace id, and with "-" and 32 hex digits a chunk key
MSGPACK_INTS = (0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))

# -- running --------------------------------------------------------------------------


def fuzz_for(
    label: str,
    strategy: st.SearchStrategy[Any],
    run_batch: Callable[[Any], None],
    seconds: float = FUZZ_SECONDS,
) -> int:
    """Draw batches from strategy and run each until `seconds` have passed; the number of
    batches run. A failure names the seed that drew it (KVMESH_FUZZ_SEED reruns it)."""
    deadline = time.monotonic() + seconds
    batches = 0
    rounds = 0
    while rounds == 0 or time.monotonic() < deadline:
        round_seed = FUZZ_SEED + rounds
        rounds += 1

        # No shrinking: a failure is a process that crashed, hung or leaked, and every
        # later example fails the same way; the batch that did it is printed instead.
        @settings(
            max_examples=EXAMPLES_PER_ROUND,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @seed(round_seed)
        @given(strategy)
        def one_round(batch: Any) -> None:
            nonlocal batches
            if time.monotonic() < deadline or batches == 0:
                run_batch(batch)
                batches += 1

        try:
            one_round()
        except BaseException as exc:
            exc.add_note(
                f"fuzz {label}: round {rounds} (KVMESH_FUZZ_SEED={FUZZ_SEED}, this round's "
                f"hypothesis seed {round_seed}), after {batches} good batches"
            )
            raise
    print(f"fuzz {label}: {batches} batches in {rounds} rounds")
    return batches


@dataclass
class Watched:
    """A service process under fuzz: its liveness, log and memory are checked by check()."""

    proc: ServiceProcess
    slack: int = RSS_SLACK
    base_rss: int = 0
    log_from: int = 0
    peak_rss: int = 0

    def __post_init__(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.log_from = self.proc.log.stat().st_size

    def rss(self) -> int:
        assert self.proc.proc is not None
        return psutil.Process(self.proc.proc.pid).memory_info().rss

    def check(self) -> None:
        assert self.proc.alive(), self.proc.describe("died under fuzz")
        with open(self.proc.log, "rb") as f:
            # What it wrote since the last check, and a little before: a word may
            # straddle two checks.
            f.seek(max(0, self.log_from - 16))
            text = f.read()
            self.log_from = f.tell()
        assert b"Traceback" not in text, self.proc.describe("logged a traceback under fuzz")
        rss = self.rss()
        self.peak_rss = max(self.peak_rss, rss)
        if not self.base_rss:
            self.base_rss = rss  # after the first batch: the warm-up
        grown = rss - self.base_rss
        assert grown <= self.slack, self.proc.describe(
            f"RSS grew {grown >> 20} MiB under fuzz (from {self.base_rss >> 20} MiB)"
        )


# -- msgpack values and messages -------------------------------------------------------

ints = st.one_of(st.integers(-5, 70_000), st.sampled_from(MSGPACK_INTS))
texts = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "x" * 300, NS, NS + "-" + "ab" * 16, "l1", "disk", "../../etc/passwd"]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), texts, st.binary(max_size=64))
msgpack_any = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.one_of(texts, ints), inner, max_size=4)
    ),
    max_leaves=24,
)


def value_of(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values a field of type t may hold on the wire (array-like Structs as lists), with
    the odd edge value (out-of-range ints, non-finite floats, odd strings)."""
    if isinstance(t, mi.IntType | mi.EnumType):
        return ints
    if isinstance(t, mi.StrType):
        return texts
    if isinstance(t, mi.BytesType | mi.ByteArrayType | mi.MemoryViewType):
        return st.one_of(st.binary(max_size=64), st.binary(min_size=16, max_size=16))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.FloatType):
        return st.one_of(st.floats(), st.sampled_from([0.0, 1e-9, 30.0, 1e300, -1.0]))
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return st.lists(value_of(t.item_type), max_size=6)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(value_of(i) for i in t.item_types)).map(list)
    if isinstance(t, mi.DictType):
        return st.dictionaries(value_of(t.key_type), value_of(t.value_type), max_size=4)
    if isinstance(t, mi.StructType):
        return fields_of(t)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(value_of(i) for i in t.types))
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    return msgpack_any


def fields_of(t: mi.StructType) -> st.SearchStrategy[list[Any]]:
    """An array-like Struct's fields: each of its type or, sometimes, of any type; all
    of them, the required ones, or a wrong count."""
    per_field = [st.one_of(value_of(f.type), value_of(f.type), msgpack_any) for f in t.fields]
    required = sum(f.required for f in t.fields)

    @st.composite
    def draw(draw: st.DrawFn) -> list[Any]:
        n = draw(st.sampled_from([len(per_field), required, 0, len(per_field) + 1]))
        values = [draw(s) for s in per_field[:n]]
        return values + [draw(msgpack_any) for _ in range(n - len(values))]

    return draw()


def tagged(union: Any) -> st.SearchStrategy[list[Any]]:
    """[tag, *fields] of one of the union's messages, fields as fields_of draws them."""
    structs = [mi.type_info(cls) for cls in typing.get_args(union)]
    return st.one_of(*(fields_of(s).map(lambda f, s=s: [s.tag, *f]) for s in structs))


def _huge(union: Any) -> st.SearchStrategy[bytes]:
    """A known tag and rid followed by a list of 10k-200k items."""
    tags = sorted(wire.tags_of(union))

    @st.composite
    def draw(draw: st.DrawFn) -> bytes:
        n = draw(st.sampled_from([10_000, 50_000, 200_000]))
        item = draw(st.sampled_from([0, NS + "-" + "ab" * 16, b"\x01" * 16]))
        return msgspec.msgpack.encode([draw(st.sampled_from(tags)), 1, [item] * n])

    return draw()


def _deep(union: Any) -> st.SearchStrategy[bytes]:
    """Arrays nested deeper than any decoder's recursion limit, tagged or not."""
    tags = [b""] + [b"\x92" + msgspec.msgpack.encode(t) for t in sorted(wire.tags_of(union))]
    return st.tuples(st.sampled_from(tags), st.sampled_from([100, 5_000, 200_000])).map(
        lambda tag_depth: tag_depth[0] + b"\x91" * tag_depth[1] + b"\xc0"
    )


@st.composite
def _truncated(draw: st.DrawFn, header: st.SearchStrategy[bytes]) -> bytes:
    raw = draw(header)
    return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]


def headers(union: Any) -> st.SearchStrategy[bytes]:
    """One header frame: a message of the union with edge or wrong-typed fields, cut
    short, huge, nested too deep, another msgpack value, or random bytes."""
    shaped = tagged(union).map(msgspec.msgpack.encode)
    return st.one_of(
        shaped,
        shaped,
        shaped,
        _truncated(shaped),
        msgpack_any.map(msgspec.msgpack.encode),
        st.binary(max_size=256),
        _huge(union),
        _deep(union),
    )


class Frames(list):
    """A message's frames, printed short in a failure report (a huge or deeply nested
    header would print megabytes): each frame's size and first bytes."""

    def __repr__(self) -> str:
        return "Frames[" + ", ".join(f"{len(f)}B {bytes(f[:48])!r}" for f in self) + "]"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis's printer
        p.text(repr(self))


def messages(union: Any) -> st.SearchStrategy[Frames]:
    """One multipart message after the routing id: a header then 0-4 value frames
    (empty ones included), or just an empty frame."""
    extra = st.lists(st.one_of(st.just(b""), st.binary(max_size=512)), max_size=4)
    framed = st.tuples(headers(union), extra).map(lambda he: Frames([he[0], *he[1]]))
    return st.one_of(framed, framed, st.just(Frames([b""])))


# -- the ZMQ side ----------------------------------------------------------------------


@dataclass
class ZmqTarget:
    """A ROUTER to fuzz: its endpoint, its protocol module (common/protocol/*) and its
    Request union."""

    endpoint: str
    proto: Any
    union: Any
    # The server's MAXMSGSIZE: larger messages are not sent (the server would drop the
    # connection, and what was queued behind them on it).
    max_frame: int = 64 << 20
    ctx: zmq.Context = field(default_factory=zmq.Context)
    _sock: zmq.Socket | None = None
    _rid: int = 1 << 40
    replies: int = 0
    errors: int = 0

    def batches(self, max_size: int = 12) -> st.SearchStrategy[list[Frames]]:
        return st.lists(messages(self.union), min_size=1, max_size=max_size)

    def socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        return sock

    def hello(self) -> bytes:
        self._rid += 1
        return self.proto.encode(self.proto.Hello(self._rid, self.proto.PROTOCOL_VERSION, "fuzz"))

    def send_batch(self, batch: Sequence[list[bytes]], *, hello_first: bool = True) -> None:
        """Send each message on one connection, then a hello; every reply up to the
        hello's must decode as a reply of the protocol, and each header the protocol's
        decoder refuses must have been answered by an ErrorReply (the ROUTER answers in
        order on a connection, so they all come before the hello's)."""
        if self._sock is None:
            self._sock = self.socket()
        sock = self._sock
        refused = 0
        if hello_first:
            sock.send(self.hello())
        for frames in batch:
            if max(map(len, frames)) > self.max_frame:
                continue
            try:
                self.proto.codec.decode_request(frames[0])
            except wire.MalformedMessage:
                refused += 1
            sock.send_multipart(frames)
        sock.send(self.hello())
        want = self._rid
        errors = 0
        deadline = time.monotonic() + REPLY_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(left * 1000), (
                f"no answer to a hello within {REPLY_S}s after a batch of {len(batch)}"
            )
            frames = sock.recv_multipart()
            reply = self.proto.codec.decode_reply(frames[0])
            self.replies += 1
            if isinstance(reply, self.proto.ErrorReply):
                errors += 1
                self.errors += 1
            elif isinstance(reply, self.proto.HelloReply) and reply.rid == want:
                break
        assert errors >= refused, f"{refused} malformed headers, only {errors} error replies"

    def call(self, msg: Any, frames: Sequence[bytes] = (), timeout: float = REPLY_S) -> list:
        """A fresh connection's hello then msg; the reply's frames (header decoded)."""
        sock = self.socket()
        try:
            sock.send(self.hello())
            sock.send_multipart([self.proto.encode(msg), *frames])
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                assert left > 0 and sock.poll(left * 1000), f"no answer to {msg} in {timeout}s"
                got = sock.recv_multipart()
                reply = self.proto.codec.decode_reply(got[0])
                if reply.rid == msg.rid:
                    return [reply, *got[1:]]
        finally:
            sock.close(0)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
        self.ctx.term()


# -- the HTTP side ---------------------------------------------------------------------


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    version: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    declared: int | str | None  # Content-Length as sent; None: none
    cut: int | None  # send only this many bytes of the whole request, then close

    def __repr__(self) -> str:
        raw = self.raw()
        return f"HttpRequest({len(raw)}B, cut={self.cut}: {raw[:400]!r})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis's printer
        p.text(repr(self))

    def raw(self) -> bytes:
        head = [f"{self.method} {self.path} {self.version}".strip()]
        head += [f"{k}: {v}" for k, v in self.headers]
        if self.declared is not None:
            head.append(f"Content-Length: {self.declared}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1", "replace") + self.body

    @property
    def complete(self) -> bool:
        """Whether a server has all it needs to answer (so it must answer)."""
        chunked = any(
            v.lower() == "chunked" for k, v in self.headers if k.lower() == "transfer-encoding"
        )
        return (
            self.cut is None
            and not chunked
            and self.version in ("HTTP/1.1", "HTTP/1.0")
            and self.method.isalpha()
            and (self.declared == len(self.body) or (self.declared is None and not self.body))
        )


def json_bodies(shapes: Sequence[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """JSON bodies: the API's own shapes with wrong-typed values, other JSON, bad JSON."""
    json_values = st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=False),
            st.text(max_size=20),
        ),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )

    @st.composite
    def shaped(draw: st.DrawFn) -> bytes:
        shape = dict(draw(st.sampled_from(list(shapes) or [{}])))
        for key in list(shape):
            if draw(st.booleans()):
                shape[key] = draw(json_values)
        return msgspec.json.encode(shape)

    bad = st.sampled_from([b"{", b"[1,", b'{"a": NaN}', b"\xff\xfe", b"null", b'"x"', b"{}" * 1000])
    return st.one_of(
        shaped(), shaped(), json_values.map(msgspec.json.encode), bad, st.binary(max_size=200)
    )


def http_requests(
    paths: Sequence[str], shapes: Sequence[dict[str, Any]], token: str = ""
) -> st.SearchStrategy[HttpRequest]:
    methods = st.one_of(
        st.sampled_from(
            ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW", "get"]
        ),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-_/ ", max_size=12),
    )
    path = st.one_of(
        st.sampled_from(list(paths)),
        st.sampled_from(list(paths)).map(lambda p: p + "?x=1&x=%00"),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/%._-?&=", max_size=60).map(
            lambda p: "/" + p
        ),
        st.sampled_from(["*", "//", "/" + "a" * 9000, "/../../etc/passwd", "http://x/health", ""]),
    )
    auth_values = [f"Bearer {token}", "Bearer nope", "Basic Zm9vOmJhcg==", "Bearer", ""]
    header = st.one_of(
        st.tuples(st.just("Authorization"), st.sampled_from(auth_values)),
        st.tuples(
            st.just("Content-Type"), st.sampled_from(["application/json", "text/plain", "x/"])
        ),
        st.tuples(st.just("Transfer-Encoding"), st.sampled_from(["chunked", "gzip", "identity"])),
        st.tuples(st.just("Expect"), st.just("100-continue")),
        st.tuples(st.just("Host"), st.sampled_from(["127.0.0.1", "", "a b", "x" * 300])),
        st.tuples(st.just("Connection"), st.sampled_from(["close", "keep-alive", "upgrade"])),
        st.tuples(
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20),
            st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=60),
        ),
        st.tuples(st.just("X-Big"), st.just("v" * 20_000)),
    )

    @st.composite
    def draw(draw: st.DrawFn) -> HttpRequest:
        if draw(st.booleans()):  # well-formed, so the handlers behind the parser run too
            body = draw(st.one_of(st.just(b""), json_bodies(shapes)))
            auth = (("Authorization", f"Bearer {token}"),) if token else ()
            return HttpRequest(
                draw(st.sampled_from(["GET", "POST"])),
                draw(st.sampled_from(list(paths))),
                "HTTP/1.1",
                (("Host", "127.0.0.1"), ("Content-Type", "application/json"), *auth),
                body,
                len(body),
                None,
            )
        body = draw(st.one_of(st.just(b""), json_bodies(shapes)))
        declared = draw(
            st.one_of(
                st.just(len(body)),
                st.none(),
                st.sampled_from([10**12, -1, "abc", "", " 5", "1e3", 2**64]),
                st.integers(0, len(body) + 100),
            )
        )
        req = HttpRequest(
            draw(methods),
            draw(path),
            draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/x", ""])),
            tuple(draw(st.lists(header, max_size=5))),
            body,
            declared,
            None,
        )
        if draw(st.integers(0, 4)) == 0:  # a client that gives up partway
            req = dataclasses.replace(req, cut=draw(st.integers(0, len(req.raw()))))
        return req

    return draw()


def send_http(host: str, port: int, req: HttpRequest, timeout: float = REPLY_S) -> int | None:
    """Send req on a fresh connection; the status of the answer, or None when none was
    due (an incomplete request) and none came. A complete request unanswered within
    timeout, or an answer that is not HTTP, fails."""
    raw = req.raw()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(raw if req.cut is None else raw[: req.cut])
        except OSError:
            return None  # the server closed on what it had read already: its right
        if req.cut is not None:
            return None
        sock.settimeout(timeout if req.complete else 0.1)
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            assert not req.complete, f"no answer in {timeout}s to {raw[:300]!r}"
            return None
        except ConnectionResetError:
            return None
    if not data:
        assert not req.complete, f"closed unanswered: {raw[:300]!r}"
        return None
    request_line = f"{req.method} {req.path} {req.version}".split()
    http1 = len(request_line) == 3 and req.version in ("HTTP/1.0", "HTTP/1.1")
    if not http1 and not data.startswith(b"HTTP/"):
        return None  # not an HTTP/1 request line: the stdlib answers as HTTP/0.9 would
    line = data.split(b"\r\n", 1)[0].split()
    assert len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit(), data[:200]
    status = int(line[1])
    assert 100 <= status < 600, data[:200]
    assert status < 500 or status in (502, 503, 504), f"{status} for {raw[:300]!r}: {data[:300]!r}"
    return status


SLOW_REQUESTS = (
    b"POST /x HTTP/1.1\r\nContent-Le",  # stopped in the headers
    # stopped in the body, and one that promised far more than it will ever send
    b'POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"a": ',
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{",
)


@contextlib.contextmanager
def slow_client(host: str, port: int) -> Iterator[None]:
    """Connections that each sent part of a request and went quiet, held open meanwhile
    (a server serving one request at a time would stall behind them)."""
    with contextlib.ExitStack() as stack:
        for partial in SLOW_REQUESTS:
            sock = stack.enter_context(socket.create_connection((host, port), timeout=5))
            sock.sendall(partial)
        yield


def http_get(
    host: str, port: int, path: str, token: str = "", timeout: float = REPLY_S
) -> tuple[int, bytes]:
    """A well-formed GET; (status, body)."""
    req = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    if token:
        req += f"Authorization: Bearer {token}\r\n"
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall((req + "\r\n").encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


PROBE_PATHS = ["/metrics", "/health", "/healthz", "/", "/metrics/x"]


def fuzz_probe_http(
    label: str,
    watched: Watched,
    port: int,
    seconds: float,
    *,
    paths: Sequence[str] = PROBE_PATHS,
    healthy: Callable[[int, bytes], bool] = lambda status, _body: status == 200,
    host: str = "127.0.0.1",
) -> dict[int | None, int]:
    """Fuzz a service's /metrics and /health endpoint; after each batch /metrics still
    answers Prometheus text and /health `healthy(status, body)`. The statuses seen."""
    statuses: dict[int | None, int] = {}

    def run_batch(batch: list[HttpRequest]) -> None:
        for req in batch:
            status = send_http(host, port, req)
            statuses[status] = statuses.get(status, 0) + 1
        with slow_client(host, port):
            status, body = http_get(host, port, "/metrics")
            assert status == 200 and b"# TYPE kvmesh_" in body, (status, body[:200])
            status, body = http_get(host, port, "/health")
            assert healthy(status, body), (status, body[:300])
        watched.check()

    requests = st.lists(http_requests(paths, [{}]), min_size=1, max_size=8)
    fuzz_for(label, requests, run_batch, seconds)
    return statuses
