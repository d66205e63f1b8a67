"""KVEngine.store's one-pass path (pages taken at once, one L1 pass for the inserts and
touches) against what one call per chunk did: the policy's order, events, metrics, the
fallback when L1 must evict, a short last chunk, and a copy that fails half way."""

from __future__ import annotations

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.gpu_ext import make_copier
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.events import KVEventKind

CHUNK = 8
BLOCKS, BLOCK = 16, 4
SLOTS = BLOCKS * BLOCK


def config(l1_chunks: int = 0, **kw) -> EngineConfig:
    size = 8 << 20
    if l1_chunks:
        view, _, _ = make_cache("cpu", torch.float16, False, blocks=BLOCKS, block_size=BLOCK)
        page = -(-make_copier(view).layout.chunk_nbytes(CHUNK) // 4096) * 4096
        size = l1_chunks * page
    l1 = L1Config(max_size=size, reserve=0, alloc_timeout_s=0.2)
    return EngineConfig(chunk_size=CHUNK, model_name="test", l1=l1, **kw)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def cache():
    return make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)


def events(eng: KVEngine) -> list[tuple[KVEventKind, str]]:
    return [(e.kind, e.key) for e in eng.events.drain()]


def test_partly_held_request_touches_and_inserts_in_chunk_order(cache) -> None:
    view, _, _ = cache
    eng = KVEngine("t", 0, config(), view)
    try:
        prompt, other = tokens(32), tokens(16, seed=1)
        keys = [k for _, _, k in eng.chunks(prompt)]
        other_keys = [k for _, _, k in eng.chunks(other)]
        assert eng.store(prompt, torch.randperm(SLOTS)[:32]) == 32
        assert eng.storage.l1.remove(keys[1]) and eng.storage.l1.remove(keys[3])
        assert eng.store(other, torch.randperm(SLOTS)[:16]) == 16
        events(eng)
        before = eng.stats.chunks_stored._value.get()

        assert eng.store(prompt, torch.randperm(SLOTS)[:32]) == 16  # chunks 1 and 3
        # Held chunks 0 and 2 were touched where they stand in the request, between the
        # inserts: least recently used first, the other request, then chunks 0..3.
        assert list(eng.storage.l1._policy) == other_keys + keys
        assert events(eng) == [(KVEventKind.STORED, keys[i].to_str()) for i in (1, 3)]
        assert eng.stats.chunks_stored._value.get() == before + 2
        assert eng.pool.used_pages == 6
    finally:
        eng.close()


def test_l1_that_must_evict_stores_one_chunk_at_a_time(cache) -> None:
    view, layers, kind = cache
    eng = KVEngine("t", 0, config(l1_chunks=2), view)
    try:
        prompt = tokens(32)
        keys = [k.to_str() for _, _, k in eng.chunks(prompt)]
        slots = torch.randperm(SLOTS)[:32]
        # Four chunks through two pages: each allocation evicts the oldest chunk, which
        # only works because the chunk before it is already in L1.
        assert eng.store(prompt, slots) == 32
        stored, removed = KVEventKind.STORED, KVEventKind.REMOVED
        assert events(eng) == [
            (stored, keys[0]),
            (stored, keys[1]),
            (removed, keys[0]),
            (stored, keys[2]),
            (removed, keys[1]),
            (stored, keys[3]),
        ]
        held = eng.storage.l1.keys()  # a list, not a dict's view
        assert [k.to_str() for k in held] == keys[2:]
        assert eng.stats.chunks_stored._value.get() == 4
        assert eng.stats.evictions["l1"]._value.get() == 2
        want = slot_tokens(layers, kind)[:, slots[16:24]]
        got = eng.storage.l1.get(eng.chunks(prompt)[2][2])
        assert got is not None
        try:
            # [kv, layers, tokens, hidden] against [layers, tokens, kv, hidden]
            assert torch.equal(bits(got.tensor.permute(1, 2, 0, 3)), bits(want))
        finally:
            got.ref_down()
    finally:
        eng.close()


def store_by_layers(eng: KVEngine, prompt: list[int], slots: torch.Tensor) -> int:
    gen = eng.store_layer(prompt, slots)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("layerwise", [False, True], ids=["store", "store_layer"])
def test_full_l1_evicts_for_the_whole_run_at_once_and_keeps_the_prompts_own_chunks(
    cache, layerwise: bool
) -> None:
    view, layers, kind = cache
    eng = KVEngine("t", 0, config(l1_chunks=4), view)
    try:
        prefix, other = tokens(16), tokens(16, seed=1)
        prompt = prefix + tokens(16, seed=2)
        keys = [k for _, _, k in eng.chunks(prompt)]
        other_keys = [k for _, _, k in eng.chunks(other)]
        assert eng.store(prefix, torch.randperm(SLOTS)[:16]) == 16
        assert eng.store(other, torch.randperm(SLOTS)[:16]) == 16
        assert eng.pool.free_pages == 0
        events(eng)
        # The prompt's first two chunks are the least recently used in L1; the steady
        # state (a full L1) must still evict the other request for the new chunks.
        slots = torch.randperm(SLOTS)[:32]
        store = store_by_layers if layerwise else KVEngine.store
        assert store(eng, prompt, slots) == 16
        stored, removed = KVEventKind.STORED, KVEventKind.REMOVED
        # Both victims go first, in one pass, then both chunks in one run.
        assert events(eng) == [
            (removed, other_keys[0].to_str()),
            (removed, other_keys[1].to_str()),
            (stored, keys[2].to_str()),
            (stored, keys[3].to_str()),
        ]
        assert list(eng.storage.l1._policy) == keys
        assert eng.stats.evictions["l1"]._value.get() == 2
        want = slot_tokens(layers, kind)[:, slots[16:]].clone()
        dst = torch.randperm(SLOTS)[:32]
        assert bool(eng.retrieve(prompt, dst)[16:].all())
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst[16:]]), bits(want))
    finally:
        eng.close()


def test_make_room_never_evicts_what_is_in_use_and_never_waits(cache) -> None:
    view, _, _ = cache
    eng = KVEngine("t", 0, config(l1_chunks=2), view)
    try:
        l1 = eng.storage.l1
        assert eng.store(tokens(16), torch.randperm(SLOTS)[:16]) == 16
        first, second = l1.keys()
        assert l1.make_room(0) and l1.make_room(-1)
        assert l1.pin(first) and l1.pin(second)
        assert not l1.make_room(1)  # both pinned: nothing to evict, and no waiting
        assert set(l1.keys()) == {first, second}
        assert l1.unpin(second)
        assert l1.make_room(1) and l1.keys() == [first]
        # Asking for more than can ever be freed evicts what it can and says no.
        assert not l1.make_room(3) and l1.keys() == [first]
    finally:
        eng.close()


def test_short_last_chunk_is_stored_and_loaded_with_the_full_ones(cache) -> None:
    view, layers, kind = cache
    eng = KVEngine("t", 0, config(save_unfull_chunk=True), view)
    try:
        prompt = tokens(20)  # 8 + 8 + 4
        src = torch.randperm(SLOTS)[:20]
        assert eng.store(prompt, src) == 20
        full, short = eng.layout.chunk_nbytes(8), eng.layout.chunk_nbytes(4)
        assert eng.pool.used_bytes == 2 * full + short
        want = slot_tokens(layers, kind)[:, src].clone()
        dst = torch.randperm(SLOTS)[:20]
        assert bool(eng.retrieve(prompt, dst).all())
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(want))
        assert eng.stats.chunks_hit["l1"]._value.get() == 3
        assert eng.stats.tokens_hit["l1"]._value.get() == 20
    finally:
        eng.close()


def test_failed_copy_keeps_the_chunks_before_it_and_frees_the_rest(cache) -> None:
    view, _, _ = cache
    eng = KVEngine("t", 0, config(), view)
    try:
        prompt = tokens(32)
        keys = [k for _, _, k in eng.chunks(prompt)]
        slots = torch.randperm(SLOTS)[:32]
        slots[20] = SLOTS + 5  # in chunk 2
        with pytest.raises(ValueError, match="slot_mapping"):
            eng.store(prompt, slots)
        assert eng.storage.l1.keys() == keys[:2]
        assert eng.pool.used_pages == 2  # chunks 2 and 3 went back to the pool
        assert eng.stats.chunks_stored._value.get() == 2
        assert [key for _, key in events(eng)] == [k.to_str() for k in keys[:2]]
        assert eng.lookup(prompt) == 16
    finally:
        eng.close()
