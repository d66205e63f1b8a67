"""Disaggregated prefill between two real engines: a prefiller pushes a prompt's KV,
layer by layer, into buffers the decoder allocated (NIXL WRITE and the ZMQ channel),
and the decoder then loads exactly those bytes. A decoder out of room refuses, a
corrupted push is dropped, an abandoned allocation is freed, and malformed PD messages
get error replies."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq
from kvtest.p2p import CHUNK, kv_cache, prompt, slot_bytes
from kvtest.paged import drain

from kvmesh.common import offload
from kvmesh.common.chunk_codec import payload_checksum
from kvmesh.common.config import EngineConfig, L1Config, P2PConfig, PDConfig
from kvmesh.common.protocol import p2p as proto
from kvmesh.services.worker import pd_receiver, pd_sender
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.pd_receiver import hold_id
from kvmesh.services.worker.pd_sender import PdTarget, push_layers

N = 3 * CHUNK + CHUNK // 2  # three full chunks and a partial one


def make(
    role: str, channel: str, seed: int | None, *, fraction: float = 0.5, hold_s: float = 30.0
) -> KVEngine:
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="pd-test",
        l1=L1Config(max_size=4 << 20, reserve=0, alloc_timeout_s=0.2),
        p2p=P2PConfig(channel=channel, timeout_s=2.0),
        pd=PDConfig(role=role, timeout_s=2.0, max_receive_fraction=fraction, hold_s=hold_s),
        close_flush_s=0,
    )
    cache = kv_cache(seed)
    engine = KVEngine(f"{role}-{channel}", 0, cfg, cache)
    engine.test_cache = cache  # what the tests compare bytes of
    return engine


@pytest.fixture(params=["nixl", "zmq", "zmq-threads"])
def pair(request, monkeypatch) -> Iterator[tuple[KVEngine, KVEngine]]:
    channel = request.param.removesuffix("-threads")
    if request.param.endswith("-threads"):
        # Every push gathers its regions and lands its frames on a thread, as a push of
        # a megabyte and more does.
        monkeypatch.setattr(offload, "OFFLOAD_FROM", 1)
    prefiller = make("sender", channel, seed=1)
    decoder = make("receiver", channel, seed=None)
    yield prefiller, decoder
    prefiller.close()
    decoder.close()


def metric(engine: KVEngine, name: str, **labels: str) -> float:
    return engine.stats.metrics.value(name, labels or None)


@pytest.mark.parametrize("layerwise", [True, False])
def test_pushed_kv_loads_on_the_decoder_bit_for_bit(pair, layerwise: bool) -> None:
    prefiller, decoder = pair
    tokens, slots = prompt(5, N), torch.arange(N)
    target = PdTarget("t-1", decoder.p2p_endpoint)
    gen = push_layers(prefiller, tokens, slots, None, target, layerwise=layerwise)
    steps = 0
    while True:
        try:
            next(gen)
            steps += 1
        except StopIteration as stop:
            pushed = stop.value
            break
    # Layer by layer: one step per layer but the last (the final next() commits).
    assert steps == (prefiller.layout.num_layers - 1 if layerwise else 0)
    assert pushed == N
    # The decoder holds every chunk, the partial last one included, pinned for the
    # transfer until released.
    assert hold_id("t-1") in decoder.pd_receiver.pins
    assert decoder.lookup(tokens, pin=False) == N
    dst_slots = slots + 5 * 16  # other blocks on the decoder
    loaded = decoder.retrieve(tokens, dst_slots)
    assert int(loaded.sum()) == N
    assert slot_bytes(decoder.test_cache, dst_slots) == slot_bytes(prefiller.test_cache, slots)
    assert metric(decoder, "pd_received_chunks_total") == 4
    assert metric(prefiller, "pd_pushes_total", outcome="ok") == 1
    assert decoder.pd_receiver.inflight == 0 and decoder.pd_receiver.pages == 0
    # One allocation; the last layer (or the whole chunks) goes in one group here (a few
    # KiB), committed once. NIXL writes without a message; over ZMQ each earlier layer is
    # one push, and each group of the last one.
    groups = 1
    pushes = (prefiller.layout.num_layers - 1 if layerwise else 0) + groups
    if prefiller.pd_sender.channel.name != "zmq":
        pushes = 0
    assert metric(decoder, "p2p_server_requests_total", kind="pd") == 1 + pushes + groups
    decoder.release_lookup(hold_id("t-1"))
    assert hold_id("t-1") not in decoder.pd_receiver.pins
    # Released: what was received leaves L1, so later transfers find free pages.
    deadline = time.monotonic() + 2.0
    while decoder.pool.used_pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decoder.pool.used_pages == 0
    assert decoder.lookup(tokens, pin=False) == 0
    # The prefiller cached what it copied out, like any saved prompt.
    assert prefiller.lookup(tokens, pin=False) == N


def test_groups_written_back_to_back_each_commit_and_load_bit_for_bit(pair, monkeypatch) -> None:
    # Groups of one chunk: four writes in one go, four commits, the first three verified
    # on one thread while later groups are still being written.
    monkeypatch.setattr(pd_sender, "GROUP_BYTES", 1)
    prefiller, decoder = pair
    tokens, slots = prompt(6, N), torch.arange(N)
    target = PdTarget("t-g", decoder.p2p_endpoint)
    assert drain(push_layers(prefiller, tokens, slots, None, target, layerwise=False)) == N
    pushes = 4 if prefiller.pd_sender.channel.name == "zmq" else 0
    assert metric(decoder, "p2p_server_requests_total", kind="pd") == 1 + pushes + 4
    assert metric(decoder, "pd_received_chunks_total") == 4
    assert metric(decoder, "pd_rejected_chunks_total") == 0
    dst_slots = slots + 5 * 16
    assert int(decoder.retrieve(tokens, dst_slots).sum()) == N
    assert slot_bytes(decoder.test_cache, dst_slots) == slot_bytes(prefiller.test_cache, slots)
    assert decoder.pd_receiver.inflight == 0 and decoder.pd_receiver.pages == 0


def test_decoder_without_room_refuses_and_nothing_is_held() -> None:
    prefiller = make("sender", "zmq", seed=1)
    decoder = make("receiver", "zmq", seed=None, fraction=1e-9)  # a one-page share
    try:
        tokens, slots = prompt(5, N), torch.arange(N)
        pushed = drain(
            push_layers(prefiller, tokens, slots, None, PdTarget("t", decoder.p2p_endpoint))
        )
        assert pushed == 0
        assert metric(prefiller, "pd_pushes_total", outcome="refused") == 1
        assert metric(decoder, "pd_receive_allocs_total", outcome="refused") == 1
        assert decoder.lookup(tokens, pin=False) == 0
        assert decoder.pd_receiver.pages == 0 and decoder.pool.used_pages == 0
        # The prefiller still cached its prompt: a refusal costs the decoder a
        # recompute, not the prefiller its cache.
        assert prefiller.lookup(tokens, pin=False) == N
    finally:
        prefiller.close()
        decoder.close()


def test_chunks_of_a_decode_that_never_comes_are_dropped_after_hold_s() -> None:
    prefiller = make("sender", "zmq", seed=1)
    decoder = make("receiver", "zmq", seed=None, hold_s=0.3)
    try:
        tokens, slots = prompt(5, N), torch.arange(N)
        target = PdTarget("t", decoder.p2p_endpoint)
        assert drain(push_layers(prefiller, tokens, slots, None, target)) == N
        assert decoder.pool.used_pages == 4
        deadline = time.monotonic() + 3.0
        while decoder.pool.used_pages and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decoder.pool.used_pages == 0
        assert metric(decoder, "pd_transfers_held") == 0
    finally:
        prefiller.close()
        decoder.close()


def test_push_to_a_dead_decoder_gives_up_by_the_deadline() -> None:
    prefiller = make("sender", "zmq", seed=1)
    try:
        tokens, slots = prompt(5, N), torch.arange(N)
        t0 = time.monotonic()
        pushed = drain(
            push_layers(prefiller, tokens, slots, None, PdTarget("t", "tcp://127.0.0.1:9"))
        )
        assert pushed == 0
        assert time.monotonic() - t0 < prefiller.config.pd.timeout_s + 2.0
        assert metric(prefiller, "pd_pushes_total", outcome="failed") == 1
        assert prefiller.lookup(tokens, pin=False) == N
    finally:
        prefiller.close()


class _Raw:
    """A DEALER speaking the peer protocol by hand: a prefiller that misbehaves."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvtimeo = 3000
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes) -> proto.Reply:
        self.sock.send_multipart(list(frames))
        return proto.decode_reply(self.sock.recv_multipart()[:1])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _alloc(decoder: KVEngine, n_chunks: int, last: int, **kw) -> proto.AllocChunks:
    shape = list(decoder.layout.chunk_shape(CHUNK))
    keys = [k.to_str() for _, _, k in decoder.chunks(prompt(8, (n_chunks - 1) * CHUNK + last))]
    fields = dict(
        rid=1,
        version=proto.PROTOCOL_VERSION,
        transfer_id="raw",
        keys=keys,
        chunk_shape=shape,
        dtype="float16",
        fmt=int(decoder.chunk_format),
        last_tokens=last,
        deadline=time.time() + 0.2,
    )
    fields.update(kw)
    return proto.AllocChunks(**fields)


def test_abandoned_allocation_is_freed_and_cancel_frees_at_once() -> None:
    decoder = make("receiver", "zmq", seed=None)
    raw = _Raw(decoder.p2p_endpoint)
    try:
        reply = raw.ask(proto.encode(_alloc(decoder, 3, CHUNK // 2)))
        assert isinstance(reply, proto.AllocChunksReply) and len(reply.slots) == 3
        assert decoder.pd_receiver.pages == 3 and decoder.pool.used_pages == 3
        # The "prefiller" goes silent: after its deadline plus the grace, the pages
        # come back on their own.
        deadline = time.monotonic() + decoder.config.pd.timeout_s + 3.0
        while decoder.pd_receiver.pages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decoder.pd_receiver.pages == 0 and decoder.pool.used_pages == 0
        assert metric(decoder, "pd_expired_allocs_total") == 1
        # A cancelled allocation is freed at once; a commit to it is then refused.
        reply = raw.ask(proto.encode(_alloc(decoder, 2, CHUNK, rid=2, deadline=0.0)))
        assert decoder.pool.used_pages == 2
        cancel = proto.CancelChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id)
        assert raw.ask(proto.encode(cancel)) == proto.CancelChunksReply(3, True)
        assert decoder.pool.used_pages == 0
        commit = proto.CommitChunks(4, proto.PROTOCOL_VERSION, reply.alloc_id, [0, 0])
        err = raw.ask(proto.encode(commit))
        assert isinstance(err, proto.ErrorReply)
        assert err.code == proto.ErrorCode.UNKNOWN_TRANSFER
    finally:
        raw.close()
        decoder.close()


def test_bad_checksum_is_rejected_and_never_loaded() -> None:
    decoder = make("receiver", "zmq", seed=None)
    raw = _Raw(decoder.p2p_endpoint)
    try:
        msg = _alloc(decoder, 2, CHUNK, deadline=0.0)
        reply = raw.ask(proto.encode(msg))
        # Write chunk bytes over ZMQ, whole chunks, then commit with wrong sums.
        frames = [b"\x01" * s.nbytes for s in reply.slots]
        push = proto.PushChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id, -1, [0, 1])
        assert isinstance(raw.ask(proto.encode(push), *frames), proto.PushChunksReply)
        commit = proto.CommitChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id, [1, 2])
        done = raw.ask(proto.encode(commit))
        assert done == proto.CommitChunksReply(3, 0, 2)
        tokens = prompt(8, 2 * CHUNK)
        assert decoder.lookup(tokens, pin=False) == 0
        assert decoder.pool.used_pages == 0
        assert metric(decoder, "pd_rejected_chunks_total") == 2
    finally:
        raw.close()
        decoder.close()


def test_chunks_commit_in_groups_and_a_committed_chunk_is_never_written_again() -> None:
    decoder = make("receiver", "zmq", seed=None)
    raw = _Raw(decoder.p2p_endpoint)
    try:
        reply = raw.ask(proto.encode(_alloc(decoder, 3, CHUNK, deadline=0.0)))
        frames = [bytes([i + 1]) * s.nbytes for i, s in enumerate(reply.slots)]
        push = proto.PushChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id, -1, [0, 1, 2])
        assert isinstance(raw.ask(proto.encode(push), *frames), proto.PushChunksReply)
        sums = [payload_checksum(f) for f in frames]
        first = proto.CommitChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id, sums[1:2], [1])
        assert raw.ask(proto.encode(first)) == proto.CommitChunksReply(3, 1, 0)
        assert decoder.pd_receiver.inflight == 1 and decoder.pd_receiver.pages == 2
        # Chunk 1 is in L1 now: a write or a second commit to it is refused.
        again = proto.PushChunks(4, proto.PROTOCOL_VERSION, reply.alloc_id, -1, [1])
        err = raw.ask(proto.encode(again), frames[0])
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        twice = proto.CommitChunks(5, proto.PROTOCOL_VERSION, reply.alloc_id, sums[1:2], [1])
        err = raw.ask(proto.encode(twice))
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        # The rest (an empty list: every chunk still pending) ends the allocation.
        rest = proto.CommitChunks(6, proto.PROTOCOL_VERSION, reply.alloc_id, [sums[0], sums[2]])
        assert raw.ask(proto.encode(rest)) == proto.CommitChunksReply(6, 2, 0)
        assert decoder.pd_receiver.inflight == 0 and decoder.pd_receiver.pages == 0
        assert decoder.lookup(prompt(8, 3 * CHUNK), pin=False) == 3 * CHUNK
        assert hold_id("raw") in decoder.pd_receiver.pins
    finally:
        raw.close()
        decoder.close()


def test_malformed_pd_messages_get_error_replies() -> None:
    decoder = make("receiver", "zmq", seed=None)
    raw = _Raw(decoder.p2p_endpoint)
    try:
        cases = [
            # wrong layout (another dtype), unknown format, bad last_tokens, no keys
            (_alloc(decoder, 2, CHUNK, dtype="bfloat16"), proto.ErrorCode.BAD_LAYOUT),
            (_alloc(decoder, 2, CHUNK, fmt=99), proto.ErrorCode.BAD_LAYOUT),
            (_alloc(decoder, 2, CHUNK + 1), proto.ErrorCode.BAD_MESSAGE),
            (_alloc(decoder, 1, CHUNK, keys=[]), proto.ErrorCode.BAD_MESSAGE),
            (_alloc(decoder, 1, CHUNK, keys=["not-a-key"]), proto.ErrorCode.BAD_KEY),
            (
                proto.CommitChunks(1, proto.PROTOCOL_VERSION, 12345, []),
                proto.ErrorCode.UNKNOWN_TRANSFER,
            ),
        ]
        for msg, code in cases:
            err = raw.ask(proto.encode(msg))
            assert isinstance(err, proto.ErrorReply) and err.code == code, (msg, err)
        reply = raw.ask(proto.encode(_alloc(decoder, 2, CHUNK, deadline=0.0)))
        # A push whose frame count or sizes do not match: an error, nothing written.
        push = proto.PushChunks(5, proto.PROTOCOL_VERSION, reply.alloc_id, 0, [0, 1])
        err = raw.ask(proto.encode(push), b"x")
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        err = raw.ask(proto.encode(push), b"x", b"y")
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        bad_layer = proto.PushChunks(6, proto.PROTOCOL_VERSION, reply.alloc_id, 99, [0])
        err = raw.ask(proto.encode(bad_layer), b"x")
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        # Not msgpack at all, and an unknown tag.
        err = raw.ask(b"\xc1garbage")
        assert isinstance(err, proto.ErrorReply)
        err = raw.ask(msgspec.msgpack.encode(["alloc_x", 1, 1]))
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.UNKNOWN_MESSAGE
        # Still serving: a well-formed request works.
        assert isinstance(
            raw.ask(proto.encode(proto.Hello(9, proto.PROTOCOL_VERSION))), proto.HelloReply
        )
    finally:
        raw.close()
        decoder.close()


def test_engine_without_receiver_role_refuses_pd_messages() -> None:
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="pd-test",
        l1=L1Config(max_size=4 << 20, reserve=0),
        p2p=P2PConfig(enabled=True, channel="zmq"),
        close_flush_s=0,
    )
    peer = KVEngine("plain", 0, cfg, kv_cache(None))
    raw = _Raw(peer.p2p_endpoint)
    try:
        err = raw.ask(proto.encode(_alloc(peer, 1, CHUNK)))
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.NOT_RECEIVER
    finally:
        raw.close()
        peer.close()


async def _ticks_while(aw):
    """(how many times another task ran while aw was awaited, aw's result)."""
    ticks, done = 0, False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    ticks = 0
    try:
        result = await aw
    finally:
        seen, done = ticks, True
        await task
    return seen, result


def _on_loop(engine: KVEngine, fn):
    async def call():
        return fn()

    return engine.loop.submit(call()).result(5)


@pytest.mark.parametrize("threshold", [1, 1 << 40])
def test_pushed_frames_land_on_a_thread_from_a_megabyte(monkeypatch, threshold: int) -> None:
    # At or above the threshold the copy runs on a thread and the loop serves other
    # tasks meanwhile; below, it runs inline (no other task runs during the push).
    monkeypatch.setattr(offload, "OFFLOAD_FROM", threshold)
    decoder = make("receiver", "zmq", seed=None)
    try:
        receiver = decoder.pd_receiver
        reply = _on_loop(decoder, lambda: receiver.alloc(_alloc(decoder, 3, CHUNK, deadline=0.0)))
        gen = torch.Generator().manual_seed(3)
        frames = [
            torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
            for s in reply.slots
        ]
        push = proto.PushChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id, -1, [0, 1, 2])
        views = [memoryview(f) for f in frames]
        fut = decoder.loop.submit(_ticks_while(receiver.push(push, views)))
        ticks, answer = fut.result(5)
        assert answer == proto.PushChunksReply(2, 3)
        assert (ticks > 0) == (threshold == 1)
        # The bytes are those sent: the commit's checksums verify, and the pages hold them.
        objs = receiver._inbound[reply.alloc_id].objs
        assert [bytes(o.raw.numpy()) for o in objs] == frames
        sums = [payload_checksum(f) for f in frames]
        commit = proto.CommitChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id, sums)
        done = decoder.loop.submit(receiver.commit(commit)).result(5)
        assert done == proto.CommitChunksReply(3, 3, 0)
    finally:
        decoder.close()


def test_a_cancel_while_frames_are_copied_frees_the_pages_after_the_copy(monkeypatch) -> None:
    monkeypatch.setattr(offload, "OFFLOAD_FROM", 1)
    started, go = threading.Event(), threading.Event()
    copy = pd_receiver._write_regions

    def held_copy(copies) -> None:
        started.set()
        assert go.wait(5)
        copy(copies)

    monkeypatch.setattr(pd_receiver, "_write_regions", held_copy)
    decoder = make("receiver", "zmq", seed=None)
    try:
        receiver = decoder.pd_receiver
        reply = _on_loop(decoder, lambda: receiver.alloc(_alloc(decoder, 2, CHUNK, deadline=0.0)))
        frames = [memoryview(b"\x07" * s.nbytes) for s in reply.slots]
        push = proto.PushChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id, -1, [0, 1])
        fut = decoder.loop.submit(receiver.push(push, frames))
        assert started.wait(5)
        cancel = proto.CancelChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id)
        cancelled = _on_loop(decoder, lambda: receiver.cancel(cancel))
        assert cancelled == proto.CancelChunksReply(3, True)
        # Cancelled, but the thread still writes into both pages: they stay taken.
        assert receiver.pages == 0 and decoder.pool.used_pages == 2
        go.set()
        assert fut.result(5) == proto.PushChunksReply(2, 2)
        deadline = time.monotonic() + 2.0
        while decoder.pool.used_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decoder.pool.used_pages == 0
    finally:
        go.set()
        decoder.close()


def test_an_abandoned_push_frees_the_decoder_buffers_only_after_its_write(monkeypatch) -> None:
    """A cancel does not stop a NIXL WRITE on the channel's thread: the decoder's
    receive pages are cancelled only once it has ended, so it cannot land in a page that
    holds another transfer's chunk by then."""
    from kvmesh.common.transport import channel_nixl

    writing, go = threading.Event(), threading.Event()
    transfer = channel_nixl.NixlChannel._transfer

    def held(self, peer, local, remote, deadline, op="READ") -> None:  # a big layer, far
        if op == "WRITE":
            writing.set()
            assert go.wait(5)
        transfer(self, peer, local, remote, deadline, op)

    monkeypatch.setattr(channel_nixl.NixlChannel, "_transfer", held)
    prefiller = make("sender", "nixl", seed=1)
    decoder = make("receiver", "nixl", seed=None)
    try:
        tokens, slots = prompt(5, 2 * CHUNK), torch.arange(2 * CHUNK)
        gen = push_layers(prefiller, tokens, slots, None, PdTarget("a", decoder.p2p_endpoint))
        next(gen)  # layer 0 handed to the loop
        assert writing.wait(5)
        gen.close()  # the step is abandoned while layer 0's WRITE runs
        time.sleep(0.3)
        assert decoder.pd_receiver.pages == 2 and decoder.pool.used_pages == 2
        go.set()
        deadline = time.monotonic() + 3.0
        while decoder.pool.used_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decoder.pool.used_pages == 0 and decoder.pd_receiver.pages == 0
    finally:
        go.set()
        prefiller.close()
        decoder.close()


def test_an_over_long_header_is_refused_before_it_is_decoded(monkeypatch) -> None:
    decode = proto.decode_request
    decoded: list[int] = []

    def counted(frames):
        decoded.append(len(frames[0]))
        return decode(frames)

    monkeypatch.setattr(proto, "decode_request", counted)
    decoder = make("receiver", "zmq", seed=None)
    raw = _Raw(decoder.p2p_endpoint)
    try:
        # ~1.4 MiB of checksums: decoding one of hundreds of MiB holds the loop for seconds.
        big = proto.CommitChunks(1, proto.PROTOCOL_VERSION, 12345, [2**63] * 150_000)
        frame = proto.encode(big)
        assert len(frame) > proto.MAX_HEADER_BYTES
        err = raw.ask(frame)
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        assert decoded == []
        # Under the header limit, more checksums than a commit can have chunks: refused.
        many = proto.CommitChunks(2, proto.PROTOCOL_VERSION, 12345, [1] * (proto.MAX_KEYS + 1))
        err = raw.ask(proto.encode(many))
        assert isinstance(err, proto.ErrorReply) and err.code == proto.ErrorCode.BAD_MESSAGE
        assert "checksums" in err.message
    finally:
        raw.close()
        decoder.close()


def test_a_stuck_write_leaves_the_decoder_buffers_to_their_expiry(monkeypatch) -> None:
    """A WRITE NIXL would not release may still land: its receive pages are not
    cancelled (freed for someone else's chunk) but left to the decoder's expiry."""
    from kvmesh.common.transport import channel_nixl

    def stuck(self, peer, local, remote, deadline, op="READ") -> None:
        raise channel_nixl.StuckTransfer(f"NIXL {op} with {peer} stuck")

    monkeypatch.setattr(channel_nixl.NixlChannel, "_transfer", stuck)
    prefiller = make("sender", "nixl", seed=1)
    decoder = make("receiver", "nixl", seed=None)
    try:
        tokens, slots = prompt(5, 2 * CHUNK), torch.arange(2 * CHUNK)
        gen = push_layers(prefiller, tokens, slots, None, PdTarget("s", decoder.p2p_endpoint))
        assert drain(gen) == 0
        assert metric(prefiller, "pd_pushes_total", outcome="failed") == 1
        time.sleep(0.2)
        assert decoder.pd_receiver.pages == 2 and decoder.pool.used_pages == 2
    finally:
        prefiller.close()
        decoder.close()
