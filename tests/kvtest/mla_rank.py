"""One rank of the MLA broadcast tests: `python -m kvtest.mla_rank RANK PORT OUT [MODE]`.

Both ranks build the same source cache from a fixed seed. Only rank 0 stores; both
load into fresh caches, rank 1 receiving the chunks by broadcast. MODE `retrieve` (the
default) loads with `retrieve`, in windows of two chunks; `layerwise` with
`retrieve_layer` after a pinning lookup. Each rank writes what it checked to OUT as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.services.worker import mla
from kvmesh.services.worker.engine import KVEngine

from .paged import bits, drain_counting, make_cache, slot_tokens


def _load_layerwise(eng: KVEngine, prompt: list[int], slots: torch.Tensor) -> dict:
    assert eng.lookup(prompt, "req") == (40 if eng.rank == 0 else 0)
    loaded, steps = drain_counting(eng.retrieve_layer(prompt, slots, lookup_id="req"))
    return {"loaded": loaded, "steps": steps, "layers": eng.layout.num_layers}


def main(rank: int, port: int, out: str, mode: str = "retrieve") -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(1234)  # the same source KV, tokens and slots on both ranks
    view, layers, kind = make_cache("mla", torch.bfloat16, True, blocks=16, block_size=4)
    prompt = torch.randint(0, 50_000, (40,)).tolist()
    src_slots = torch.randperm(64)[:40]
    dst_slots = torch.randperm(64)[:40]
    cfg = EngineConfig(chunk_size=8, model_name="mla", l1=L1Config(max_size=4 << 20, reserve=0))
    eng = KVEngine("mla", rank, cfg, view, world_size=2)
    # Two chunks a window: the 5-chunk prompt goes in three windows, the last partial.
    mla.WINDOW_BYTES = 2 * eng.layout.chunk_nbytes(8)
    try:
        stored = eng.store(prompt, src_slots)
        fresh_view, fresh_layers, _ = make_cache(
            "mla", torch.bfloat16, False, blocks=16, block_size=4
        )
        eng.register_kv_caches(fresh_view)
        if mode == "layerwise":
            result = _load_layerwise(eng, prompt, dst_slots)
        else:
            result = {"loaded": eng.retrieve(prompt, dst_slots)}
        n = int(result["loaded"].sum())
        want = slot_tokens(layers, kind)[:, src_slots[:n]]
        got = slot_tokens(fresh_layers, kind)[:, dst_slots[:n]]
        result.update(
            rank=rank,
            namespace=eng.namespace.ns_id,
            stored=stored,
            loaded=n,
            l1_chunks=len(eng.storage.l1),
            pinned=len(eng.pins),
            equal=bool(torch.equal(bits(got), bits(want))),
        )
    finally:
        eng.close()
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:5])
