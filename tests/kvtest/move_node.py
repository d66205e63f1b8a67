"""An engine with P2P and a controller, in its own process, for the move/copy tests:

    python -m kvtest.move_node CONFIG.json

CONFIG: {"name", "url" (the controller), "channel" (nixl|zmq), "seed"?, "heartbeat_s"?}.
Prints one JSON line once registered ({"endpoint", "channel"}), then obeys JSON
commands, one per stdin line, answering one JSON line each (see `handle`).
"""

from __future__ import annotations

import msgspec
import torch

from kvmesh.common.config import EngineControllerConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.services.worker.controller_client import wait_registered
from kvmesh.services.worker.engine import KVEngine
from kvtest.p2p import corrupt_l1, engine_config, kv_cache, prompt, serve_commands


class MoveNode:
    def __init__(self, cfg: dict) -> None:
        base = engine_config(cfg.get("channel", "zmq"))
        controller = EngineControllerConfig(
            enabled=True,
            url=cfg["url"],
            heartbeat_s=cfg.get("heartbeat_s", 0.2),
            timeout_s=1.0,
            event_flush_s=0.02,
        )
        config = msgspec.structs.replace(base, controller=controller)
        self.engine = KVEngine(cfg["name"], 0, config, kv_cache(cfg.get("seed")))
        assert self.engine.controller_client is not None
        if not wait_registered(self.engine.controller_client, 20.0):
            raise RuntimeError("not registered with the controller")

    def handle(self, cmd: dict) -> dict:
        op, e = cmd["op"], self.engine
        if op == "info":
            return {"endpoint": e.p2p_endpoint, "channel": e.storage.tier("p2p").channel.name}
        if op == "store":
            tokens = prompt(cmd["seed"], cmd["n"])
            e.store(tokens, torch.arange(cmd["n"]))
            return {"keys": [k.to_str() for _, _, k in e.chunks(tokens)]}
        if op == "l1":
            held = e.storage.l1.keys()
            return {"keys": sorted(k.to_str() for k in held)}
        if op == "chunks":
            # The raw bytes of each chunk L1 holds (None: not held), to compare bitwise.
            out: dict[str, str | None] = {}
            for key in cmd["keys"]:
                obj = e.storage.l1.get(ChunkKey.from_str(key))
                out[key] = None if obj is None else bytes(obj.raw.numpy()).hex()
                if obj is not None:
                    obj.ref_down()
            return {"chunks": out}
        if op == "corrupt":
            return {"corrupted": corrupt_l1(e)}
        raise ValueError(f"unknown op {op}")


if __name__ == "__main__":
    serve_commands(MoveNode)
