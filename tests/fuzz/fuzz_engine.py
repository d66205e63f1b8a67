"""A worker engine to fuzz, in its own process: P2P and PD receive on (the P2P
endpoint, common/protocol/p2p.py), a lookup endpoint, and the metrics port:

    python tests/fuzz/fuzz_engine.py METRICS_PORT LOOKUP_ENDPOINT

stores one 64-token prompt (4 chunks) and prints one JSON line {"p2p", "lookup",
"keys"}; serves until its stdin closes. tests/ must be on PYTHONPATH."""

from __future__ import annotations

import json
import sys

import msgspec
import torch
from kvtest.p2p import engine_config, kv_cache, prompt

from kvmesh.common.config import PDConfig
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.lookup_server import attach_lookup_server

TOKENS = 64


def main() -> None:
    metrics_port, lookup_endpoint = int(sys.argv[1]), sys.argv[2]
    cfg = msgspec.structs.replace(
        engine_config(), pd=PDConfig(role="both", timeout_s=1.0), metrics_port=metrics_port
    )
    engine = KVEngine("fuzzed", 0, cfg, kv_cache(1))
    attach_lookup_server(engine, lookup_endpoint)
    toks = prompt(1, TOKENS)
    engine.store(toks, torch.arange(TOKENS))
    keys = [k.to_str() for _, _, k in engine.chunks(toks)]
    line = {"p2p": engine.p2p_endpoint, "lookup": engine.lookup_endpoint, "keys": keys}
    print(json.dumps(line), flush=True)
    sys.stdin.read()
    engine.close()


if __name__ == "__main__":
    main()
