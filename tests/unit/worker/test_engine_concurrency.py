"""Eight threads storing, looking up and retrieving overlapping prefixes at once.

Nothing may be lost or corrupted, and afterwards the pool holds exactly the pages of
the chunks stored (no leaked pages, no leaked pins). KVMESH_SOAK_SECONDS sets the
duration (30 s by default, as the engine's acceptance check asks).
"""

from __future__ import annotations

import os
import random
import threading
import time

import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine

SECONDS = float(os.environ.get("KVMESH_SOAK_SECONDS", "30"))
THREADS = 8
CHUNK, BLOCK, BLOCKS = 8, 4, 512
SOURCE_SLOTS = 1024  # slots [0, 1024) hold the KV that is stored; never written
REGION = (BLOCKS * BLOCK - SOURCE_SLOTS) // THREADS  # each thread's own load target
BASE, SUFFIX, VARIANTS = 32, 32, 8


def test_eight_threads_lose_nothing_and_leak_nothing() -> None:
    view, layers, kind = make_cache(
        "cpu", torch.float16, True, layers=2, blocks=BLOCKS, block_size=BLOCK
    )
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="soak",
        l1=L1Config(max_size=64 << 20, reserve=0, alloc_timeout_s=1.0),
    )
    eng = KVEngine("soak", 0, cfg, view)
    gen = torch.Generator().manual_seed(7)
    source_perm = torch.randperm(SOURCE_SLOTS, generator=gen)
    # Two families of prompts, each a shared base plus one of VARIANTS suffixes: the
    # base chunks are shared between prompts (same tokens, same slots, same KV).
    prompts: list[tuple[list[int], torch.Tensor]] = []
    used = 0
    for _family in range(2):
        base = torch.randint(0, 50_000, (BASE,), generator=gen).tolist()
        base_slots = source_perm[used : used + BASE]
        used += BASE
        for _ in range(VARIANTS):
            suffix = torch.randint(0, 50_000, (SUFFIX,), generator=gen).tolist()
            prompts.append(
                (base + suffix, torch.cat([base_slots, source_perm[used : used + SUFFIX]]))
            )
            used += SUFFIX
    source = slot_tokens(layers, kind)[:, :SOURCE_SLOTS].clone()
    full = BASE + SUFFIX

    stored: set[int] = set()
    stored_lock = threading.Lock()
    errors: list[str] = []
    counts = [0] * THREADS
    stop = time.monotonic() + SECONDS

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        dst_slots = torch.arange(SOURCE_SLOTS + tid * REGION, SOURCE_SLOTS + (tid + 1) * REGION)
        n = 0
        while time.monotonic() < stop and not errors:
            i = rng.randrange(len(prompts))
            toks, slots = prompts[i]
            op = rng.random()
            try:
                if op < 0.3:
                    if rng.random() < 0.5:
                        eng.store(toks, slots)
                    else:
                        gen_ = eng.store_layer(toks, slots)
                        for _ in gen_:
                            pass
                    with stored_lock:
                        stored.add(i)
                else:
                    with stored_lock:
                        must_hit = i in stored
                    lid = f"{tid}-{n}"
                    hit = eng.lookup(toks, lid)
                    if must_hit and hit != full:
                        errors.append(f"prompt {i} was stored but lookup found {hit}")
                    dst = dst_slots[:full]
                    if op < 0.65:
                        loaded = eng.retrieve(toks, dst, lookup_id=lid)
                    else:
                        it = eng.retrieve_layer(toks, dst, lookup_id=lid)
                        loaded = None
                        try:
                            while True:
                                loaded = next(it)
                        except StopIteration as s:
                            loaded = s.value
                    m = int(loaded.sum())
                    if m < hit or m % CHUNK or not loaded[:m].all():
                        errors.append(f"prompt {i}: lookup {hit}, loaded {loaded.tolist()}")
                    got = slot_tokens(layers, kind)[:, dst[:m]]
                    if not torch.equal(bits(got), bits(source[:, slots[:m]])):
                        errors.append(f"prompt {i}: loaded KV differs from what was stored")
            except Exception as exc:  # surfaced by the assertion below
                errors.append(f"thread {tid}: {exc!r}")
            n += 1
        counts[tid] = n

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 60)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert not errors, errors[:5]
        assert min(counts) > 10, counts

        # Every stored prompt is there in full.
        for i in stored:
            assert eng.lookup(prompts[i][0]) == full
        families_stored = {i // VARIANTS for i in stored}
        expected_chunks = len(families_stored) * BASE // CHUNK + len(stored) * SUFFIX // CHUNK
        l1 = eng.storage.l1
        assert len(l1) == expected_chunks
        # No leak: the pool's pages are exactly the stored chunks', none pinned or
        # referenced by anyone but L1.
        assert eng.pool.used_pages == expected_chunks
        assert len(eng.pins) == 0
        assert all(obj.can_evict for obj in l1._objs.values())
        assert eng.clear() == expected_chunks
        assert eng.pool.used_bytes == 0
    finally:
        eng.close()
