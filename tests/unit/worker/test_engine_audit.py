"""The engine core under shutdown and a hanging tier: a close() with stores and
retrieves in flight raises nothing into their threads and frees no page under them,
and a tier that never answers holds up only the gets waiting on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import torch
import torch.distributed as dist
from kvtest.paged import bits, drain, make_cache, slot_tokens
from kvtest.service_process import free_port
from test_engine import MemoryTier  # the in-memory lower tier of the engine tests

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.mla import MLABroadcast
from kvmesh.services.worker.pd_sender import PdTarget, push_layers

CHUNK = 8
BLOCK = 4


def config(**kw) -> EngineConfig:
    l1 = L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2)
    return EngineConfig(**{"chunk_size": CHUNK, "model_name": "audit", "l1": l1, **kw})


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class DictTier(MemoryTier):
    """The engine tests' in-memory lower tier, whose gets can be made to hang (a remote
    that never answers: they wait until cancelled) or to take `delay` seconds."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.hang = False
        self.hang_keys: set[ChunkKey] = set()
        self.delay = 0.0

    async def aget(self, key, allocator):
        if self.hang or key in self.hang_keys:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay)
        return self.get(key, allocator)


def slowed(obj: object, method: str, delay_s: float) -> threading.Event:
    """Make obj.method take delay_s more (before the real call); the event is set as a
    call starts."""
    real = getattr(obj, method)
    started = threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(delay_s)
        return real(*args, **kwargs)

    setattr(obj, method, slow)
    return started


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_close_while_a_retrieve_waits_on_a_hanging_tier_gives_it_a_miss() -> None:
    """It raised CancelledError into the inference thread: the loop's stop cancelled
    the get it waited on, and get_prefix passed that on."""
    blocks = 16
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    tier = DictTier("hang")
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[tier])
    prompt = tokens(24)
    src_slots = torch.randperm(blocks * BLOCK)[:24]
    assert eng.store(prompt, src_slots) == 24
    src = slot_tokens(layers, kind)[:, src_slots[:16]].clone()
    eng.storage.remove(eng.chunks(prompt)[2][2], "l1")  # chunk 2 only below L1
    tier.hang = True
    dst = torch.randperm(blocks * BLOCK)[:24]
    thread, out = _in_thread(lambda: eng.retrieve(prompt, dst))
    time.sleep(0.3)  # it waits on the hanging tier now
    t0 = time.monotonic()
    eng.close()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 2.0  # not the 5 s I/O deadline
    assert "error" not in out, repr(out.get("error"))
    # The L1 prefix was loaded, exactly; the hanging chunk is a miss.
    assert out["value"].tolist() == [True] * 16 + [False] * 8
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst[:16]]), bits(src))
    assert not eng.loop.running


def test_close_before_a_retrieve_reaches_the_lower_tiers_gives_it_a_miss() -> None:
    """close() stopped the loop between the retrieve's L1 part and its lower-tier part:
    "the engine's event loop is stopped" was raised into the inference thread."""
    blocks = 16
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[DictTier("below")])
    prompt = tokens(24)
    assert eng.store(prompt, torch.randperm(blocks * BLOCK)[:24]) == 24
    eng.storage.remove(eng.chunks(prompt)[2][2], "l1")
    # the real lookup, while close() stops the loop
    in_l1 = slowed(eng.storage.l1, "get_prefix", 0.3)
    thread, out = _in_thread(lambda: eng.retrieve(prompt, torch.randperm(blocks * BLOCK)[:24]))
    assert in_l1.wait(5)
    eng.close()
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    # The L1 prefix is loaded (close() waited for it), as when a get is cancelled.
    assert out["value"].tolist() == [True] * 16 + [False] * 8


def test_close_waits_for_a_retrieve_copying_out_of_l1() -> None:
    """The pool was closed under a retrieve in its copy: dropping its references
    then raised MemoryObjFreedError into the inference thread."""
    blocks = 16
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view)
    prompt = tokens(24)
    src_slots = torch.randperm(blocks * BLOCK)[:24]
    assert eng.store(prompt, src_slots) == 24
    src = slot_tokens(layers, kind)[:, src_slots].clone()
    copying = slowed(eng.copier, "scatter_chunks", 0.3)  # the real copy, after close() has begun
    dst = torch.randperm(blocks * BLOCK)[:24]
    thread, out = _in_thread(lambda: eng.retrieve(prompt, dst))
    assert copying.wait(5)
    eng.close()
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].all()
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))
    assert eng.pool.closed


def test_layerwise_retrieve_and_store_across_close() -> None:
    """An inference engine stepping its generators across a shutdown: the retrieve's
    end raised MemoryObjFreedError, and the store "stored" into the closed engine."""
    blocks = 32
    view, layers, kind = make_cache(
        "cpu", torch.float16, True, layers=4, blocks=blocks, block_size=BLOCK
    )
    eng = KVEngine("audit", 0, config(), view)
    prompt = tokens(24)
    src_slots = torch.randperm(64)[:24]
    assert eng.store(prompt, src_slots) == 24
    src = slot_tokens(layers, kind)[:, src_slots].clone()
    dst = 64 + torch.randperm(64)[:24]
    loading = eng.retrieve_layer(prompt, dst)
    next(loading)  # layer 0 loaded
    storing = eng.store_layer(tokens(24, 1), torch.randperm(64)[:24])
    next(storing)
    eng.close()
    loaded = drain(loading)  # layers 1..3 after the close
    assert loaded.all()
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))
    assert drain(storing) == 0
    assert eng.stats.chunks_stored._value.get() == 3  # the first store's only

    # Abandoned part way after a close: closing the generator raises nothing.
    eng2 = KVEngine("audit2", 0, config(), view)
    assert eng2.store(prompt, src_slots) == 24
    loading = eng2.retrieve_layer(prompt, dst)
    next(loading)
    storing = eng2.store_layer(tokens(24, 1), torch.randperm(64)[:24])
    next(storing)
    eng2.close()
    loading.close()
    storing.close()


def test_a_hanging_tier_does_not_hold_up_gets_of_the_tiers_above_it() -> None:
    """All I/O slots were shared: one request's gets waiting on a tier that never
    answers held them, and another request whose chunks a healthy tier above had
    waited 4.7 s (of the 5 s deadline) for a slot."""
    blocks = 256
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    good, hang = DictTier("good"), DictTier("hang")
    eng = KVEngine("audit", 0, config(max_inflight_io=8), view, lower_tiers=[good, hang])
    try:
        cached = tokens(32, 6)
        assert eng.store(cached, torch.randperm(blocks * BLOCK)[:32]) == 32
        eng.clear(tier="l1")
        hang.hang = True
        absent = tokens(128, 5)  # 16 chunks no tier has: each ends at the hanging one
        thread, out = _in_thread(lambda: eng.retrieve(absent, torch.randperm(blocks * BLOCK)[:128]))
        time.sleep(0.3)
        t0 = time.monotonic()
        loaded = eng.retrieve(cached, torch.randperm(blocks * BLOCK)[:32])
        took = time.monotonic() - t0
        assert loaded.all()
        assert took < 1.0, f"{took:.2f}s"
        thread.join(10)
        assert not out["value"].any()
    finally:
        eng.close()
    assert eng.pool.used_pages == 0


def test_a_retrieve_racing_its_prefetchs_end_leaves_no_pins() -> None:
    """The retrieve released the lookup's pins while the prefetch was pinning what it
    had loaded; the prefetch then held its pins under the released id, and they kept
    L1 from evicting those chunks until pin_timeout_s."""
    blocks = 16
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[DictTier("below")])
    try:
        prompt = tokens(24)
        assert eng.store(prompt, torch.randperm(blocks * BLOCK)[:24]) == 24
        eng.clear(tier="l1")
        l1 = eng.storage.l1
        pinning = slowed(l1, "pin", 0.2)  # the real pin, while the request's retrieve runs
        fut = eng.prefetch(prompt, "pf")
        assert pinning.wait(5)
        assert eng.retrieve(prompt, torch.randperm(blocks * BLOCK)[:24], lookup_id="pf").all()
        # Cancelled by the retrieve, or ended: either way nothing may stay held.
        with contextlib.suppress(concurrent.futures.CancelledError):
            fut.result(timeout=5)
        # The prefetch's pinning blocks the loop: a turn of it runs after it ended
        # (its future said cancelled at once).
        eng.loop.run(asyncio.sleep(0), 5)
        assert not any(o.is_pinned for o in l1._objs.values())
        assert "pf" not in eng.pins
        assert eng.clear(tier="l1") == 3
    finally:
        eng.close()


def test_a_second_prefetch_under_one_id_stays_releasable() -> None:
    """The first prefetch's end removed the second's entry, so releasing the id could
    no longer cancel the second."""
    blocks = 16
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[DictTier("below")])
    try:
        prompt = tokens(24)
        assert eng.store(prompt, torch.randperm(blocks * BLOCK)[:24]) == 24
        eng.clear(tier="l1")
        below = eng.storage.lower[0]
        other = tokens(24, 9)
        below.hang_keys = {k for _, _, k in eng.chunks(other)}  # the second never ends
        below.delay = 0.2  # the first ends after the second began
        first = eng.prefetch(prompt, "pf")
        second = eng.prefetch(other, "pf")
        assert first.result(timeout=5) == 24
        eng.release_lookup("pf")
        time.sleep(0.2)
        assert second.cancelled()
        assert "pf" not in eng.pins
    finally:
        eng.close()


class DeafTier(DictTier):
    """A plugin-style tier whose get ignores every cancel (it retries its wait)."""

    async def aget(self, key, allocator):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue


def test_close_with_a_get_that_ignores_the_cancel_still_closes() -> None:
    """The loop could not finish its cancelled tasks, its stop() raised after 5 s,
    and close() passed that on with the tiers and the pool left open."""
    blocks = 16
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[DeafTier("deaf")])
    prompt = tokens(16)
    assert eng.store(prompt, torch.randperm(blocks * BLOCK)[:16]) == 16
    eng.storage.remove(eng.chunks(prompt)[1][2], "l1")
    thread, out = _in_thread(lambda: eng.retrieve(prompt, torch.randperm(blocks * BLOCK)[:16]))
    time.sleep(0.3)
    t0 = time.monotonic()
    eng.close()  # raises nothing
    assert time.monotonic() - t0 < 8.0
    thread.join(10)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].tolist() == [True] * 8 + [False] * 8
    assert eng.pool.closed


def test_close_during_a_layerwise_retrieves_first_step() -> None:
    """The first step reads L1's pages and asks the lower tiers, untracked by close():
    the pool was freed under it (MemoryObjFreedError taking its views) or the stopped
    loop raised "the engine's event loop is stopped" into the inference thread."""
    blocks = 32
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    prompt = tokens(24)
    src_slots = torch.randperm(64)[:24]
    src = slot_tokens(layers, kind)[:, src_slots].clone()

    # In L1 whole: close() comes while the step checks the chunks it got.
    eng = KVEngine("audit", 0, config(), view)
    assert eng.store(prompt, src_slots) == 24
    checking = slowed(eng, "_fits", 0.1)  # the real check, while close() runs
    dst = 64 + torch.randperm(64)[:24]
    thread, out = _in_thread(lambda: drain(eng.retrieve_layer(prompt, dst)))
    assert checking.wait(5)
    eng.close()
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].all()
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))

    # Chunk 2 below L1: close() stops the loop before the step asks for it.
    eng = KVEngine("audit2", 0, config(), view, lower_tiers=[DictTier("below")])
    assert eng.store(prompt, src_slots) == 24
    eng.storage.remove(eng.chunks(prompt)[2][2], "l1")
    in_l1 = slowed(eng.storage.l1, "get_prefix", 0.3)
    thread, out = _in_thread(lambda: drain(eng.retrieve_layer(prompt, dst)))
    assert in_l1.wait(5)
    eng.close()
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].tolist() == [True] * 16 + [False] * 8
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst[:16]]), bits(src[:, :16]))


def test_close_during_a_layerwise_stores_first_step() -> None:
    """Its allocation, untracked by close(), took pages of a pool being closed: the
    step raised into the inference thread."""
    blocks = 32
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view)
    allocating = slowed(eng, "_allocate_run", 0.3)  # the real allocation, while close() runs
    thread, out = _in_thread(lambda: drain(eng.store_layer(tokens(24), torch.randperm(64)[:24])))
    assert allocating.wait(5)
    eng.close()
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"] == 0  # closed before its commit: nothing stored
    assert eng.stats.chunks_stored._value.get() == 0


def test_close_with_an_infinite_alloc_timeout_waits_and_closes() -> None:
    """close() waited alloc_timeout_s + 5 s: with alloc_timeout_s=inf (the config takes
    it) Condition.wait raised OverflowError ("timestamp out of range") as soon as a
    retrieve ran, and pool and tiers were never closed (a second close() returned)."""
    blocks = 16
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    l1 = L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=float("inf"))
    eng = KVEngine("audit", 0, config(l1=l1), view, lower_tiers=[DictTier("below")])
    prompt = tokens(24)
    src_slots = torch.randperm(blocks * BLOCK)[:24]
    assert eng.store(prompt, src_slots) == 24
    src = slot_tokens(layers, kind)[:, src_slots].clone()
    copying = slowed(eng.copier, "scatter_chunks", 0.3)
    dst = torch.randperm(blocks * BLOCK)[:24]
    thread, out = _in_thread(lambda: eng.retrieve(prompt, dst))
    assert copying.wait(5)
    eng.close()  # raises nothing
    thread.join(5)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].all()
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))
    assert eng.pool.closed
    assert eng.storage.lower[0].data == {}  # the tier was closed too


class StubPdSender:
    """The PD sender's contract without a decoder: takes every layer, pushes nothing."""

    timeout_s = 2.0

    async def run(self, push) -> int:
        while (await push.layers.get()) is not None:
            pass
        return 0


def test_pd_push_stepped_across_close_ends_quietly() -> None:
    """push_layers' first step allocated and read L1 uncounted by close(), so the pool
    went under it (the loop's stop then raised "the engine's event loop is stopped"
    into the inference thread); its end after a close dropped references of the freed
    pool (MemoryObjFreedError) and put layers on the closed loop."""
    blocks = 32
    view, _, _ = make_cache("cpu", torch.float16, True, layers=4, blocks=blocks, block_size=BLOCK)
    target = PdTarget("t", "tcp://127.0.0.1:1")

    # Stepped once, the engine closed, then the other layers: it returns 0, stores nothing.
    eng = KVEngine("audit", 0, config(), view)
    eng.pd_sender = StubPdSender()
    cached = tokens(8, 3)
    assert eng.store(cached, torch.randperm(64)[:8]) == 8  # one chunk read from L1
    pushing = push_layers(eng, cached + tokens(16, 4), torch.randperm(64)[:24], None, target)
    next(pushing)
    eng.close()
    assert drain(pushing) == 0
    assert eng.stats.chunks_stored._value.get() == 1  # the store's only

    # close() during the first step: it waits for it, and the push ends with 0.
    eng = KVEngine("audit2", 0, config(), view)
    eng.pd_sender = StubPdSender()
    new_obj = eng._new_chunk_obj_or_stop
    allocated = threading.Event()

    def slow_new_obj(*args):  # the real allocation, then close() runs
        obj = new_obj(*args)
        allocated.set()
        time.sleep(0.3)
        return obj

    eng._new_chunk_obj_or_stop = slow_new_obj
    thread, out = _in_thread(
        lambda: drain(push_layers(eng, tokens(8, 5), torch.randperm(64)[:8], None, target))
    )
    assert allocated.wait(5)
    eng.close()
    thread.join(5)
    assert not thread.is_alive()
    assert "error" not in out, repr(out.get("error"))
    assert out["value"] == 0
    assert eng.stats.chunks_stored._value.get() == 0


@contextlib.contextmanager
def _one_rank_group():
    """A gloo group of this process alone: MLABroadcast's real broadcasts, one rank."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_close_during_an_mla_retrieve_waits_and_a_stopped_loop_is_a_miss() -> None:
    """The layerwise MLA branch went to the broadcast before being counted: close()
    waited 0 s and freed the pool under rank 0's copy (MemoryObjFreedError in the
    inference thread, other ranks left in their broadcast). And rank 0's get_prefix
    raised "the engine's event loop is stopped" once close() had stopped the loop,
    before the count's broadcast, instead of loading its L1 prefix."""
    blocks = 16
    view, layers, kind = make_cache("mla", torch.bfloat16, True, blocks=blocks, block_size=BLOCK)
    prompt = tokens(24)
    src_slots = torch.randperm(64)[:24]
    src = slot_tokens(layers, kind)[:, src_slots].clone()
    with _one_rank_group():
        eng = KVEngine("audit", 0, config(), view)
        assert eng.store(prompt, src_slots) == 24
        eng._mla = MLABroadcast(None, 0)
        copying = slowed(eng.copier, "scatter_chunks", 0.3)
        dst = torch.randperm(64)[:24]
        thread, out = _in_thread(lambda: drain(eng.retrieve_layer(prompt, dst)))
        assert copying.wait(5)
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 > 0.1  # it waited for the copy
        thread.join(5)
        assert "error" not in out, repr(out.get("error"))
        assert out["value"].all()
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))

        # Chunk 2 below L1; the loop stops before rank 0 asks for it.
        view, layers, kind = make_cache(
            "mla", torch.bfloat16, True, blocks=blocks, block_size=BLOCK
        )
        src = slot_tokens(layers, kind)[:, src_slots].clone()
        eng = KVEngine("audit2", 0, config(), view, lower_tiers=[DictTier("below")])
        assert eng.store(prompt, src_slots) == 24
        eng._mla = MLABroadcast(None, 0)
        eng.storage.remove(eng.chunks(prompt)[2][2], "l1")
        in_l1 = slowed(eng.storage.l1, "get_prefix", 0.3)
        dst = torch.randperm(64)[:24]
        thread, out = _in_thread(lambda: eng.retrieve(prompt, dst))
        assert in_l1.wait(5)
        eng.close()
        thread.join(5)
        assert "error" not in out, repr(out.get("error"))
        assert out["value"].tolist() == [True] * 16 + [False] * 8
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst[:16]]), bits(src[:, :16]))


class SlowUnpinTier(DictTier):
    """A tier whose unpin takes a while (a remote round trip)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.unpinning = threading.Event()

    def unpin(self, key):
        self.unpinning.set()
        time.sleep(0.5)
        return key in self.data


def test_a_slow_tier_unpin_at_a_prefetchs_end_does_not_stall_retrieves() -> None:
    """The prefetch's end unpinned its lookup's older pins (hold() replaces them) under
    _prefetch_lock, which every retrieve with a lookup id takes in release_lookup: an
    unrelated request's retrieve waited 1.4 s on the inference thread."""
    blocks = 64
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    tier = SlowUnpinTier("slow")
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[tier])
    try:
        a, b = tokens(24, 7), tokens(24, 8)
        assert eng.store(a, torch.randperm(blocks * BLOCK)[:24]) == 24
        eng.clear(tier="l1")
        assert eng.store(b, torch.randperm(blocks * BLOCK)[:24]) == 24  # b: in L1
        assert eng.lookup(a, "X", pin=True) == 24  # 3 pins in the slow tier
        fut = eng.prefetch(a, "X")  # its end releases those 3 (1.5 s)
        assert tier.unpinning.wait(5)
        t0 = time.monotonic()
        assert eng.retrieve(b, torch.randperm(blocks * BLOCK)[:24], lookup_id="Y").all()
        took = time.monotonic() - t0
        assert took < 0.4, f"{took:.2f}s"
        assert fut.result(timeout=5) == 24
        assert "X" in eng.pins  # the prefetch's pins replaced the lookup's
    finally:
        eng.close()


def test_a_retrieve_reaching_the_lower_tiers_after_close_began_is_a_quick_miss() -> None:
    """With a tier that ignores the cancel the loop cannot stop; a retrieve reaching
    its lower-tier part after stop() was issued submitted a new get onto that loop and
    waited the whole 5 s I/O deadline (close() 10.2 s, then the pool freed under it)."""
    blocks = 16
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view, lower_tiers=[DeafTier("deaf")])
    prompt = tokens(16)
    src_slots = torch.randperm(16)  # three apart: no retrieve writes another's slots
    assert eng.store(prompt, src_slots) == 16
    src = slot_tokens(layers, kind)[:, src_slots[:8]].clone()
    eng.storage.remove(eng.chunks(prompt)[1][2], "l1")
    first, first_out = _in_thread(lambda: eng.retrieve(prompt, 16 + torch.randperm(16)))
    time.sleep(0.3)  # it waits on the deaf tier: the loop will not stop
    l1_prefix = eng.storage.l1.get_prefix
    entered = threading.Event()
    seen: dict[str, float] = {}

    def l1_prefix_until_stopping(keys):  # the real lookup, once close() stops the loop
        entered.set()
        deadline = time.monotonic() + 5
        while not eng.loop.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["stopping"] = time.monotonic()
        return l1_prefix(keys)

    eng.storage.l1.get_prefix = l1_prefix_until_stopping
    dst = 32 + torch.randperm(16)

    def second():
        loaded = eng.retrieve(prompt, dst)
        seen["done"] = time.monotonic()
        return loaded

    thread, out = _in_thread(second)
    assert entered.wait(5)
    t0 = time.monotonic()
    eng.close()
    took = time.monotonic() - t0
    thread.join(10)
    first.join(10)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"].tolist() == [True] * 8 + [False] * 8
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst[:8]]), bits(src))
    assert seen["done"] - seen["stopping"] < 1.0, f"{seen['done'] - seen['stopping']:.2f}s"
    assert took < 8.0, f"{took:.1f}s"  # the loop's 5 s join, not a get's deadline more
    assert "error" not in first_out, repr(first_out.get("error"))
    assert eng.pool.closed


class CountingCondition(threading.Condition):
    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_stores_and_retrieves_notify_only_a_closing_engine() -> None:
    """Every store and retrieve notified the idle condition on its way out, though
    only close() ever waits on it."""
    blocks = 16
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=blocks, block_size=BLOCK)
    eng = KVEngine("audit", 0, config(), view)
    idle = eng._idle = CountingCondition(eng._lock)
    prompt = tokens(24)
    assert eng.store(prompt, torch.randperm(blocks * BLOCK)[:24]) == 24
    assert eng.retrieve(prompt, torch.randperm(blocks * BLOCK)[:24]).all()
    assert idle.notified == 0
    copying = threading.Event()
    scatter = eng.copier.scatter_chunks

    def slow_scatter(*args, **kwargs):
        copying.set()
        time.sleep(0.2)
        return scatter(*args, **kwargs)

    eng.copier.scatter_chunks = slow_scatter
    thread, out = _in_thread(lambda: eng.retrieve(prompt, torch.randperm(blocks * BLOCK)[:24]))
    assert copying.wait(5)
    t0 = time.monotonic()
    eng.close()
    thread.join(5)
    assert time.monotonic() - t0 < 1.0  # woken when the retrieve ended, not at the cap
    assert out["value"].all()
    assert idle.notified == 1
