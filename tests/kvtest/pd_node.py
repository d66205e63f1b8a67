"""One engine of the PD fault tests (a prefiller or a decoder) in its own process, so a
test can SIGKILL or SIGSTOP it in the middle of a push:

    python -m kvtest.pd_node CONFIG.json

It answers JSON commands, one per stdin line, with one JSON line each (the first: its
"info"). The KV of a prompt is `kvtest.mesh_node.expected_kv` of its tokens: a decoder
checks every token it loads bit for bit against what the prefiller computed, so a
partial or foreign chunk can never pass for a hit.

With "http": true it also serves a stand-in of vLLM's completion API for the bridge
(prompt: a list of token ids): a prefill (`kv_transfer_params.kvmesh.pd.endpoints`)
pushes the prompt's KV to the decoder; a decode (`pd.transfer_id`) loads and checks
what was pushed, or "computes" the prompt itself, and ends the transfer's hold.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
from aiohttp import web

from kvmesh.common.chunk_codec import dtype_name
from kvmesh.common.config import EngineConfig, L1Config, P2PConfig, PDConfig
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.pd_receiver import hold_id
from kvmesh.services.worker.pd_sender import PdTarget, push_layers
from kvtest.mesh_node import (
    BLOCK,
    CHUNK,
    SENTINEL,
    expected_kv,
    new_cache,
    prompt_tokens,
    read_slots,
    write_slots,
)
from kvtest.p2p import serve_commands

PROMPT = 4 * CHUNK + CHUNK // 2  # four full chunks and a partial one (PD keys it too)


def engine_config(cfg: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="pd-faults",
        l1=L1Config(max_size=cfg.get("l1_bytes", 4 << 20), reserve=0, alloc_timeout_s=0.2),
        p2p=P2PConfig(channel=cfg.get("channel", "zmq"), port=cfg.get("port", 0), timeout_s=1.0),
        pd=PDConfig(
            role=cfg["role"],
            timeout_s=cfg.get("timeout_s", 1.0),
            hold_s=cfg.get("hold_s", 30.0),
        ),
        close_flush_s=0,
    )


class PdNode:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.cache = new_cache()
        self.engine = KVEngine(cfg.get("name", "pd"), 0, engine_config(cfg), self.cache)
        self.free_at_start = self.engine.pool.free_pages
        self._lock = threading.Lock()  # one call at a time into the paged cache
        self._push: threading.Thread | None = None
        self._pushed: dict[str, Any] = {}
        self.http_port = 0
        if cfg.get("http"):
            self._start_http()

    # -- prefiller ----------------------------------------------------------------------
    def push(self, tokens: list[int], transfer_id: str, endpoint: str, delay_s: float) -> int:
        """Push tokens' KV (written into slots 0.. first), layer by layer, `delay_s`
        between layers (the model computing the next one)."""
        slots = torch.arange(len(tokens))
        with self._lock:
            write_slots(self.cache, slots, expected_kv(tokens))
            gen = push_layers(self.engine, tokens, slots, None, PdTarget(transfer_id, endpoint))
            try:
                while True:
                    next(gen)
                    time.sleep(delay_s)
            except StopIteration as stop:
                return int(stop.value)

    def _push_in_background(self, cmd: dict[str, Any]) -> None:
        tokens = prompt_tokens(cmd["seed"], cmd.get("n", PROMPT))
        t0 = time.monotonic()
        try:
            pushed = self.push(tokens, cmd["transfer_id"], cmd["endpoint"], cmd.get("delay_s", 0))
            self._pushed = {"pushed": pushed, "seconds": time.monotonic() - t0}
        except Exception as exc:
            self._pushed = {"failed": repr(exc), "seconds": time.monotonic() - t0}

    # -- decoder ------------------------------------------------------------------------
    def load(self, tokens: list[int], transfer_id: str = "") -> dict[str, Any]:
        """Load what the decoder holds of tokens into sentinel-filled slots and check
        every loaded token against the prefiller's KV; end the transfer's hold."""
        n = len(tokens)
        slots = torch.arange(n) + 4 * BLOCK  # other slots than a push's
        with self._lock:
            for t in self.cache:
                t.view(torch.int16)[slots // BLOCK, :, slots % BLOCK, :] = SENTINEL
            hit = self.engine.lookup(tokens, pin=False)
            mask = self.engine.retrieve(tokens, slots)
            got = read_slots(self.cache, slots)
        loaded = int(mask.sum())
        wrong = []
        if not bool(mask[:loaded].all()):
            wrong.append(f"loaded mask is not a prefix: {mask.tolist()}")
        want = expected_kv(tokens)
        if loaded and not torch.equal(got[:, :loaded], want[:, :loaded]):
            bad = (got[:, :loaded] != want[:, :loaded]).any(-1).any(-1).any(0).nonzero()
            wrong.append(f"tokens {sorted({int(i) // CHUNK for i in bad})} (chunks) hold wrong KV")
        if loaded < n and not bool((got[:, loaded:] == SENTINEL).all()):
            wrong.append("slots past the loaded prefix were written")
        if transfer_id:
            self.engine.release_lookup(hold_id(transfer_id))
        return {"lookup": hit, "loaded": loaded, "wrong": wrong}

    def state(self) -> dict[str, Any]:
        e = self.engine
        m = e.stats.metrics
        out: dict[str, Any] = {
            "free_pages": e.pool.free_pages,
            "free_at_start": self.free_at_start,
            "used_pages": e.pool.used_pages,
            "l1_chunks": len(e.storage.l1),
        }
        if e.pd_receiver is not None:
            r = e.pd_receiver
            out |= {
                "inflight": r.inflight,
                "pages": r.pages,
                "held": m.value("pd_transfers_held"),
                "allocs_ok": m.value("pd_receive_allocs_total", {"outcome": "ok"}),
                "allocs_refused": m.value("pd_receive_allocs_total", {"outcome": "refused"}),
                "received": m.value("pd_received_chunks_total"),
                "rejected": m.value("pd_rejected_chunks_total"),
                "expired": m.value("pd_expired_allocs_total"),
                "alloc_ids": self._on_loop(lambda: sorted(r._inbound)),
            }
        if e.pd_sender is not None:
            out["push_inflight"] = e.pd_sender.inflight
            # The NIXL channel's count of decoders' agents unloaded (replaced or idle).
            out["agents_retired"] = getattr(e.pd_sender.channel, "retired", 0)
            out["pushes"] = {
                o: m.value("pd_pushes_total", {"outcome": o}) for o in ("ok", "refused", "failed")
            }
        return out

    def _on_loop(self, fn: Any) -> Any:
        """fn() on the engine loop, which owns the receiver's tables."""

        async def call() -> Any:
            return fn()

        return self.engine.loop.submit(call()).result(5)

    # -- commands -----------------------------------------------------------------------
    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "info":
            return {
                "endpoint": self.engine.p2p_endpoint,
                "http_port": self.http_port,
                "free_pages": self.engine.pool.free_pages,
            }
        if op == "push":  # in the background: "pushed" waits for it
            assert self._push is None or not self._push.is_alive(), "a push is running"
            self._pushed = {}
            self._push = threading.Thread(target=self._push_in_background, args=(cmd,))
            self._push.start()
            return {"ok": True}
        if op == "pushed":
            assert self._push is not None
            self._push.join(cmd.get("timeout_s", 30.0))
            return {"running": self._push.is_alive(), **self._pushed}
        if op == "load":
            tokens = prompt_tokens(cmd["seed"], cmd.get("n", PROMPT))
            return self.load(tokens, cmd.get("transfer_id", ""))
        if op == "state":
            return self.state()
        if op == "keys":  # what a prefiller of the prompt would allocate
            tokens = prompt_tokens(cmd["seed"], cmd.get("n", PROMPT))
            keys = [k.to_str() for _, _, k in self.engine.chunks(tokens)]
            e = self.engine
            return {
                "keys": keys,
                "shape": list(e.layout.chunk_shape(CHUNK)),
                "dtype": dtype_name(e.layout.dtype),
                "fmt": int(e.chunk_format),
            }
        raise ValueError(f"unknown op {op}")

    # -- the HTTP stand-in of vLLM --------------------------------------------------------
    def _start_http(self) -> None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="http").start()
        self.http_port = asyncio.run_coroutine_threadsafe(self._serve(), loop).result(10)

    async def _serve(self) -> int:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.json_response({}))
        app.router.add_post("/v1/completions", self._completion)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.cfg.get("http_port", 0))
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = [int(t) for t in body["prompt"]]
        pd = ((body.get("kv_transfer_params") or {}).get("kvmesh") or {}).get("pd") or {}
        out: dict[str, Any] = {"choices": [{"index": 0, "text": "x"}]}
        if pd.get("endpoints"):
            delay = self.cfg.get("delay_s", 0.0)
            out["pushed"] = await asyncio.to_thread(
                self.push, tokens, pd["transfer_id"], pd["endpoints"][0], delay
            )
        else:
            loaded = await asyncio.to_thread(self.load, tokens, pd.get("transfer_id", ""))
            out |= {"pd": bool(pd), **loaded}
        return web.json_response(out)


def main() -> None:
    serve_commands(PdNode)


if __name__ == "__main__":
    main()
