"""LMCache 0.5.6's own lm:// client against a server: run with the LMCache venv's Python.

    .venv-lmcache/bin/python tests/kvtest/lmcache_client.py PORT [N] [SEED]
        [--model NAME] [--big-first] [--wait SECONDS]

Builds LMCache's StorageManager with `remote_url=lm://127.0.0.1:PORT` (its real
RemoteBackend and LMServerConnector), puts N random KV chunks, then checks `contains`
for them and for a key never put, reads every chunk back and compares it bit for bit,
and prints one JSON line with the results. kvmesh is not imported here: this process
only knows LMCache.

--model names the model in every key (LMCache checks a key's length in characters but
sends only its first 150 bytes of UTF-8). --big-first puts one chunk four times the
usual size (512 KiB) before the others, on the same connection. --wait bounds the wait
for the N chunks to show up (default 20 s; a test that expects misses shortens it).
"""

import argparse
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

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("n", type=int, nargs="?", default=4)
    parser.add_argument("seed", type=int, nargs="?", default=0)
    parser.add_argument("--model", default="kvmesh-compat")
    parser.add_argument("--big-first", action="store_true")
    parser.add_argument("--wait", type=float, default=20.0)
    args = parser.parse_args()
    port, n, seed, model = args.port, args.n, args.seed, args.model
    shape = torch.Size([2, 2, 256, 64])
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_url=f"lm://127.0.0.1:{port}",
        remote_serde="naive",
    )
    meta = LMCacheMetadata(
        model_name=model,
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
    big_key = CacheEngineKey(model, 1, 0, 9_999, torch.float16)
    if args.big_first:
        big = manager.allocate(torch.Size([2, 2, 256, 256]), torch.float16)
        big.tensor.fill_(1)
        remote.submit_put_task(big_key, big)
    keys, refs = [], []
    t0 = time.perf_counter()
    for i in range(n):
        key = CacheEngineKey(model, 1, 0, 10_000 * (seed + 1) + i, torch.float16)
        obj = manager.allocate(shape, torch.float16)
        obj.tensor.copy_(torch.randn(shape, generator=gen, dtype=torch.float32).half())
        keys.append(key)
        refs.append(obj.tensor.clone())
        remote.submit_put_task(key, obj)
    deadline = time.monotonic() + args.wait
    while not all(remote.contains(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    contains = [remote.contains(k) for k in keys]
    absent = remote.contains(CacheEngineKey(model, 1, 0, 7, torch.float16))
    equal, found = [], []
    for key, ref in zip(keys, refs, strict=True):
        got = remote.get_blocking(key)
        found.append(got is not None)
        equal.append(got is not None and torch.equal(got.tensor.view(ref.shape), ref))
        if got is not None:
            got.ref_count_down()
    missing = remote.get_blocking(CacheEngineKey(model, 1, 0, 8, torch.float16))
    result = {
        "contains": contains,
        "absent_contains": absent,
        "equal": equal,
        "found": found,
        "missing_get": missing is None,
        "big_contains": remote.contains(big_key) if args.big_first else None,
        "key_bytes": len(keys[0].to_string().encode()) if keys else 0,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    print(json.dumps(result), flush=True)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
