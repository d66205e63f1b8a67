"""LMCache 0.5.6's own lm:// client against a server: run with the LMCache venv's Python.

    .venv-lmcache/bin/python tests/kvtest/lmcache_client.py PORT [N] [SEED]

Builds LMCache's StorageManager with `remote_url=lm://127.0.0.1:PORT` (its real
RemoteBackend and LMServerConnector), puts N random KV chunks, then checks `contains`
for them and for a key never put, reads every chunk back and compares it bit for bit,
and prints one JSON line with the results. kvmesh is not imported here: this process
only knows LMCache.
"""

import json
import sys
import time


def main() -> int:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    port = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    shape = torch.Size([2, 2, 256, 64])
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_url=f"lm://127.0.0.1:{port}",
        remote_serde="naive",
    )
    meta = LMCacheMetadata(
        model_name="kvmesh-compat",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(2, 2, 256, 2, 32),
    )
    manager = StorageManager(cfg, meta, EventManager())
    remote = manager.storage_backends["RemoteBackend"]
    gen = torch.Generator().manual_seed(seed)
    keys, refs = [], []
    t0 = time.perf_counter()
    for i in range(n):
        key = CacheEngineKey("kvmesh-compat", 1, 0, 10_000 * (seed + 1) + i, torch.float16)
        obj = manager.allocate(shape, torch.float16)
        obj.tensor.copy_(torch.randn(shape, generator=gen, dtype=torch.float32).half())
        keys.append(key)
        refs.append(obj.tensor.clone())
        remote.submit_put_task(key, obj)
    deadline = time.monotonic() + 20
    while not all(remote.contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    contains = [remote.contains(k) for k in keys]
    absent = remote.contains(CacheEngineKey("kvmesh-compat", 1, 0, 7, torch.float16))
    equal = []
    for key, ref in zip(keys, refs, strict=True):
        got = remote.get_blocking(key)
        equal.append(got is not None and torch.equal(got.tensor.view(ref.shape), ref))
        if got is not None:
            got.ref_count_down()
    missing = remote.get_blocking(CacheEngineKey("kvmesh-compat", 1, 0, 8, torch.float16))
    result = {
        "contains": contains,
        "absent_contains": absent,
        "equal": equal,
        "missing_get": missing is None,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    print(json.dumps(result), flush=True)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
