"""One rank of the MLA layerwise test: `python -m kvtest.mla_layerwise_rank RANK PORT OUT`.

As kvtest.mla_rank, but both ranks load with `retrieve_layer`: rank 1, which stores
nothing, must get rank 0's chunks by broadcast there too.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine

from .paged import bits, make_cache, slot_tokens


def main(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(1234)  # the same source KV, tokens and slots on both ranks
    view, layers, kind = make_cache("mla", torch.bfloat16, True, blocks=16, block_size=4)
    prompt = torch.randint(0, 50_000, (40,)).tolist()
    src_slots = torch.randperm(64)[:40]
    dst_slots = torch.randperm(64)[:40]
    cfg = EngineConfig(chunk_size=8, model_name="mla", l1=L1Config(max_size=4 << 20, reserve=0))
    eng = KVEngine("mla", rank, cfg, view, world_size=2)
    try:
        stored = eng.store(prompt, src_slots)
        fresh_view, fresh_layers, _ = make_cache(
            "mla", torch.bfloat16, False, blocks=16, block_size=4
        )
        eng.register_kv_caches(fresh_view)
        assert eng.lookup(prompt, "req") == (40 if rank == 0 else 0)
        gen = eng.retrieve_layer(prompt, dst_slots, lookup_id="req")
        steps = 0
        try:
            while True:
                next(gen)
                steps += 1
        except StopIteration as stop:
            loaded = stop.value
        n = int(loaded.sum())
        want = slot_tokens(layers, kind)[:, src_slots[:n]]
        got = slot_tokens(fresh_layers, kind)[:, dst_slots[:n]]
        result = {
            "rank": rank,
            "stored": stored,
            "loaded": n,
            "steps": steps,
            "layers": eng.layout.num_layers,
            "pinned": len(eng.pins),
            "equal": bool(torch.equal(bits(got), bits(want))),
        }
    finally:
        eng.close()
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
