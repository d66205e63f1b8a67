"""Audit of the cache-server's lm:// listener against a real process: what LMCache's
client can send (a chunk over max_value_size, a key of non-ASCII text that its client
cuts at 150 bytes) is served on the same connection, since that client never
reconnects; no value is ever served under a key it was not put under; the wire
details of the protocol facts hold; and small GETs do not stall."""

from __future__ import annotations

import os
import struct
import time
import urllib.request
from pathlib import Path

import pytest
from kvtest.lm_conn import LmConnection
from kvtest.remote import CacheServerProcess, run_lmcache_client

from kvmesh.common.protocol import lmcache_lm as lm

KiB = 1 << 10
MAX_VALUE = 256 * KiB
TIMEOUT_S = 1.0  # the server's request_timeout_s here


def _config(workdir: Path) -> Path:
    path = workdir / "cacheserver.yaml"
    path.write_text(f"cacheserver:\n  request_timeout_s: {TIMEOUT_S}\n")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("lm-audit")
    srv = CacheServerProcess(
        work,
        lm=True,
        metrics=True,
        **{"max-memory": "8MiB", "max-value-size": "256KiB", "config": _config(work)},
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


class Raw(LmConnection):
    """A bare lm:// connection: headers built field by field, key bytes as given."""

    def send(
        self,
        command: int,
        key: bytes,
        payload: bytes = b"",
        *,
        length: int | None = None,
        fields: tuple[int, ...] = (1, 2, 1, 0, 0, 0, 0),
    ) -> None:
        n = len(payload) if length is None else length
        head = struct.pack("=9i", command, n, *fields) + key.ljust(lm.KEY_BYTES, b" ")
        assert len(head) == lm.REQUEST_SIZE == 186
        self.sock.sendall(head + payload)

    def reply(self) -> tuple[int, ...]:
        return struct.unpack("=9i", self.recv_exact(lm.REPLY_SIZE))

    def get(self, key: bytes) -> tuple[tuple[int, ...], bytes]:
        self.send(lm.Command.GET, key)
        head = self.reply()
        return head, self.recv_exact(head[1]) if head[0] == 200 else b""

    def code(self, command: int, key: bytes) -> int:
        self.send(command, key)
        return self.reply()[0]

    def nothing_pending(self, wait_s: float = 0.2) -> bool:
        self.sock.settimeout(wait_s)
        try:
            self.sock.recv(1)  # a byte, or the connection closed: both fail the check
            return False
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(5)


def _metric(srv: CacheServerProcess, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {line_start}")


# -- a PUT over max_value_size ----------------------------------------------------------


def test_oversized_put_is_dropped_and_the_connection_goes_on(server) -> None:
    """PUT has no reply: refusing one by closing the connection ends LMCache's remote
    tier for good (its client never reconnects). The payload is read and dropped."""
    c = Raw(server.lm_port)
    too_large = _metric(server, 'kvmesh_cacheserver_errors_total{code="value_too_large"}')
    warned = server.log.read_text().count("puts over max_value_size are dropped")
    try:
        c.send(lm.Command.PUT, b"kept", b"k" * 100)
        c.send(lm.Command.PUT, b"replaced", b"old" * 10)
        c.send(lm.Command.PUT, b"huge", os.urandom(MAX_VALUE + 1))
        c.send(lm.Command.PUT, b"replaced", os.urandom(4 * MAX_VALUE))
        assert c.nothing_pending()  # still no reply to any PUT
        assert c.code(lm.Command.EXIST, b"kept") == 200
        assert c.code(lm.Command.EXIST, b"huge") == 400
        head, body = c.get(b"huge")
        assert (head[0], head[1], body) == (400, 0, b"")
        # The client was told nothing, so it thinks its new value stored: the old one
        # must not come back in its place.
        assert c.get(b"replaced")[0][0] == 400
        head, body = c.get(b"kept")
        assert head[0] == 200 and body == b"k" * 100
        assert c.code(lm.Command.HEALTH, b"h") == 200
    finally:
        c.close()
    after = _metric(server, 'kvmesh_cacheserver_errors_total{code="value_too_large"}')
    assert after - too_large == 2
    # One warning for the connection, not one per chunk: the counter counts them all.
    assert server.log.read_text().count("puts over max_value_size are dropped") == warned + 1


def test_oversized_put_that_never_arrives_is_closed_by_deadline(server) -> None:
    """Dropping a payload still has the payload deadline: a peer that announces 2 GiB
    and sends little is closed within request_timeout_s, and others go on."""
    good, evil = Raw(server.lm_port), Raw(server.lm_port)
    try:
        good.send(lm.Command.PUT, b"other", b"o" * 10)
        evil.send(lm.Command.PUT, b"x", b"y" * 1000, length=2**31 - 1)
        t0 = time.monotonic()
        assert evil.closed_within(TIMEOUT_S + 3)
        assert time.monotonic() - t0 < TIMEOUT_S + 2
        assert good.get(b"other")[1] == b"o" * 10
    finally:
        good.close()
        evil.close()


def test_lmcache_client_survives_a_chunk_over_max_value_size(server) -> None:
    """LMCache's own client puts a 512 KiB chunk (over 256 KiB) and then ordinary ones on
    the same connection: the big one is a miss, the rest are stored and read back."""
    result = run_lmcache_client(server.lm_port, "4", "1", "--big-first", "--wait", "5")
    assert result["contains"] == [True] * 4, result
    assert result["equal"] == [True] * 4, result
    assert result["big_contains"] is False
    assert result["absent_contains"] is False and result["missing_get"] is True


def test_store_refusal_drops_the_old_value(tmp_path) -> None:
    """A PUT within max_value_size the store still refuses (it and its bookkeeping are
    over max_memory): the old value under that key is not served in its place."""
    srv = CacheServerProcess(
        tmp_path, lm=True, **{"max-memory": "256KiB", "max-value-size": "256KiB"}
    ).start()
    c = Raw(srv.lm_port)
    try:
        c.send(lm.Command.PUT, b"k", b"old")
        assert c.get(b"k")[1] == b"old"
        c.send(lm.Command.PUT, b"k", os.urandom(MAX_VALUE))
        assert c.get(b"k")[0][0] == 400
        c.send(lm.Command.PUT, b"k2", b"new")
        assert c.get(b"k2")[1] == b"new"
    finally:
        c.close()
        assert srv.stop() == 0, srv.log.read_text()[-2000:]


# -- keys LMCache's client cuts at 150 bytes --------------------------------------------

CJK = "模"  # three bytes of UTF-8


def test_keys_cut_at_a_character_boundary_never_serve_each_other(server) -> None:
    """LMCache checks a key's length in characters, then sends its first 150 bytes: two
    keys of non-ASCII text that differ after byte 150 arrive as the same bytes."""
    model = CJK * 50  # 150 bytes alone: every chunk key of this model is cut to it
    a = f"{model}@1@0@aaaa@half".encode()
    b = f"{model}@1@0@bbbb@half".encode()
    assert len(f"{model}@1@0@aaaa@half") <= lm.KEY_BYTES < len(a)  # passes LMCache's check
    assert a[: lm.KEY_BYTES] == b[: lm.KEY_BYTES]
    c = Raw(server.lm_port)
    try:
        c.send(lm.Command.PUT, a[: lm.KEY_BYTES], b"A" * 64)
        c.send(lm.Command.PUT, b[: lm.KEY_BYTES], b"B" * 64)
        head, body = c.get(a[: lm.KEY_BYTES])  # asked for a: must not get b's bytes
        assert (head[0], body) == (400, b""), body[:8]
        assert c.code(lm.Command.EXIST, b[: lm.KEY_BYTES]) == 400
        c.send(lm.Command.PUT, b"plain", b"p")
        assert c.get(b"plain")[1] == b"p"
    finally:
        c.close()


def test_a_key_cut_on_a_space_inside_a_tag_is_never_found(server) -> None:
    """Two 153-byte keys that differ after a space in a tag's value arrive as one
    (LMCache's client cuts at 150 bytes); what is left still ends like a key, so near
    the limit a padded key ending in a tag is refused."""
    c = Raw(server.lm_port)
    try:
        for model, gap in ((CJK * 42, " "), ("模型" + "x" * 102, " " * 20)):
            keys = [(model + f"@1@0@abc@half@user%Jane{gap}{who}").encode() for who in "DR"]
            assert all(len(k) > lm.KEY_BYTES for k in keys)
            cut = keys[0][: lm.KEY_BYTES]
            assert cut == keys[1][: lm.KEY_BYTES] and cut.endswith(b" ")
            c.send(lm.Command.PUT, cut, b"doe's KV")
            assert c.code(lm.Command.EXIST, cut) == 400
            assert c.get(cut)[0][0] == 400
        # So a key that is not ASCII and has tags is never cached, cut or not.
        short = (CJK + "@1@0@abc@half@lmcache.tag.user%josé").encode()
        c.send(lm.Command.PUT, short, b"v")
        assert c.code(lm.Command.EXIST, short) == 400
    finally:
        c.close()


def test_key_cut_inside_a_character_keeps_the_connection(server) -> None:
    """A key cut inside a character is not UTF-8, but it is what LMCache's client sends
    for a long non-ASCII model name: a miss, not a closed connection."""
    cut = ("é" + CJK * 50 + "@1@0@abc@half").encode()[: lm.KEY_BYTES]
    with pytest.raises(UnicodeDecodeError):
        cut.decode()
    c = Raw(server.lm_port)
    try:
        c.send(lm.Command.PUT, cut, b"z" * 4096)
        assert c.code(lm.Command.EXIST, cut) == 400
        assert c.get(cut)[0][:2] == (400, 0)
        c.send(lm.Command.PUT, b"after-cut", b"ok")
        assert c.get(b"after-cut")[1] == b"ok"
        assert c.code(lm.Command.HEALTH, b"h") == 200
    finally:
        c.close()


@pytest.mark.parametrize(
    "model",
    [CJK * 50, CJK * 49 + "ab zz"],
    ids=["cut-in-a-character-run", "cut-on-a-space"],
)
def test_lmcache_client_with_a_long_non_ascii_model_never_gets_another_chunk(
    server, model: str
) -> None:
    """LMCache's own client, a model name whose keys LMCache cuts to part of the model
    name: every chunk must be a miss, never another chunk's KV. Cut on a space, the key
    looks padded: only its missing fields give it away."""
    result = run_lmcache_client(server.lm_port, "4", "2", "--model", model, "--wait", "1")
    assert result["key_bytes"] > lm.KEY_BYTES
    assert result["found"] == [False] * 4, result
    assert result["contains"] == [False] * 4, result
    assert result["absent_contains"] is False and result["missing_get"] is True, result


def test_keys_that_cannot_have_been_cut_still_work(server) -> None:
    """Exactly 150 ASCII bytes (LMCache's largest key) and shorter non-ASCII keys of
    LMCache's shape are stored as given; trailing spaces are padding."""
    c = Raw(server.lm_port)
    tail = "@1@0@abc@half"
    try:
        for key in (
            b"x" * 150,
            ("é" * 68 + tail).encode(),
            (CJK * 45 + tail).encode(),
            (CJK * 10 + tail + "@3").encode(),  # a layer id
            ("/models/模型@v2" + tail).encode(),  # "@" in the model name
            ("模@1@0@-abc@fp8_e4m3fn@3").encode(),
            b"pad   ",
        ):
            c.send(lm.Command.PUT, key, key[:20])
            head, body = c.get(key)
            assert head[0] == 200 and body == key[:20], key
        assert c.get(b"pad")[1] == b"pad   "[:20]
    finally:
        c.close()


# -- wire facts -------------------------------------------------------------------------


def test_wire_facts(server) -> None:
    c = Raw(server.lm_port)
    try:
        # PUT: no reply; GET echoes fmt, dtype and shape exactly (location last).
        c.send(lm.Command.PUT, b"f", b"12345678", fields=(6, 8, 2, 7, -3, 0, 9))
        assert c.nothing_pending()
        head, body = c.get(b"f")
        assert head == (200, 8, 6, 8, 7, -3, 0, 9, 2) and body == b"12345678"
        assert c.nothing_pending()  # nothing after the payload
        # GET miss: 400, length 0, the reference's placeholders, no payload.
        assert c.get(b"nope") == ((400, 0, 1, 2, 0, 0, 0, 0, 0), b"")
        assert c.nothing_pending()
        assert c.code(lm.Command.EXIST, b"f") == 200
        assert c.code(lm.Command.HEALTH, b"h") == 200
        assert c.code(lm.Command.LIST, b"l") == 400
        assert c.nothing_pending()
    finally:
        c.close()


def test_small_get_round_trip(server) -> None:
    """1000 GETs of a 16 KiB value: no Nagle plus delayed-ACK stall (~44 ms)."""
    c = Raw(server.lm_port)
    try:
        c.send(lm.Command.PUT, b"rtt", os.urandom(16 * KiB))
        times = []
        for _ in range(1000):
            t0 = time.perf_counter()
            head, body = c.get(b"rtt")
            times.append(time.perf_counter() - t0)
            assert head[0] == 200 and len(body) == 16 * KiB
        times.sort()
        p50, p99 = times[500], times[990]
        print(f"lm:// 16 KiB GET round trip p50={p50 * 1e6:.0f}us p99={p99 * 1e6:.0f}us")
        assert p50 < 0.005 and p99 < 0.03, (p50, p99)
    finally:
        c.close()


# -- memory held by a PUT in flight -----------------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _peak_rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmHWM")


def _rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS")


def test_headers_alone_of_large_puts_commit_no_memory_and_stall_no_one(tmp_path) -> None:
    """16 connections each announce a 256 MiB PUT and send nothing more: the server
    commits no memory for payloads that have not arrived (a zero-filled buffer per
    header committed 4 GiB and held the event loop ~0.15 s each), and a client's
    HEALTH round trips meanwhile stay fast."""
    srv = CacheServerProcess(
        tmp_path, lm=True, **{"max-memory": "256MiB", "max-value-size": "256MiB"}
    ).start()
    assert srv.proc is not None
    good, idle = Raw(srv.lm_port), [Raw(srv.lm_port) for _ in range(16)]
    try:
        before = _rss_kib(srv.proc.pid)
        for c in idle:
            c.send(lm.Command.PUT, b"big", length=256 << 20)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            assert good.code(lm.Command.HEALTH, b"h") == 200
            times.append(time.perf_counter() - t0)
        grown = (_rss_kib(srv.proc.pid) - before) * 1024
        assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB for headers alone"
        assert sorted(times)[len(times) // 2] < 0.02, times
    finally:
        for c in (good, *idle):
            c.close()
        assert srv.stop() == 0, srv.log.read_text()[-2000:]


def test_stored_values_take_no_memory_mapping_each(tmp_path) -> None:
    """A mapping per stored value ran the process out of mappings (65530 on Linux) at
    64 GiB of 1 MiB values: the next PUT reset LMCache's connection for good."""
    srv = CacheServerProcess(
        tmp_path, lm=True, **{"max-memory": "512MiB", "max-value-size": "4MiB"}
    ).start()
    assert srv.proc is not None
    maps = Path(f"/proc/{srv.proc.pid}/maps")
    c = Raw(srv.lm_port)
    try:
        before = len(maps.read_text().splitlines())
        value = os.urandom(1 << 20)
        for i in range(200):
            c.send(lm.Command.PUT, f"m@1@0@{i:x}@half".encode(), value)
        assert c.code(lm.Command.EXIST, b"m@1@0@c7@half") == 200
        grown = len(maps.read_text().splitlines()) - before
        assert grown < 50, f"{grown} mappings more for 200 values"
    finally:
        c.close()
        assert srv.stop() == 0, srv.log.read_text()[-2000:]


def test_put_holds_its_value_once(tmp_path) -> None:
    """A PUT's payload is read into its own buffer: the server's peak memory grows by
    about the value, not twice it (the stream's buffer plus readexactly's copy)."""
    size = 96 << 20
    srv = CacheServerProcess(
        tmp_path, lm=True, **{"max-memory": "256MiB", "max-value-size": "128MiB"}
    ).start()
    assert srv.proc is not None
    c = Raw(srv.lm_port)
    try:
        before = _peak_rss_kib(srv.proc.pid)
        c.send(lm.Command.PUT, b"big", os.urandom(size))
        assert c.code(lm.Command.EXIST, b"big") == 200
        grown = (_peak_rss_kib(srv.proc.pid) - before) * 1024
        assert grown < 1.4 * size, f"peak grew {grown >> 20} MiB for a {size >> 20} MiB PUT"
    finally:
        c.close()
        assert srv.stop() == 0, srv.log.read_text()[-2000:]


# -- the same store as kvmesh's own protocol --------------------------------------------


async def test_lm_values_share_the_store_but_not_the_names(tmp_path) -> None:
    """A key put over lm:// and the same name put natively are two values; lm:// values
    count against max_memory (a native put evicts them, a later GET misses) and in the
    stats, and native listing never shows them."""
    from kvmesh.common.transport.cacheserver_client import CacheServerClient

    srv = CacheServerProcess(
        tmp_path, lm=True, metrics=True, **{"max-memory": "1MiB", "max-value-size": "512KiB"}
    ).start()
    client = CacheServerClient(srv.endpoint)
    c = Raw(srv.lm_port)
    try:
        await client.connect()
        c.send(lm.Command.PUT, b"same", b"from-lm", fields=(1, 2, 1, 1, 2, 3, 4))
        await client.put("same", b"from-kvmesh", meta=b"m")
        got = await client.get("same")
        assert got is not None and bytes(got.data) == b"from-kvmesh" and got.meta == b"m"
        head, body = c.get(b"same")
        assert head[:2] == (200, 7) and head[4:8] == (1, 2, 3, 4) and body == b"from-lm"
        assert [k async for k in client.list_keys()] == ["same"]
        c.send(lm.Command.PUT, b"lm-big", os.urandom(400 * KiB))
        assert c.code(lm.Command.EXIST, b"lm-big") == 200
        stats = await client.stats()
        assert stats.keys == 3 and stats.memory_bytes > 400 * KiB
        await client.put("native-big", os.urandom(500 * KiB))
        await client.put("native-big-2", os.urandom(500 * KiB))  # evicts lm-big
        misses = _metric(srv, 'kvmesh_cacheserver_misses_total{reason="evicted"}')
        assert c.get(b"lm-big")[0][0] == 400
        assert _metric(srv, 'kvmesh_cacheserver_misses_total{reason="evicted"}') == misses + 1
    finally:
        c.close()
        await client.close()
        assert srv.stop() == 0, srv.log.read_text()[-2000:]
