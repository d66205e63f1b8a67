"""The PD receiver's bookkeeping on a real decoder engine: chunks that several transfers
share leave L1 once the last of them ends (none is left behind), a chunk answered
`have` stays until its transfer is held, and a peer can make the receiver keep only so
much (allocations, keys, transfer ids) and never an allocation that does not expire."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from kvtest.p2p import CHUNK, kv_cache, prompt
from kvtest.paged import drain

from kvmesh.common.chunk_codec import payload_checksum
from kvmesh.common.config import EngineConfig, L1Config, P2PConfig, PDConfig
from kvmesh.common.protocol import p2p as proto
from kvmesh.services.worker import pd_receiver
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.pd_receiver import PdRefused, hold_id
from kvmesh.services.worker.pd_sender import PdTarget, push_layers

N = 3 * CHUNK + CHUNK // 2  # three full chunks and a partial one


def make(role: str, seed: int | None, *, timeout_s: float = 2.0) -> KVEngine:
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="pd-test",
        l1=L1Config(max_size=4 << 20, reserve=0, alloc_timeout_s=0.2),
        p2p=P2PConfig(channel="zmq", timeout_s=2.0),
        pd=PDConfig(role=role, timeout_s=timeout_s, max_receive_fraction=0.5, hold_s=30.0),
        close_flush_s=0,
    )
    return KVEngine(f"{role}-limits", 0, cfg, kv_cache(seed))


@pytest.fixture
def decoder():
    engine = make("receiver", None)
    yield engine
    engine.close()


def on_loop(engine: KVEngine, fn: Callable[[], object]):
    async def call():
        return fn()

    return engine.loop.submit(call()).result(5)


def run(engine: KVEngine, coro):
    return engine.loop.submit(coro).result(5)


def wait_for(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def alloc_msg(decoder: KVEngine, seed: int, n_chunks: int, **kw) -> proto.AllocChunks:
    keys = [k.to_str() for _, _, k in decoder.chunks(prompt(seed, n_chunks * CHUNK))]
    fields = dict(
        rid=1,
        version=proto.PROTOCOL_VERSION,
        transfer_id="t",
        keys=keys,
        chunk_shape=list(decoder.layout.chunk_shape(CHUNK)),
        dtype="float16",
        fmt=int(decoder.chunk_format),
        last_tokens=CHUNK,
        deadline=0.0,
    )
    fields.update(kw)
    return proto.AllocChunks(**fields)


def alloc(decoder: KVEngine, msg: proto.AllocChunks) -> proto.AllocChunksReply:
    return on_loop(decoder, lambda: decoder.pd_receiver.alloc(msg))


def refused(decoder: KVEngine, msg: proto.AllocChunks) -> proto.ErrorCode:
    with pytest.raises(PdRefused) as exc:
        alloc(decoder, msg)
    return exc.value.code


def write(decoder: KVEngine, reply: proto.AllocChunksReply, indices: list[int]) -> list[int]:
    """Write bytes into the listed buffers; their checksums."""
    frames = [bytes([i + 1]) * reply.slots[i].nbytes for i in indices]
    push = proto.PushChunks(2, proto.PROTOCOL_VERSION, reply.alloc_id, -1, indices)
    run(decoder, decoder.pd_receiver.push(push, [memoryview(f) for f in frames]))
    return [payload_checksum(f) for f in frames]


def commit(
    decoder: KVEngine, reply: proto.AllocChunksReply, sums: list[int], indices: list[int]
) -> proto.CommitChunksReply:
    msg = proto.CommitChunks(3, proto.PROTOCOL_VERSION, reply.alloc_id, sums, indices)
    return run(decoder, decoder.pd_receiver.commit(msg))


def receive(decoder: KVEngine, transfer_id: str, seed: int, n_chunks: int) -> None:
    """A whole transfer: allocate, write and commit every chunk."""
    reply = alloc(decoder, alloc_msg(decoder, seed, n_chunks, transfer_id=transfer_id))
    indices = [i for i, s in enumerate(reply.slots) if not s.have]
    assert commit(decoder, reply, write(decoder, reply, indices), indices).rejected == 0


def test_chunks_two_transfers_share_leave_l1_when_the_last_one_ends(decoder) -> None:
    prefiller = make("sender", seed=1)
    try:
        tokens, slots = prompt(5, N), torch.arange(N)
        for transfer in ("A", "B"):  # B finds A's chunks here (`have`)
            target = PdTarget(transfer, decoder.p2p_endpoint)
            assert drain(push_layers(prefiller, tokens, slots, None, target)) == N
        assert decoder.pool.used_pages == 4
        decoder.release_lookup(hold_id("A"))  # A's decode ends first: B still needs them
        time.sleep(0.2)
        assert decoder.lookup(tokens, pin=False) == N
        decoder.release_lookup(hold_id("B"))
        assert wait_for(lambda: decoder.pool.used_pages == 0)
        assert len(decoder.storage.l1) == 0
    finally:
        prefiller.close()


def test_a_chunk_a_lookup_pins_when_its_last_transfer_ends_leaves_once_unpinned(decoder) -> None:
    receive(decoder, "A", seed=5, n_chunks=2)
    receive(decoder, "B", seed=5, n_chunks=2)
    tokens = prompt(5, 2 * CHUNK)
    assert decoder.lookup(tokens, lookup_id="vllm-1", pin=True) == 2 * CHUNK
    for transfer in ("A", "B"):
        decoder.release_lookup(hold_id(transfer))
    time.sleep(0.2)
    assert decoder.pool.used_pages == 2  # the lookup's pins keep them for its retrieve
    decoder.release_lookup("vllm-1")
    assert wait_for(lambda: decoder.pool.used_pages == 0)  # the receiver's sweep


def test_a_commit_after_the_release_leaves_nothing_behind(decoder) -> None:
    receiver = decoder.pd_receiver
    reply = alloc(decoder, alloc_msg(decoder, 6, 2, transfer_id="late"))
    sums = write(decoder, reply, [0, 1])
    assert commit(decoder, reply, sums[:1], [0]) == proto.CommitChunksReply(3, 1, 0)
    # The decode ends: release() unpins at once on the connector's thread and drops on
    # the loop, where the last group's commit got in first.
    receiver.pins.release(hold_id("late"))
    assert commit(decoder, reply, sums[1:], [1]) == proto.CommitChunksReply(3, 1, 0)
    on_loop(decoder, lambda: receiver.drop(hold_id("late")))
    assert decoder.pool.used_pages == 0 and len(decoder.storage.l1) == 0
    assert hold_id("late") not in receiver.pins


def test_a_have_chunk_stays_until_its_transfer_holds_it(decoder) -> None:
    receive(decoder, "A", seed=7, n_chunks=3)
    tokens = prompt(7, 3 * CHUNK)
    reply = alloc(decoder, alloc_msg(decoder, 7, 3, transfer_id="B"))
    assert [s.have for s in reply.slots] == [True] * 3
    decoder.release_lookup(hold_id("A"))  # A's decode ends before B commits
    time.sleep(0.2)
    assert decoder.lookup(tokens, pin=False) == 3 * CHUNK
    assert commit(decoder, reply, [], []) == proto.CommitChunksReply(3, 0, 0)
    assert decoder.lookup(tokens, pin=False) == 3 * CHUNK
    decoder.release_lookup(hold_id("B"))
    assert wait_for(lambda: decoder.pool.used_pages == 0)


def test_a_have_chunk_of_an_allocation_that_ends_uncommitted_is_dropped(decoder) -> None:
    receive(decoder, "A", seed=7, n_chunks=2)
    reply = alloc(decoder, alloc_msg(decoder, 7, 2, transfer_id="B"))
    decoder.release_lookup(hold_id("A"))
    time.sleep(0.2)
    assert decoder.pool.used_pages == 2  # B's allocation still counts on them
    cancel = proto.CancelChunks(4, proto.PROTOCOL_VERSION, reply.alloc_id)
    assert on_loop(decoder, lambda: decoder.pd_receiver.cancel(cancel)).cancelled
    assert wait_for(lambda: decoder.pool.used_pages == 0)


def test_a_refused_allocation_keeps_no_pin_on_its_have_chunks(decoder) -> None:
    receive(decoder, "A", seed=7, n_chunks=2)
    pages = decoder.pd_receiver.max_pages
    keys = alloc_msg(decoder, 7, 2).keys + alloc_msg(decoder, 30, pages + 1).keys
    assert refused(decoder, alloc_msg(decoder, 7, 2, keys=keys)) == proto.ErrorCode.NO_ROOM
    decoder.release_lookup(hold_id("A"))
    assert wait_for(lambda: decoder.pool.used_pages == 0)


def test_an_allocation_the_pool_fails_keeps_no_pin_on_its_have_chunks(decoder, monkeypatch) -> None:
    receive(decoder, "A", seed=7, n_chunks=2)
    keys = alloc_msg(decoder, 7, 2).keys + alloc_msg(decoder, 31, 2).keys

    def broken(*args, **kwargs):
        raise RuntimeError("pool closed")

    monkeypatch.setattr(decoder.pool, "allocate", broken)
    with pytest.raises(RuntimeError, match="pool closed"):
        alloc(decoder, alloc_msg(decoder, 7, 2, keys=keys))
    monkeypatch.undo()
    assert decoder.pd_receiver.inflight == 0 and decoder.pd_receiver._keys == 2  # A's hold
    decoder.release_lookup(hold_id("A"))
    assert wait_for(lambda: decoder.pool.used_pages == 0)  # no pin kept A's chunks


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), float("-inf")])
def test_a_deadline_that_is_not_a_number_is_refused(decoder, deadline: float) -> None:
    msg = alloc_msg(decoder, 8, 3, deadline=deadline)
    assert refused(decoder, msg) == proto.ErrorCode.BAD_MESSAGE
    assert decoder.pd_receiver.inflight == 0 and decoder.pool.used_pages == 0


def test_duplicate_keys_and_bad_transfer_ids_are_refused(decoder) -> None:
    one = alloc_msg(decoder, 8, 1).keys
    cases = [
        alloc_msg(decoder, 8, 2, keys=one * 2),
        alloc_msg(decoder, 8, 2, transfer_id="x" * (pd_receiver.MAX_TRANSFER_ID + 1)),
        alloc_msg(decoder, 8, 2, transfer_id=""),
    ]
    for msg in cases:
        assert refused(decoder, msg) == proto.ErrorCode.BAD_MESSAGE
    assert decoder.pd_receiver.inflight == 0 and decoder.pool.used_pages == 0
    assert alloc(decoder, alloc_msg(decoder, 8, 2, transfer_id="x" * 128)).alloc_id


def test_allocations_that_take_no_page_are_bounded(decoder, monkeypatch) -> None:
    receive(decoder, "A", seed=9, n_chunks=2)  # what the allocations below find here
    monkeypatch.setattr(pd_receiver, "MAX_TRANSFERS", 3)  # A's hold and two more
    msgs = [alloc_msg(decoder, 9, 2, transfer_id=f"z{i}") for i in range(3)]
    replies = [alloc(decoder, m) for m in msgs[:2]]
    assert all(s.have for r in replies for s in r.slots)
    assert refused(decoder, msgs[2]) == proto.ErrorCode.NO_ROOM
    cancel = proto.CancelChunks(4, proto.PROTOCOL_VERSION, replies[0].alloc_id)
    on_loop(decoder, lambda: decoder.pd_receiver.cancel(cancel))
    assert alloc(decoder, msgs[2]).slots[0].have


def test_keys_listed_by_allocations_and_holds_are_bounded(decoder, monkeypatch) -> None:
    monkeypatch.setattr(pd_receiver, "MAX_KEYS_TRACKED", 3)
    # Allocated, committed, held, released: over and over, what ends is given back.
    for i in range(4):
        receive(decoder, f"r{i}", seed=10 + i, n_chunks=3)
        assert refused(decoder, alloc_msg(decoder, 20, 1)) == proto.ErrorCode.NO_ROOM
        decoder.release_lookup(hold_id(f"r{i}"))
        assert wait_for(lambda: decoder.pool.used_pages == 0)
    reply = alloc(decoder, alloc_msg(decoder, 20, 3))
    assert refused(decoder, alloc_msg(decoder, 21, 1)) == proto.ErrorCode.NO_ROOM
    cancel = proto.CancelChunks(4, proto.PROTOCOL_VERSION, reply.alloc_id)
    on_loop(decoder, lambda: decoder.pd_receiver.cancel(cancel))
    assert alloc(decoder, alloc_msg(decoder, 21, 3)).alloc_id
