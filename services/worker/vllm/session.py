"""One vLLM process serving a list of requests, one after the other (the child side of
kvmesh.services.worker.vllm.testing; run as `python -m ...session SPEC OUT`).

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): scheduler, worker and
the kvmesh engine share it with this script, which lets a step simulate a chunk lost
between lookup and load by removing it from the engine just before the retrieve.
Results go to a JSON file, never stdout (vLLM and kvmesh log there).
"""

from __future__ import annotations

import collections
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh.services.worker.tiers import p2p_stats, remote_stats
from kvmesh.services.worker.tiers.misses import MissReason
from kvmesh.services.worker.tiers.remote_stats import PUT_RESULTS

MISS_REASONS = [r.value for r in MissReason]

# What the current step asks the engine to lose before its load: None, "last" (the
# last chunk of the load) or "all".
_drop: dict[str, str | None] = {"mode": None}
# KV events the scheduler-side connector handed to vLLM, by event type.
_events: collections.Counter[str] = collections.Counter()


def _count_events() -> None:
    from kvmesh.services.worker.vllm.connector import KvmeshConnector

    original = KvmeshConnector.take_events

    def take_events(self: KvmeshConnector):
        for event in original(self):
            _events[type(event).__name__] += 1
            yield event

    KvmeshConnector.take_events = take_events  # type: ignore[method-assign]


def _patch_engine() -> None:
    from kvmesh.services.worker.engine import KVEngine

    def drop_before(name: str) -> None:
        original = getattr(KVEngine, name)

        @functools.wraps(original)
        def wrapper(self: KVEngine, tokens: Any, slot_mapping: Any, mask: Any = None, **kw: Any):
            mode = _drop["mode"]
            if mode is not None:
                lookup_id = kw.get("lookup_id")
                if lookup_id is not None:
                    self.release_lookup(lookup_id)  # as if its pins had expired
                chunks = self.chunks(tokens, tenant=kw.get("tenant", ""))
                victims = chunks[-1:] if mode == "last" else chunks
                for _, _, key in victims:
                    self.storage.remove(key)
            return original(self, tokens, slot_mapping, mask, **kw)

        setattr(KVEngine, name, wrapper)

    drop_before("retrieve")
    drop_before("retrieve_layer")


def _engine_stats(instance_id: str) -> dict[str, float]:
    from kvmesh.services.worker.builder import get_engine

    engine = get_engine(instance_id, 0)
    if engine is None:
        return {}
    m = engine.stats.metrics
    names = {
        "tokens_stored": ("tokens_stored_total", None),
        "chunks_stored": ("chunks_stored_total", None),
        "load_errors": ("load_errors_total", None),
        "lookups": ("requests_total", {"op": "lookup"}),
        "retrieves": ("requests_total", {"op": "retrieve"}),
        "tokens_hit_l1": ("tokens_hit_total", {"tier": "l1"}),
        "store_seconds": ("op_latency_seconds_sum", {"op": "store"}),
        "lookup_seconds": ("op_latency_seconds_sum", {"op": "lookup"}),
        "retrieve_seconds": ("op_latency_seconds_sum", {"op": "retrieve"}),
        "lookup_server_requests": ("lookup_server_requests_total", {"kind": "lookup"}),
    }
    for result in PUT_RESULTS:
        names[f"remote_puts_{result}"] = ("remote_puts_total", {"result": result})
    for result in remote_stats.LOOKUP_RESULTS:
        names[f"remote_lookups_{result}"] = ("remote_lookups_total", {"result": result})
    names["tokens_hit_p2p"] = ("tokens_hit_total", {"tier": "p2p"})
    names["p2p_received_bytes"] = ("p2p_received_bytes_total", None)
    for result in p2p_stats.GET_RESULTS:
        names[f"p2p_gets_{result}"] = ("p2p_gets_total", {"result": result})
    for result in p2p_stats.LOOKUP_RESULTS:
        names[f"p2p_lookups_{result}"] = ("p2p_lookups_total", {"result": result})
    out = {}
    for key, (name, labels) in names.items():
        value = m.value(name, labels)
        out[key] = float(value) if value is not None else 0.0
    # Misses by tier and reason: only those that happened (most are 0).
    for tier in (t.name for t in engine.storage.tiers):
        for reason in MISS_REASONS:
            value = m.value("chunk_misses_total", {"tier": tier, "reason": reason})
            if value:
                out[f"misses_{tier}_{reason}"] = float(value)
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("connector") is not None:
        _patch_engine()
        _count_events()
        kv = KVTransferConfig(
            kv_connector="KvmeshConnector",
            kv_connector_module_path="kvmesh.services.worker.vllm.connector",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    args: dict[str, Any] = {
        "model": spec["model"],
        "tokenizer": spec["model"],
        "dtype": spec.get("dtype", "float32"),
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": spec.get("max_model_len", 4096),
        "seed": 0,
        "kv_transfer_config": kv,
    }
    # llm_kwargs may override the defaults above (a reference run with vLLM's own
    # prefix cache turns it on).
    llm = LLM(**{**args, **spec.get("llm_kwargs", {})})
    startup = time.perf_counter() - t0
    if spec.get("warmup", True):
        # The first forward pass of a process is slow (allocation, kernel set-up):
        # keep it out of the measured steps, with a prompt no step shares.
        no_cache = {"kvmesh": {"skip_save": True, "skip_load": True}}
        extra_args = {"kv_transfer_params": no_cache} if kv else None
        warm = SamplingParams(max_tokens=1, temperature=0, logprobs=5, extra_args=extra_args)
        longest = max((len(step["tokens"]) for step in spec["steps"]), default=256)
        # Slow first passes are per prompt length: warm up with the longest.
        longest = min(longest, spec.get("max_model_len", 4096) - 8)
        warm_tokens = [7 + i % 101 for i in range(longest)]
        llm.generate([{"prompt_token_ids": warm_tokens}], warm, use_tqdm=False)
    results = []
    for i, step in enumerate(spec["steps"]):
        if step.get("pause_s"):
            print(f"kvmesh-session: step {i} pausing", flush=True)
            time.sleep(step["pause_s"])
        extra = {}
        if step.get("kv_transfer_params") is not None:
            extra["kv_transfer_params"] = step["kv_transfer_params"]
        params = SamplingParams(
            max_tokens=step.get("max_tokens", 1),
            temperature=0,
            logprobs=step.get("logprobs", 5),
            extra_args=extra or None,
        )
        _drop["mode"] = step.get("drop")
        t = time.perf_counter()
        prompt: dict[str, Any] = {"prompt_token_ids": step["tokens"]}
        if step.get("cache_salt"):
            prompt["cache_salt"] = step["cache_salt"]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t
        _drop["mode"] = None
        completion = out.outputs[0]
        results.append(
            {
                "output_tokens": list(completion.token_ids),
                "logprobs": [
                    {str(tok): lp.logprob for tok, lp in pos.items()}
                    for pos in (completion.logprobs or [])
                ],
                "num_cached_tokens": out.num_cached_tokens or 0,
                "kvmesh": (out.kv_transfer_params or {}).get("kvmesh_result"),
                "seconds": elapsed,
            }
        )
    instance = (spec.get("connector") or {}).get("instance_id", "")
    stats = _engine_stats(instance) if instance else {}
    return {"startup_s": startup, "steps": results, "engine": stats, "events": dict(_events)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
